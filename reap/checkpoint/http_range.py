"""Minimal HTTP(S) client for remote checkpoints: keep-alive GETs with Range, same-origin
redirects, a read timeout and a deadline per request, bodies streamed under a size cap, and
strict checks of a ranged answer (status, Content-Range, Content-Length). Failures are one-line
`CheckpointError`s naming the URL.

Limits, read from the environment when a client is made (or given as arguments):
- `REAP_HTTP_TIMEOUT` seconds (default 30): the longest wait for the connection or any one read.
- `REAP_HTTP_DEADLINE` seconds (default 300): the longest one request may take, from sending it
  to its last body byte, redirects included (a server dripping bytes is cut off there). A
  request is at most 64 MiB (`HttpCache.max_request`): 300 s allows ~220 KB/s.
Redirects are followed only within the origin (scheme, host and port) of the first URL.
"""

from __future__ import annotations

import http.client
import os
import re
import socket
import threading
import urllib.parse
from collections.abc import Iterator

from reap.errors import CheckpointError, ReapError

DEFAULT_TIMEOUT = 30.0
DEFAULT_DEADLINE = 300.0
_PIECE = 1 << 20  # the largest piece `body` yields
_REDIRECTS = (301, 302, 303, 307, 308)
_PORTS = {"http": 80, "https": 443}


def _seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 1e7:
        raise ReapError(f"{name}: expected a number of seconds > 0, got {value!r}")
    return seconds


def origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of a URL, the port made explicit for http and https."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        raise CheckpointError(f"{url}: bad port in URL") from None
    return scheme, (parts.hostname or "").lower(), port or _PORTS.get(scheme)


