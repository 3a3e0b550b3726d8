"""Bounds that keep `reap serve` fit for a shared machine: how many connections get a handler
thread (the rest get a 503 answer from one refusing thread), how long a client may take to send
one request (slow clients are dropped), how many bytes a body may have (Content-Length or chunked),
the listen backlog, and the lingering close that keeps an early error answer from being lost to a
TCP reset. `reap.serve.http` builds its server and request handler on these.
"""

from __future__ import annotations

import io
import json
import math
import queue
import re
import selectors
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace
from http.server import ThreadingHTTPServer

from reap.errors import ReapError
from reap.serve.app import ApiError

LINGER = 2.0  # seconds a closing connection keeps discarding what its client still sends
# Prompt characters allowed per token of context, checked before tokenizing so that a huge
# prompt costs neither the tokenizer's time nor its memory (real text averages about 4).
CHARS_PER_TOKEN = 32
# Body bytes allowed per prompt character (a JSON escape spells one character in up to 12;
# real prompts far fewer), within these bounds: a parsed body can take ~25x its bytes.
BODY_BYTES_PER_CHAR, BODY_BOUNDS = 8, (1 << 20, 8 << 20)
MAX_LINGERING = 256  # refused connections lingering at once; beyond that they are closed outright


@dataclass(frozen=True)
class Limits:
    """The server's bounds (each a `reap serve` flag)."""

    max_connections: int = 32  # connections with a handler thread; more are answered 503
    read_timeout: float = 15.0  # seconds to receive one whole request, idle keep-alive included
    max_body: int | None = None  # bytes per request body; None: BODY_BYTES_PER_CHAR per char
    max_prompt_chars: int | None = None  # None: CHARS_PER_TOKEN per token of context
    backlog: int = 256  # connections the kernel queues before the server accepts them

    def check(self) -> None:
        """ReapError (exit 2) when a bound is not positive and finite."""
        values = (self.max_connections, self.read_timeout, self.max_body,
                  self.max_prompt_chars, self.backlog)
        if any(v is not None and not (v > 0 and math.isfinite(v)) for v in values):
            raise ReapError("--max-connections, --read-timeout, --max-body, --max-prompt-chars "
                            "and --backlog must be positive and finite")

    def resolved(self, context: int) -> Limits:
        """These limits with the derived defaults filled in for a `context`-token window."""
        chars = self.max_prompt_chars or CHARS_PER_TOKEN * context
        body = self.max_body or min(max(BODY_BYTES_PER_CHAR * chars, BODY_BOUNDS[0]),
                                    BODY_BOUNDS[1])
        return replace(self, max_prompt_chars=chars, max_body=body)


class DeadlineReader(io.RawIOBase):
    """A socket's receiving side under one deadline per request: `begin()` starts the clock
    (`timeout` seconds for the wait, the headers and the body together); a read after it expires
    raises TimeoutError, so a client trickling bytes cannot hold its thread for long."""

    def __init__(self, sock: socket.socket, timeout: float):
        self.sock, self.timeout = sock, timeout
        self.deadline = time.monotonic() + timeout
        self.received = 0  # bytes of the current request
        self.expired = False

    def begin(self) -> None:
        self.deadline, self.received, self.expired = time.monotonic() + self.timeout, 0, False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.expired = True
            raise TimeoutError("request not received in time")
        self.sock.settimeout(left)
        try:
            n = self.sock.recv_into(buffer)
        except TimeoutError:
            self.expired = True
            raise
        self.received += n
        return n


def read_body(rfile, headers, max_body: int) -> bytes:
    """The request body (Content-Length or chunked), at most `max_body` bytes; ApiError 400
    for a malformed length or chunk, 411 for none, 413 when too large, 501 for other codings."""
    coding = headers.get("Transfer-Encoding")
    lengths = headers.get_all("Content-Length") or []
    if coding is not None:
        if lengths or coding.strip().lower() != "chunked":
            raise ApiError(501 if not lengths else 400,
                           "only 'Transfer-Encoding: chunked' without Content-Length is supported")
        return _read_chunked(rfile, max_body)
    if not lengths:
        raise ApiError(411, "a JSON body with Content-Length (or chunked) is required")
    if len(set(lengths)) > 1 or not re.fullmatch(r"[0-9]{1,19}", lengths[0].strip()):
        raise ApiError(400, f"bad Content-Length {', '.join(lengths)!r}")
    length = int(lengths[0])
    if length > max_body:
        raise ApiError(413, f"request body over {max_body} bytes (--max-body)",
                           code="body_too_large")
    data = rfile.read(length)
    if len(data) < length:
        raise ApiError(400, "request body shorter than its Content-Length")
    return data


