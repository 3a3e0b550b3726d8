"""Minimal HTTP(S) client for remote checkpoints: keep-alive GETs with Range and redirects, and
strict checks of a ranged answer (status, Content-Range, Content-Length), failures named with
the URL as one-line `CheckpointError`s."""

from __future__ import annotations

import http.client
import re
import urllib.parse

from reap.errors import CheckpointError


class HttpClient:
    """Minimal keep-alive HTTP(S) GET with Range and redirects; counts requests and bytes."""

    def __init__(self, timeout: float = 60.0):
        self.timeout = timeout
        self.requests = 0
        self.bytes = 0
        self._conns: dict[tuple[str, str], http.client.HTTPConnection] = {}

    def get(self, url: str, start: int | None = None, end: int | None = None):
        """Open a GET of `url` (bytes [start, end) when given); returns the response, following
        up to 5 redirects. Connection failures are CheckpointError."""
        headers = {"Accept-Encoding": "identity"}
        if start is not None:
            headers["Range"] = f"bytes={start}-{end - 1}"
        for _ in range(6):
            resp = self._send(url, headers)
            if resp.status not in (301, 302, 303, 307, 308):
                return resp
            resp.read()
            url = urllib.parse.urljoin(url, resp.getheader("Location", ""))
        raise CheckpointError(f"{url}: too many redirects")

    def _send(self, url: str, headers: dict):
        parts = urllib.parse.urlsplit(url)
        key = (parts.scheme, parts.netloc)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        for attempt in range(2):  # a kept-alive connection the server closed: retry once
            conn = self._conns.get(key) or self._connect(parts)
            self._conns[key] = conn
            try:
                conn.request("GET", path, headers=headers)
                self.requests += 1
                return conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                self._conns.pop(key, None)
                if attempt:
                    raise CheckpointError(f"{url}: request failed ({e})") from None
        raise AssertionError("unreachable")

    def _connect(self, parts) -> http.client.HTTPConnection:
        if parts.scheme == "https":
            return http.client.HTTPSConnection(parts.hostname, parts.port, timeout=self.timeout)
        return http.client.HTTPConnection(parts.hostname, parts.port, timeout=self.timeout)

    def drop(self) -> None:
        """Close all connections (after an error mid-body the connection is unusable)."""
        for c in self._conns.values():
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
    m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", value.strip())
    if m is None:
        raise CheckpointError(f"{url}: missing or malformed Content-Range {value!r}")
    first, last, total = map(int, m.groups())
    if size is not None and total != size:
        raise CheckpointError(f"{url}: server now says {total} bytes, earlier {size} "
                              "(the file changed; clear the cache)")
    if first != a or last != min(b, total) - 1:
        raise CheckpointError(f"{url}: asked bytes {a}-{b - 1}, server sent {first}-{last}")
    length = resp.getheader("Content-Length")
    if length is not None and int(length) != last - first + 1:
        raise CheckpointError(f"{url}: Content-Length {length} does not match {value}")
    return total