class HttpClient:
    """Keep-alive HTTP(S) GETs with Range and same-origin redirects; counts requests and bytes.

    timeout: seconds for the connection and each read; deadline: seconds for a whole request
    (None: from the environment, see the module docstring). Read a response's body with `body`,
    which also ends the request's deadline."""

    def __init__(self, timeout: float | None = None, deadline: float | None = None):
        self.timeout = _seconds("REAP_HTTP_TIMEOUT", DEFAULT_TIMEOUT) if timeout is None else timeout
        self.deadline = (_seconds("REAP_HTTP_DEADLINE", DEFAULT_DEADLINE) if deadline is None
                         else deadline)
        self.requests = 0
        self.bytes = 0
        self.headers: dict[tuple, dict[str, str]] = {}  # origin -> extra headers (a Hub token)
        self._conns: dict[tuple[str, str], http.client.HTTPConnection] = {}
        self._timer: threading.Timer | None = None
        self._expired = False

    # ---- the deadline: a timer shuts the sockets down, which ends any blocked read ---------

    def _arm(self) -> None:
        self._disarm()
        self._expired = False
        self._timer = threading.Timer(self.deadline, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._expired = True
        for conn in list(self._conns.values()):
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _check_deadline(self, url: str) -> None:
        if self._expired:
            self.drop()
            raise CheckpointError(f"{url}: no complete answer within the {self.deadline:g} s "
                                  "deadline (REAP_HTTP_DEADLINE)")

    # ---- requests ---------------------------------------------------------------------------

    def get(self, url: str, start: int | None = None, end: int | None = None):
        """Open a GET of `url` (bytes [start, end) when given); returns the response, following
        up to 5 same-origin redirects. Connection failures, redirects elsewhere and an expired
        deadline are CheckpointError."""
        headers = {"Accept-Encoding": "identity", **self.headers.get(origin(url), {})}
        if start is not None:
            headers["Range"] = f"bytes={start}-{end - 1}"
        first = origin(url)
        self._arm()
        try:
            for _ in range(6):
                resp = self._send(url, headers)
                if resp.status not in _REDIRECTS:
                    return resp
                self.drop()  # the redirect's body is not read: a fresh connection is simpler
                target = urllib.parse.urljoin(url, resp.getheader("Location", ""))
                if origin(target) != first:
                    raise CheckpointError(f"{url}: redirect to {target[:200]} refused (only "
                                          "the same scheme, host and port are followed)")
                url = target
            raise CheckpointError(f"{url}: too many redirects")
        except BaseException:
            self._disarm()
            raise

    def body(self, resp, url: str, want: int | None = None,
             limit: int | None = None) -> Iterator[bytes]:
        """The body of a response from `get` in pieces as they arrive: at most `want` bytes
        (None: all); CheckpointError once more than `limit` bytes came or the deadline passed.
        A body cut short just ends (the caller compares what it got); connection errors pass
        through as OSError or HTTPException. Ends the request's deadline."""
        got = 0
        try:
            while want is None or got < want:
                self._check_deadline(url)
                n = _PIECE if want is None else min(_PIECE, want - got)
                try:
                    piece = resp.read1(n)
                except (OSError, http.client.HTTPException):
                    self._check_deadline(url)
                    raise
                if not piece:
                    break
                got += len(piece)
                if limit is not None and got > limit:
                    self.drop()
                    raise CheckpointError(f"{url}: larger than the limit of {limit} bytes")
                self.bytes += len(piece)
                yield piece
            self._check_deadline(url)
            if resp.length == 0:  # read1 leaves a finished response open: close it so the
                resp.read()  # kept-alive connection takes the next request
        finally:
            self._disarm()

    def read_all(self, resp, url: str, limit: int) -> bytes:
        """A whole response body from `get`, refused past `limit` bytes (see `body`)."""
        try:
            return b"".join(self.body(resp, url, limit=limit))
        except (OSError, http.client.HTTPException) as e:
            self.drop()
            raise CheckpointError(f"{url}: download failed ({type(e).__name__})") from None

    def _send(self, url: str, headers: dict):
        parts = urllib.parse.urlsplit(url)
        key = (parts.scheme.lower(), parts.netloc)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        for attempt in range(2):  # a kept-alive connection the server closed: retry once
            conn = self._conns.get(key) or self._connect(url, parts)
            self._conns[key] = conn
            try:
                conn.request("GET", path, headers=headers)
                self.requests += 1
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                self._conns.pop(key, None)
                self._check_deadline(url)
                if attempt:
                    raise CheckpointError(f"{url}: request failed ({e})") from None
            else:
                self._check_deadline(url)
                return resp
        raise AssertionError("unreachable")

    def _connect(self, url: str, parts) -> http.client.HTTPConnection:
        scheme = parts.scheme.lower()
        if scheme not in _PORTS or not parts.hostname:
            raise CheckpointError(f"{url}: only http and https URLs can be fetched")
        cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        return cls(parts.hostname, parts.port, timeout=self.timeout)

    def drop(self) -> None:
        """Close all connections and end the request (after an error mid-body, or to leave a
        body unread, the connection is unusable)."""
        self._disarm()
        for c in list(self._conns.values()):
            c.close()
        self._conns.clear()


def check_status(resp, url: str, a: int, b: int) -> None:
    """CheckpointError unless `resp` is the 206 answer to a Range request for bytes [a, b)."""
    if resp.status == 206:
        return
    if resp.status == 404:
        raise CheckpointError(f"{url}: not found (HTTP 404)")
    if resp.status == 416:
        raise CheckpointError(f"{url}: bytes {a}-{b - 1} not satisfiable (HTTP 416): the "
                              "server's file is shorter than expected")
    if resp.status == 200:
        raise CheckpointError(f"{url}: the server ignored the Range request (HTTP 200); "
                              "serving weights over HTTP needs Range support")
    raise CheckpointError(f"{url}: HTTP {resp.status} {resp.reason}")


def content_range(resp, url: str, a: int, b: int, size: int | None) -> int:
    """Check a 206 answer's Content-Range (and Content-Length) against the request; returns the
    file size it states."""
    value = resp.getheader("Content-Range", "")
    m = re.fullmatch(r"bytes (\d{1,19})-(\d{1,19})/(\d{1,19})", value.strip())
    if m is None:
        raise CheckpointError(f"{url}: missing or malformed Content-Range {value[:100]!r}")
    first, last, total = map(int, m.groups())
    if size is not None and total != size:
        raise CheckpointError(f"{url}: server now says {total} bytes, earlier {size} "
                              "(the file changed; clear the cache)")
    if first != a or last != min(b, total) - 1:
        raise CheckpointError(f"{url}: asked bytes {a}-{b - 1}, server sent {first}-{last}")
    length = resp.getheader("Content-Length")
    if length is not None and length.strip() != str(last - first + 1):
        raise CheckpointError(f"{url}: Content-Length {length[:40]!r} does not match {value}")
    return total
