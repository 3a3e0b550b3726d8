"""`reap serve`: an OpenAI-compatible HTTP server on the streaming engine (standard library only).

Routes: GET /v1/models, GET /v1/models/{id}, POST /v1/completions, POST /v1/chat/completions
(both with `stream: true` as server-sent events), GET /health. Errors use OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`: 400 bad request, 404 unknown route or model,
413 body too large, 503 queue full, 500 generation failure.

One model instance serves everything: a single worker thread owns the engine and runs one request
at a time; HTTP threads only parse, enqueue and format, so a long generation can never interleave
with another request's state. Requests wait in a bounded queue (503 when it is full).

The worker drives a backend (`EngineBackend`, or any object with the same members): `model_id`,
`template` (a `ChatTemplate`), `eos_id`, `special` (special token text -> id), `context` (tokens,
or None), `encode(text)`, `decode(ids)`, `tokens(ids, *, max_tokens, temperature, top_p, seed)`
(a generator of generated ids), `expert_failures` (a list that grows when an expert fails to
load) and `close()`. Detokenization, stop strings, end-of-turn ids and `max_tokens` are handled
here, identically for every backend; generation stops early by closing the iterator. With no
`seed`, requests use seed 0: the same request gives the same text (decoding is deterministic).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import queue
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from reap.engine import chat
from reap.errors import EXIT_USAGE, ReapError

MAX_BODY = 8 << 20  # bytes of JSON per request
_ERROR_TYPE = {400: "invalid_request_error", 500: "server_error"}
ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


class ApiError(Exception):
    """An HTTP error with OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param,
                          "code": self.code}}


# --------------------------------------------------------------------------- worker

@dataclass
class Job:
    """One queued generation; the worker posts ("delta", text), ("done", finish_reason, n_tokens)
    or ("error", ApiError) to `events`."""

    ids: list[int]
    params: chat.Params
    stop: tuple[str, ...] = ()
    stop_ids: set = field(default_factory=set)  # token ids that end generation (EOS, <|im_end|>)
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)


