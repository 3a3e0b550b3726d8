"""HTTP(S) reads for remote checkpoints, sent through huggingface_hub's session (`get_session`:
its connection pool, proxy and TLS settings, and `HF_HUB_OFFLINE=1`, which refuses every
request), with what it does not do: redirects followed only within the first URL's origin
(scheme, host and port), a deadline on each whole request, bodies streamed under a size cap, and
strict checks of a ranged answer (status, Content-Range, Content-Length). Failures are one-line
`CheckpointError`s naming the URL.

Limits, read from the environment when a client is made (or given as arguments):
- `REAP_HTTP_TIMEOUT` seconds (default 30): the longest wait for the connection or any one read.
- `REAP_HTTP_DEADLINE` seconds (default 300): the longest one request may take, from sending it
  to its last body byte, redirects included (a server dripping bytes is cut off there, give or
  take one read). A request is at most 64 MiB (`HttpCache.max_request`): 300 s allows ~220 KB/s.
"""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.parse
from collections.abc import Iterator

from reap.errors import CheckpointError, ReapError

DEFAULT_TIMEOUT = 30.0
DEFAULT_DEADLINE = 300.0
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
    """HTTP(S) GETs with Range and same-origin redirects; counts requests and bytes.

    timeout: seconds for the connection and each read; deadline: seconds for a whole request
    (None: from the environment, see the module docstring); headers: origin -> extra headers
    (a Hub token, for the Hub's origin only). Read a response's body with `body`."""

    def __init__(self, timeout: float | None = None, deadline: float | None = None):
        self.timeout = _seconds("REAP_HTTP_TIMEOUT", DEFAULT_TIMEOUT) if timeout is None else timeout
        self.deadline = (_seconds("REAP_HTTP_DEADLINE", DEFAULT_DEADLINE) if deadline is None
                         else deadline)
        self.requests = 0
        self.bytes = 0
        self.headers: dict[tuple, dict[str, str]] = {}
        self._local = threading.local()  # this thread's open response and its deadline

    def get(self, url: str, start: int | None = None, end: int | None = None):
        """Open a GET of `url` (bytes [start, end) when given); returns the response (status_code,
        headers), following up to 5 same-origin redirects. Connection failures, redirects
        elsewhere and an expired deadline are CheckpointError."""
        headers = {"Accept-Encoding": "identity", **self.headers.get(origin(url), {})}
        if start is not None:
            headers["Range"] = f"bytes={start}-{end - 1}"
        first = origin(url)
        if first[0] not in _PORTS or not first[1]:
            raise CheckpointError(f"{url}: only http and https URLs can be fetched")
        self._local.end = time.monotonic() + self.deadline
        for _ in range(6):
            resp = self._local.resp = self._send(url, headers)
            if resp.status_code not in _REDIRECTS:
                return resp
            self.drop()
            target = urllib.parse.urljoin(url, resp.headers.get("Location", ""))
            if origin(target) != first:
                raise CheckpointError(f"{url}: redirect to {target[:200]} refused (only "
                                      "the same scheme, host and port are followed)")
            url = target
        raise CheckpointError(f"{url}: too many redirects")

    def _send(self, url: str, headers: dict):
        """One request; its answer's head is awaited in a thread for what is left of the deadline
        (a server dripping the head would hold the caller otherwise; a late answer is closed)."""
        import httpx2
        from huggingface_hub.utils import get_session

        session, state, lock, done = get_session(), {}, threading.Lock(), threading.Event()

        def send() -> None:
            try:
                req = session.build_request("GET", url, headers=headers, timeout=self.timeout)
                got = session.send(req, stream=True, follow_redirects=False)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                got = e
            with lock:
                if state.get("late") and isinstance(got, httpx2.Response):
                    got.close()
                state["got"] = got
            done.set()

        threading.Thread(target=send, daemon=True).start()
        self.requests += 1
        done.wait(max(0.0, self._local.end - time.monotonic()))
        with lock:
            state["late"] = "got" not in state
        got = state.get("got")
        if isinstance(got, httpx2.TimeoutException):
            raise CheckpointError(f"{url}: request failed (timed out after {self.timeout:g} s, "
                                  "REAP_HTTP_TIMEOUT)")
        if isinstance(got, (httpx2.HTTPError, OSError)):  # OSError: HF_HUB_OFFLINE's refusal
            raise CheckpointError(f"{url}: request failed ({str(got)[:200]})")
        if isinstance(got, BaseException):
            raise got
        self._check_deadline(url, got)
        return got

    def _check_deadline(self, url: str, resp=None) -> None:
        if resp is None or time.monotonic() > self._local.end:
            if resp is not None:
                resp.close()
            raise CheckpointError(f"{url}: no complete answer within the {self.deadline:g} s "
                                  "deadline (REAP_HTTP_DEADLINE)")

    def body(self, resp, url: str, want: int | None = None,
             limit: int | None = None) -> Iterator[bytes]:
        """The body of a response from `get` in pieces as they arrive: at most `want` bytes
        (None: all); CheckpointError once more than `limit` bytes came or the deadline passed.
        A connection that fails mid-body raises httpx2.HTTPError (or OSError). Closes `resp`."""
        got = 0
        try:
            for piece in resp.iter_raw():
                self._check_deadline(url, resp)
                piece = piece[: None if want is None else want - got]
                got += len(piece)
                if limit is not None and got > limit:
                    raise CheckpointError(f"{url}: larger than the limit of {limit} bytes")
                self.bytes += len(piece)
                yield piece
                if got == want:
                    break
        finally:
            resp.close()

    def drop(self) -> None:
        """Close this thread's open response (after an error, or to leave its body unread)."""
        resp = getattr(self._local, "resp", None)
        if resp is not None:
            resp.close()


def check_status(resp, url: str, a: int, b: int) -> None:
    """CheckpointError unless `resp` is the 206 answer to a Range request for bytes [a, b)."""
    if resp.status_code == 206:
        return
    if resp.status_code == 404:
        raise CheckpointError(f"{url}: not found (HTTP 404)")
    if resp.status_code == 416:
        raise CheckpointError(f"{url}: bytes {a}-{b - 1} not satisfiable (HTTP 416): the "
                              "server's file is shorter than expected")
    if resp.status_code == 200:
        raise CheckpointError(f"{url}: the server ignored the Range request (HTTP 200); "
                              "serving weights over HTTP needs Range support")
    raise CheckpointError(f"{url}: HTTP {resp.status_code} {resp.reason_phrase}")


def content_range(resp, url: str, a: int, b: int, size: int | None) -> int:
    """Check a 206 answer's Content-Range (and Content-Length) against the request; returns the
    file size it states."""
    value = resp.headers.get("Content-Range", "")
    m = re.fullmatch(r"bytes (\d{1,19})-(\d{1,19})/(\d{1,19})", value.strip())
    if m is None:
        raise CheckpointError(f"{url}: missing or malformed Content-Range {value[:100]!r}")
    first, last, total = map(int, m.groups())
    if size is not None and total != size:
        raise CheckpointError(f"{url}: server now says {total} bytes, earlier {size} "
                              "(the file changed; clear the cache)")
    if first != a or last != min(b, total) - 1:
        raise CheckpointError(f"{url}: asked bytes {a}-{b - 1}, server sent {first}-{last}")
    length = resp.headers.get("Content-Length")
    if length is not None and length.strip() != str(last - first + 1):
        raise CheckpointError(f"{url}: Content-Length {length[:40]!r} does not match {value}")
    return total
