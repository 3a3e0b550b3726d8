"""The OpenAI-compatible HTTP server (standard library only): routing, bodies, responses.

Routes: GET /v1/models, GET /v1/models/{id}, POST /v1/completions, POST /v1/chat/completions
(both with `stream: true` as server-sent events), GET /health. Errors use OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`: 400 bad request, 404 unknown route or model,
413 body too large, 503 queue full, 500 generation failure. The work behind each route is
`reap.serve.app.App`'s; this module only moves JSON in and out.
"""

from __future__ import annotations

import ipaddress
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from reap.errors import ReapError
from reap.serve.app import ApiError, App, Job, wait_events
from reap.serve.stream import SSE_DONE, Reply, sse_event

MAX_BODY = 8 << 20  # bytes of JSON per request
ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


class Handler(BaseHTTPRequestHandler):
    """Routes HTTP requests to the `App` set on the server as `server.app`."""

    protocol_version = "HTTP/1.1"
    server_version = "reap"

    def log_message(self, format: str, *args: Any) -> None:  # quiet unless asked
        if getattr(self.server, "verbose", False):
            super().log_message(format, *args)

    @property
    def app(self) -> App:
        return self.server.app  # type: ignore[attr-defined]

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/v1/models":
            return self._json(200, self.app.models())
        if path.startswith("/v1/models/"):
            card = self.app.models()["data"][0]
            if path[len("/v1/models/"):] == card["id"]:
                return self._json(200, card)
            return self._error(ApiError(404, "no such model", code="model_not_found"))
        if path == "/health":
            return self._json(200, {"status": "ok", "queued": self.app.worker.jobs.qsize(),
                                    "served": self.app.worker.served})
        self._error(ApiError(404, f"no route GET {path}"))

    def do_POST(self) -> None:
        route = ROUTES.get(self.path.split("?", 1)[0].rstrip("/"))
        try:
            if route is None:
                raise ApiError(404, f"no route POST {self.path}")
            body = self._body()
            job, reply = self.app.prepare(route, body)
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise ApiError(400, "'stream' must be true or false", param="stream")
            self.app.worker.submit(job)
        except ApiError as e:
            return self._error(e)
        if stream:
            opts = body.get("stream_options") or {}
            self._stream(job, reply, isinstance(opts, dict) and opts.get("include_usage") is True)
        else:
            self._collect(job, reply)

    def _body(self) -> dict:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise ApiError(400, "a JSON body with Content-Length is required") from None
        if length > MAX_BODY:
            self.close_connection = True
            raise ApiError(413, f"request body over {MAX_BODY} bytes")
        try:
            body = json.loads(self.rfile.read(length))
        except ValueError as e:
            raise ApiError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        return body

    def _collect(self, job: Job, reply: Reply) -> None:
        parts = []
        for ev in wait_events(job):
            if ev[0] == "delta":
                parts.append(ev[1])
            elif ev[0] == "error":
                return self._error(ev[1])
            else:
                self._json(200, reply.whole("".join(parts), ev[1], ev[2]))

    def _stream(self, job: Job, reply: Reply, include_usage: bool) -> None:
        self.send_response(200)
        for k, v in (("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache"),
                     ("Connection", "close")):
            self.send_header(k, v)
        self.end_headers()
        self.close_connection = True
        try:
            if reply.chat:
                self._event(reply.chunk("", first=True))
            for ev in wait_events(job):
                if ev[0] == "delta":
                    self._event(reply.chunk(ev[1]))
                elif ev[0] == "error":
                    self._event(ev[1].body())
                else:
                    self._event(reply.chunk("", finish=ev[1]))
                    if include_usage:
                        self._event({**reply.chunk(""), "choices": [], "usage": reply.usage(ev[2])})
            self.wfile.write(SSE_DONE)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            job.cancelled.set()  # the client left: stop generating for it

    def _event(self, obj: dict) -> None:
        self.wfile.write(sse_event(obj))
        self.wfile.flush()

    def _json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, e: ApiError) -> None:
        self._json(e.status, e.body())


class Server:
    """A running server: `Server(backend, host, port).start()`; `.url`; `.stop()`."""

    def __init__(self, backend, host: str = "127.0.0.1", port: int = 8000,
                 queue_size: int = 16, max_tokens_limit: int = 4096, allow_remote: bool = False,
                 verbose: bool = False):
        check_host(host, allow_remote)
        try:
            self.httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as e:
            raise ReapError(f"cannot listen on {host}:{port}: {e.strerror or e}", 1) from None
        self.app = App(backend, queue_size, max_tokens_limit)
        self.httpd.daemon_threads = True
        self.httpd.app, self.httpd.verbose = self.app, verbose  # type: ignore[attr-defined]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        host = f"[{host}]" if ":" in str(host) else host
        return f"http://{host}:{port}/v1"

    def start(self) -> Server:
        """Serve in a background thread (tests, notebooks)."""
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting, finish the current job, close the backend."""
        if self._thread is not None:
            self.httpd.shutdown()
        self.httpd.server_close()
        self.app.worker.stop()
        self.app.backend.close()


def check_host(host: str, allow_remote: bool) -> None:
    """Refuse a non-loopback bind address unless `allow_remote` (ReapError, exit 2)."""
    if allow_remote or host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ReapError(f"--host {host} is not a loopback address: the server has no "
                        "authentication; pass --allow-remote to expose it anyway")
