"""Which hosts `reap serve` binds and answers. The server has no authentication, so by default it
binds a loopback address only (`check_host`), and answers only requests whose `Host` names the
loopback (or a name allowed with `--allowed-host`) and that carry no foreign browser `Origin`
(`HostPolicy`): a web page cannot reach it through DNS rebinding or a cross-site request.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from reap.errors import ReapError
from reap.serve.app import ApiError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def check_host(host: str, allow_remote: bool) -> None:
    """Refuse a non-loopback bind address unless `allow_remote` (ReapError, exit 2)."""
    if allow_remote or host == "localhost":
        return
    if not _is_loopback(host):
        raise ReapError(f"--host {host} is not a loopback address: the server has no "
                        "authentication; pass --allow-remote to expose it anyway")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class HostPolicy:
    """The host names requests may address: the loopback names, the bind address, and `allowed`
    (`"*"` allows any)."""

    def __init__(self, bind_host: str, allowed: tuple[str, ...] = ()):
        names = {*LOOPBACK_NAMES, bind_host, *allowed} - {"0.0.0.0", "::", ""}
        self.any = "*" in names
        self.names = {_normal(n) for n in names}

    def allows(self, host: str | None) -> bool:
        """Whether a name (or `name:port`, `[v6]:port`) is one this server answers for."""
        if self.any:
            return True
        name = _normal(host or "")
        return name in self.names or _is_loopback(name)

    def check(self, host: str | None, origin: str | None) -> None:
        """ApiError unless a request with these `Host` and `Origin` headers may be answered."""
        if not host:
            raise ApiError(400, "a Host header is required", param="Host")
        if not self.allows(_strip_port(host)):
            raise ApiError(403, f"Host {host!r} is not served here (allow it with "
                                "--allowed-host; this guards against DNS rebinding)",
                           param="Host", code="host_not_allowed")
        if origin is not None and not self.allows(_origin_host(origin)):
            raise ApiError(403, f"cross-origin requests are refused (Origin {origin!r})",
                           param="Origin", code="origin_not_allowed")


def _strip_port(host: str) -> str:
    host = host.strip()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _origin_host(origin: str) -> str | None:
    try:
        return urlsplit(origin.strip()).hostname  # None for "null" and other opaque origins
    except ValueError:
        return None


def _normal(name: str) -> str:
    return name.strip().strip("[]").rstrip(".").lower()
