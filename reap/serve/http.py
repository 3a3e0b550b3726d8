"""The OpenAI-compatible HTTP server (standard library only): routing, bodies, responses.

Routes: GET /v1/models, GET /v1/models/{id}, POST /v1/completions, POST /v1/chat/completions
(both with `stream: true` as server-sent events), GET /health. Every error, from any method or
malformed request, has OpenAI's JSON shape `{"error": {"message", "type", "param", "code"}}` and
closes the connection. The work behind each route is `reap.serve.app.App`'s; this module only
moves JSON in and out.
"""

from __future__ import annotations

import io
import json
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any

from reap.errors import ReapError
from reap.serve.app import ApiError, App, Job, wait_events
from reap.serve.hosts import HostPolicy, check_host
from reap.serve.limits import LINGER, DeadlineReader, LimitedServer, Limits, linger, read_body
from reap.serve.stream import SSE_DONE, Reply, sse_event

ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


class Handler(BaseHTTPRequestHandler):
    """Routes HTTP requests to the `App` set on the server as `server.app`, under the server's
    `limits` and `hosts` policy."""

    protocol_version = "HTTP/1.1"
    server_version = "reap"

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # replaced by a reader under the per-request deadline
        self.reader = DeadlineReader(self.connection, self.limits.read_timeout)
        self.rfile = io.BufferedReader(self.reader)
        self.answered = self.lingering = False

    def finish(self) -> None:
        super().finish()
        if self.lingering:  # after an error the request may still be arriving
            linger(self.connection, min(LINGER, self.limits.read_timeout))

    def log_message(self, format: str, *args: Any) -> None:  # quiet unless asked
        if getattr(self.server, "verbose", False):
            super().log_message(format, *args)

    @property
    def app(self) -> App:
        return self.server.app  # type: ignore[attr-defined]

    @property
    def limits(self) -> Limits:
        return self.server.limits  # type: ignore[attr-defined]

    def handle_one_request(self) -> None:
        self.reader.begin()
        self.answered = False
        # what an answer needs if the request line never arrives whole (a 408)
        self.command, self.requestline, self.request_version = None, "", "HTTP/1.1"
        super().handle_one_request()  # a timed-out read ends it with close_connection set
        if self.reader.expired and self.reader.received and not self.answered:
            self._error(ApiError(408, f"request not received within {self.limits.read_timeout:g}"
                                      " s (--read-timeout)", code="request_timeout"))

    def parse_request(self) -> bool:
        if not super().parse_request():
            if not self.answered:  # the standard server drops an empty request line unanswered
                self.send_error(400, "empty request line")
            return False
        return True

    def send_response(self, code: int, message: str | None = None) -> None:
        self.connection.settimeout(self.limits.read_timeout)  # bounds writes to a stalled client
        self.answered = True
        super().send_response(code, message)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The standard server's protocol errors (bad request line, headers, unknown method), as
        JSON."""
        if self.request_version == "HTTP/0.9":  # a request line not understood: answer 1.1
            self.request_version = "HTTP/1.1"
        type_ = "server_error" if code >= 500 else "invalid_request_error"
        self._error(ApiError(code, message or HTTPStatus(code).phrase, type_))

    def _refuse_method(self) -> None:
        self._error(ApiError(405, f"method {self.command} is not allowed (GET or POST)",
                             code="method_not_allowed"), ("Allow", "GET, POST"))

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD = do_TRACE = _refuse_method

    def do_GET(self) -> None:
        try:
            self.server.hosts.check(self.headers.get("Host"), self.headers.get("Origin"))
        except ApiError as e:
            return self._error(e)
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
            self.server.hosts.check(self.headers.get("Host"), self.headers.get("Origin"))
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
        media = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if media != "application/json":
            raise ApiError(415, "the request body must be JSON with 'Content-Type: "
                                "application/json'", code="unsupported_media_type")
        data = read_body(self.rfile, self.headers, self.limits.max_body)
        try:
            body = json.loads(data)
        except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
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
        except OSError:  # includes a write timeout
            job.cancelled.set()  # the client left: stop generating for it

    def _event(self, obj: dict) -> None:
        self.wfile.write(sse_event(obj))
        self.wfile.flush()

    def _json(self, status: int, obj: dict, *headers: tuple[str, str]) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        for name, value in (("Content-Type", "application/json"),
                            ("Content-Length", str(len(data))), *headers):
            self.send_header(name, value)
        if status >= 400:  # the rest of the request may be unread: close, lingering
            self.send_header("Connection", "close")
            self.lingering = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, e: ApiError, *headers: tuple[str, str]) -> None:
        self._json(e.status, e.body(), *headers)


class Server:
    """A running server: `Server(backend, host, port).start()`; `.url`; `.stop()`. It answers
    requests addressed to the loopback, `host` or `allowed_hosts` ("*": any) under `limits`."""

    def __init__(self, backend, host: str = "127.0.0.1", port: int = 8000,
                 queue_size: int = 16, max_tokens_limit: int = 4096, allow_remote: bool = False,
                 verbose: bool = False, limits: Limits | None = None,
                 allowed_hosts: tuple[str, ...] = ()):
        check_host(host, allow_remote)
        limits = limits or Limits()
        limits.check()
        limits = limits.resolved(getattr(backend, "context", None) or max_tokens_limit)
        try:
            self.httpd = LimitedServer((host, port), Handler, limits)
        except OSError as e:
            raise ReapError(f"cannot listen on {host}:{port}: {e.strerror or e}", 1) from None
        self.app = App(backend, queue_size, max_tokens_limit, limits.max_prompt_chars)
        self.httpd.app, self.httpd.verbose = self.app, verbose  # type: ignore[attr-defined]
        self.httpd.hosts = HostPolicy(host, tuple(allowed_hosts))  # type: ignore[attr-defined]
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
        """Stop accepting, cancel the running and queued jobs, close the backend (left to the
        process's exit when the engine does not stop within 5 s)."""
        if self._thread is not None:
            self.httpd.shutdown()
        self.httpd.server_close()
        if self.app.worker.stop():
            self.app.backend.close()