def _read_chunked(rfile, max_body: int) -> bytes:
    parts, total = [], 0
    while True:
        line = rfile.readline(1026)
        size = line.split(b";", 1)[0].strip()
        if not line.endswith(b"\n") or not re.fullmatch(rb"[0-9a-fA-F]{1,16}", size):
            raise ApiError(400, "bad chunk size line in a chunked body")
        if (n := int(size, 16)) == 0:
            break
        total += n
        if total > max_body:
            raise ApiError(413, f"request body over {max_body} bytes (--max-body)",
                           code="body_too_large")
        parts.append(rfile.read(n))
        if len(parts[-1]) < n or rfile.readline(3).strip():
            raise ApiError(400, "chunked body cut short or a chunk not followed by CRLF")
    for _ in range(64):  # trailer fields, ignored
        if rfile.readline(8192).strip() == b"":
            return b"".join(parts)
    raise ApiError(400, "too many trailer fields in a chunked body")


def linger(sock: socket.socket, seconds: float) -> None:
    """Half-close `sock`, then discard what the client still sends until it closes or `seconds`
    pass: closing with unread bytes would reset the connection and lose the answer just sent."""
    try:
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(65536):
                return
    except OSError:
        pass


def error_response(error: ApiError) -> bytes:
    """A whole HTTP/1.1 response carrying `error`'s JSON body, closing the connection."""
    body = json.dumps(error.body()).encode()
    head = (f"HTTP/1.1 {error.status} Error\r\nServer: reap\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class Refuser:
    """Answers connections over the cap without a thread each: the accepting thread sends the
    ready-made 503 and half-closes; this one thread discards what those clients still send until
    they close (or LINGER seconds pass), then closes them."""

    def __init__(self, answer: bytes):
        self.answer = answer
        self.incoming: queue.SimpleQueue = queue.SimpleQueue()
        self.refused = 0
        self.thread = threading.Thread(target=self._loop, name="reap-refuser", daemon=True)
        self.thread.start()

    def refuse(self, sock: socket.socket) -> None:
        """Answer `sock` with the 503 now (non-blocking) and hand it over for closing."""
        self.refused += 1
        try:
            sock.setblocking(False)
            sock.send(self.answer)  # a fresh socket's send buffer takes it whole
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            sock.close()
            return
        self.incoming.put(sock)

    def stop(self) -> None:
        self.incoming.put(None)
        self.thread.join(timeout=10)

    def _loop(self) -> None:
        selector, deadlines = selectors.DefaultSelector(), {}
        try:
            while self._take(selector, deadlines):
                for key, _ in selector.select(timeout=0.05):
                    try:
                        more = key.fileobj.recv(65536)
                    except BlockingIOError:
                        continue
                    except OSError:
                        more = b""
                    if not more:
                        _close(selector, deadlines, key.fileobj)
                now = time.monotonic()
                for sock in [s for s, t in deadlines.items() if t < now]:
                    _close(selector, deadlines, sock)
        finally:
            for sock in list(deadlines):
                _close(selector, deadlines, sock)
            selector.close()

    def _take(self, selector, deadlines: dict) -> bool:
        """Register newly refused sockets (blocking while there is nothing to watch); False on
        stop."""
        while True:
            try:
                sock = self.incoming.get(block=not deadlines)
            except queue.Empty:
                return True
            if sock is None:
                return False
            if len(deadlines) >= MAX_LINGERING:
                sock.close()
                continue
            selector.register(sock, selectors.EVENT_READ)
            deadlines[sock] = time.monotonic() + LINGER


def _close(selector, deadlines: dict, sock: socket.socket) -> None:
    selector.unregister(sock)
    del deadlines[sock]
    sock.close()


class LimitedServer(ThreadingHTTPServer):
    """A threading HTTP server with at most `limits.max_connections` handler threads; further
    connections are answered 503 JSON by a `Refuser`. `errors` counts handler exceptions other
    than a client going away (each is printed, as the standard server does)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler, limits: Limits):
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.request_queue_size = limits.backlog  # listen() backlog
        self.limits, self.active, self.errors = limits, 0, 0
        self._lock = threading.Lock()
        busy = ApiError(503, f"the server is busy: {limits.max_connections} connections are open, "
                             "retry later", "server_error", code="too_many_connections")
        super().__init__(address, handler)
        self.refuser = Refuser(error_response(busy))

    def process_request(self, request, client_address) -> None:
        with self._lock:
            admitted = self.active < self.limits.max_connections
            self.active += admitted
        if not admitted:
            return self.refuser.refuse(request)
        try:
            super().process_request(request, client_address)  # starts the handler thread
        except BaseException:
            self._release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def _release(self) -> None:
        with self._lock:
            self.active -= 1

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            return  # the client went away or stalled: nothing to report
        self.errors += 1
        super().handle_error(request, client_address)

    def server_close(self) -> None:
        super().server_close()
        self.refuser.stop()