class Worker:
    """The one thread that owns the backend; runs queued jobs one at a time, in order."""

    def __init__(self, backend, queue_size: int = 16):
        self.backend = backend
        self.jobs: queue.Queue = queue.Queue(maxsize=queue_size)
        self.served = 0
        self.thread = threading.Thread(target=self._loop, name="reap-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        """Enqueue `job`; ApiError(503) when the queue is full."""
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise ApiError(503, "the server is busy: request queue is full, retry later",
                           type_="server_error", code="queue_full") from None

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def _loop(self) -> None:
        while (job := self.jobs.get()) is not None:
            try:
                self._run(job)
            except ApiError as e:
                job.events.put(("error", e))
            except ReapError as e:  # the engine refused the request, or failed
                status = 400 if e.exit_code == EXIT_USAGE else 500
                job.events.put(("error", ApiError(status, str(e), _ERROR_TYPE[status])))
            except Exception as e:  # noqa: BLE001 - must not kill the server
                job.events.put(("error", ApiError(500, f"generation failed: {e}", "server_error")))
            self.served += 1

    def _run(self, job: Job) -> None:
        p, b = job.params, self.backend
        failed = len(b.expert_failures)
        stream = chat.TextStream(b.decode, job.stop + p.stop)
        it = b.tokens(job.ids, max_tokens=p.max_tokens, temperature=p.temperature,
                      top_p=p.top_p, seed=p.seed)
        n, reason = 0, "length"
        try:
            for token in it:
                n += 1
                if token in job.stop_ids or job.cancelled.is_set():
                    reason = "stop"
                    break
                delta = stream.feed(token)
                if delta:
                    job.events.put(("delta", delta))
                if stream.done or n >= p.max_tokens:
                    reason = "stop" if stream.done else reason
                    break
        finally:
            it.close()  # ends the engine's generation early, if it is still running
        if tail := stream.flush():
            job.events.put(("delta", tail))
        if lost := b.expert_failures[failed:]:  # untrustworthy tokens: an error, not text
            layer, expert, why = lost[0]
            raise ApiError(500, f"{len(lost)} routed expert load(s) failed (first: layer {layer} "
                                f"expert {expert}: {why}); the output is not trustworthy",
                           "server_error", code="expert_load_failed")
        job.events.put(("done", reason, n))


# --------------------------------------------------------------------------- responses

class Reply:
    """Formats one job's events as an OpenAI completion or (`is_chat`) chat completion."""

    def __init__(self, model: str, prompt_tokens: int, is_chat: bool, thinking: bool = False):
        self.model, self.prompt_tokens, self.chat = model, prompt_tokens, is_chat
        self.id = ("chatcmpl-" if is_chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.splitter = chat.ReasoningSplitter(thinking) if is_chat else None

    def _head(self, stream: bool) -> dict:
        kind = "chat.completion" + (".chunk" if stream else "") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": "reap"}

    def _choice(self, text: str, finish: str | None, stream: bool) -> dict:
        c: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if not self.chat:
            return {**c, "text": text}
        reasoning, content = self.splitter.feed(text)
        if finish is not None:  # the end: whatever the splitter still holds
            r, t = self.splitter.flush()
            reasoning, content = reasoning + r, content + t
        if stream:
            parts = (("reasoning_content", reasoning), ("content", content))
            return {**c, "delta": {k: v for k, v in parts if v}}
        message = {"role": "assistant", "content": content}
        return {**c, "message": message | ({"reasoning_content": reasoning} if reasoning else {})}

    def chunk(self, text: str, finish: str | None = None, first: bool = False) -> dict:
        """One streamed chunk carrying `text` (may be empty) and an optional finish reason;
        a chat stream's `first` chunk announces the assistant role."""
        choice = self._choice(text, finish, stream=True)
        if first and self.chat:
            choice["delta"] = {"role": "assistant", "content": ""}
        return {**self._head(True), "choices": [choice]}

    def usage(self, n: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n,
                "total_tokens": self.prompt_tokens + n}

    def whole(self, text: str, finish: str, n: int) -> dict:
        """The non-streamed response."""
        return {**self._head(False), "choices": [self._choice(text, finish, stream=False)],
                "usage": self.usage(n)}


class App:
    """Request handling independent of HTTP plumbing: validation, queueing, models list."""

    def __init__(self, backend, queue_size: int = 16, max_tokens_limit: int = 4096):
        self.backend = backend
        self.limit = max_tokens_limit
        self.worker = Worker(backend, queue_size)
        self.created = int(time.time())

    def models(self) -> dict:
        card = {"id": self.backend.model_id, "object": "model", "created": self.created,
                "owned_by": "reap"}
        return {"object": "list", "data": [card]}

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model not in (None, "", self.backend.model_id):
            raise ApiError(404, f"model {model!r} does not exist; this server serves "
                                f"{self.backend.model_id!r}", param="model", code="model_not_found")

    def prepare(self, route: str, body: dict) -> tuple[Job, Reply]:
        """Validate a POST body and build its job and reply formatter (ApiError on bad input)."""
        self._check_model(body)
        b, is_chat = self.backend, route == "chat"
        stop, thinking = (), False
        try:
            if not is_chat:
                ids = chat.completion_ids(body, b.encode, b.special)
            else:
                messages = chat.parse_messages(body.get("messages"))
                prompt = b.template.render(messages, chat.thinking_option(body),
                                           chat.template_kwargs(body))
                ids = chat.encode_prompt(prompt, b.encode, b.special)
                stop, thinking = b.template.stop, b.template.opens_thinking(prompt)
            context = getattr(b, "context", None)
            room = self.limit if context is None else min(self.limit, context - len(ids))
            if room < 1:
                where = "messages" if is_chat else "prompt"
                raise chat.ChatError(f"the prompt of {len(ids)} tokens leaves no room in the "
                                     f"{context}-token context", where)
            default = room if is_chat else min(16, room)
            params = chat.parse_params(body, default_max=default, limit=room)
        except chat.ChatError as e:
            raise ApiError(400, str(e), param=e.param) from None
        stop_ids = {b.special[s] for s in stop if s in b.special} | {b.eos_id}
        return Job(ids, params, stop, stop_ids), Reply(b.model_id, len(ids), is_chat, thinking)


def wait_events(job: Job) -> Iterator[tuple]:
    """The job's events until its final one."""
    while True:
        ev = job.events.get()
        yield ev
        if ev[0] != "delta":
            return


# --------------------------------------------------------------------------- HTTP

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
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            job.cancelled.set()  # the client left: stop generating for it

    def _event(self, obj: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
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


# --------------------------------------------------------------------------- engine + CLI

class EngineBackend:
    """The server's backend over a `reap.engine.Engine`; only the worker thread calls it."""

    def __init__(self, engine, model_id: str, template_dir: str | os.PathLike):
        tok = engine.tokenizer
        if tok is None:
            raise ReapError(f"{engine.path}: no tokenizer.json; the server needs a tokenizer")
        self.engine, self.model_id, self.context = engine, model_id, engine.context
        self.encode, self.decode, self.eos_id = tok.encode, tok.decode, tok.eos_id
        self.special = chat.special_tokens(tok)
        self.template = chat.ChatTemplate.from_dir(template_dir)

    def tokens(self, ids, *, max_tokens, temperature, top_p, seed) -> Iterator[int]:
        return self.engine.stream(ids, max_tokens=max_tokens, temperature=temperature,
                                  top_p=top_p, seed=seed)

    @property
    def expert_failures(self) -> list:
        return self.engine.expert_failures

    def close(self) -> None:
        self.engine.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of `reap serve`."""
    from reap.engine.memory import PRESET_HELP, PRESETS

    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory or http(s) URL of one (fetched on demand into "
                        "~/.cache/reap/http); default: the bundled default model")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any)")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a non-loopback --host (the server has no authentication)")
    p.add_argument("--served-name", help="model id clients use (default: the MODEL's name)")
    p.add_argument("--queue", type=int, default=16, help="requests that may wait (default 16)")
    mem = p.add_mutually_exclusive_group()
    mem.add_argument("--budget", help="RAM budget, e.g. 8GB (the whole process)")
    mem.add_argument("--preset", choices=list(PRESETS), help=PRESET_HELP)
    p.add_argument("--context", type=int, default=4096, help="prompt + generated tokens (4096)")
    p.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens (4096)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--verbose", action="store_true", help="log every HTTP request")


def open_backend(model: str | None, served_name: str | None = None, **engine_options):
    """Open the engine on `model` (path, URL or None for the default) as a server backend."""
    from reap.engine.core import Engine
    from reap.engine.remote import default_cache_dir, is_url

    engine = Engine.open(model, **engine_options)
    where = default_cache_dir(engine.path) if is_url(engine.path) else engine.path
    name = served_name or os.path.basename(str(engine.path).rstrip("/")) or "model"
    try:
        return EngineBackend(engine, name, where)
    except ReapError:
        engine.close()
        raise


def run(args: argparse.Namespace) -> int:
    """`reap serve`: open the engine, then serve until interrupted."""
    check_host(args.host, args.allow_remote)  # refuse before loading anything
    if args.queue < 1 or args.max_tokens_limit < 1 or (args.threads or 1) < 1:
        raise ReapError("--queue, --max-tokens-limit and --threads must be at least 1")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    backend = open_backend(args.model, args.served_name, budget=args.budget,
                           preset=args.preset, context=args.context, device=args.device,
                           dtype=args.dtype, max_generation=args.max_tokens_limit)
    print(backend.engine.plan.describe(), file=sys.stderr)
    try:
        server = Server(backend, args.host, args.port, args.queue, args.max_tokens_limit,
                        args.allow_remote, args.verbose)
    except ReapError:
        backend.close()
        raise
    print(f"reap serve: {backend.model_id} at {server.url} (Ctrl-C stops)", file=sys.stderr,
          flush=True)
    try:
        server.httpd.serve_forever()  # in this thread, until Ctrl-C (exit 5)
    finally:
        server.stop()
    return 0
