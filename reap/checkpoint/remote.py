"""Checkpoints over HTTP(S): fetch on demand with Range requests into a resumable disk cache.

    ck = RemoteCheckpoint.open("https://host/models/k3")   # same interface as Checkpoint
    w = ck.read("model.layers.3.mlp.gate.weight")           # fetches only that tensor's bytes

Opening fetches the small files (config.json, the index, tokenizer files) whole and only the
safetensors headers of the shards; a tensor's bytes are fetched the first time it is read. The
cache (`default_cache_dir`, or `cache_dir`) holds each shard as a sparse file of its full size;
`.reap/<shard>.ranges.json` lists the byte ranges present and `.reap/remote.json` the layout. Data
is written before the sidecar names it and sidecars are replaced atomically, so an interrupted
download resumes where it stopped and a later open makes no request for what is cached. A Hub
URL is opened as a `hub.HubCache` (`hub.open_cache`), which takes what the Hub cache holds.

Every answer is checked (`http_range.py`: status, Content-Range, bytes received, deadlines).
Shard names from an index must be plain `*.safetensors` names (`shard_name`): they cannot escape
the cache nor collide with the small files or `.reap/`. Sizes are capped while they stream
(`SMALL_FILES`; headers 100 MB, `spec.py`); each header is checked as a local shard's is.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import urllib.parse
from pathlib import Path

import httpx2

from reap.cache import cache_dir
from reap.checkpoint.header import check_entries, length_prefix, load_index, parse_header
from reap.checkpoint.http_range import HttpClient, check_status, content_range
from reap.checkpoint.reader import Checkpoint
from reap.checkpoint.spec import (
    INDEX_NAME,
    MAX_HEADER_BYTES,
    MAX_INDEX_BYTES,
    MAX_JSON_BYTES,
    MAX_TOKENIZER_BYTES,
    SINGLE_NAME,
    shard_name,
)
from reap.errors import CheckpointError
from reap.fileio import write_atomic

# Small files fetched whole when present (the first two decide the layout), with size caps.
SMALL_FILES = {"config.json": MAX_JSON_BYTES, INDEX_NAME: MAX_INDEX_BYTES,
               "tokenizer.json": MAX_TOKENIZER_BYTES, "tokenizer_config.json": MAX_JSON_BYTES,
               "chat_template.jinja": MAX_JSON_BYTES, "generation_config.json": MAX_JSON_BYTES,
               "special_tokens_map.json": MAX_JSON_BYTES, "tiktoken.model": MAX_TOKENIZER_BYTES}
_BOOKKEEPING = ".reap"  # hidden: no shard name (`shard_name`) can start with a dot


def is_url(model: str | os.PathLike) -> bool:
    """Whether a MODEL argument is an http(s) URL rather than a local path."""
    return isinstance(model, str) and model.lower().startswith(("http://", "https://"))


def default_cache_dir(url: str) -> Path:
    """`<reap cache (reap.cache.cache_dir)>/http/<sanitized host+path>-<8 hex of its sha256>`."""
    parts = urllib.parse.urlsplit(url)
    host = (parts.hostname or "host") + (f"_{parts.port}" if parts.port else "")
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", host + parts.path).strip("._")[:96]
    digest = hashlib.sha256(url.encode()).hexdigest()[:8]
    return cache_dir() / "http" / f"{name or 'model'}-{digest}"


def _merge(ranges: list[list[int]]) -> list[list[int]]:
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        elif b > a:
            out.append([a, b])
    return out


def _missing(have: list[list[int]], start: int, end: int) -> list[tuple[int, int]]:
    """Sub-ranges of [start, end) not covered by the merged ranges `have`."""
    out, at = [], start
    for a, b in have:
        if b <= at or a >= end:
            continue
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < end:
        out.append((at, end))
    return out


class _Transient(CheckpointError):
    """A failure worth retrying (connection dropped, short body): what arrived is kept."""


class HttpCache:
    """The disk cache of one remote checkpoint directory (see the module docstring).

    block: fetches are widened to multiples of this many bytes (fewer small requests for small
    tensors); max_request: the largest single Range request; retries: extra attempts after a
    transient failure, each resuming where the previous one stopped."""

    def __init__(self, url: str, cache_dir: str | os.PathLike | None = None,
                 client: HttpClient | None = None, block: int = 1 << 20,
                 max_request: int = 64 << 20, retries: int = 2):
        self.url = url.rstrip("/")
        self.dir = Path(cache_dir) if cache_dir else default_cache_dir(self.url)
        self.client = client or HttpClient()
        self.block, self.max_request, self.retries = max(1, block), max_request, retries
        self._states: dict[str, dict] = {}
        self._lock = threading.RLock()
        self.meta = self.dir / _BOOKKEEPING
        try:
            self.meta.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"{self.dir}: cannot create the HTTP cache ({e.strerror})"
                                  ) from None

    def _file_url(self, name: str) -> str:
        """The file's identity (named in messages and sidecars)."""
        return f"{self.url}/{urllib.parse.quote(name)}"

    def _fetch_url(self, name: str) -> str:
        """Where its bytes are fetched from (a Hub file's resolved location: `HubCache`)."""
        return self._file_url(name)

    # ---- small files and layout ------------------------------------------------------------

    def prepare(self) -> list[str]:
        """Fetch the small files and every shard's header (once); returns the shard names."""
        manifest_path = self.meta / "remote.json"
        manifest = _read_manifest(manifest_path, self.url)
        if manifest is None:
            present = {n: self._fetch_small(n, limit) for n, limit in SMALL_FILES.items()}
            shards = self._shard_names(present[INDEX_NAME])
            manifest = {"url": self.url, "files": present, "shards": shards}
        for name in manifest["shards"]:
            self.ensure_header(name)
        write_atomic(manifest_path, json.dumps(manifest, indent=1).encode())
        return manifest["shards"]

    def _fetch_small(self, name: str, limit: int) -> bool:
        """Fetch a small file whole into the cache, refused past `limit` bytes while it streams;
        False if the server has none (404)."""
        url = self._file_url(name)
        resp = self.client.get(url)
        if resp.status_code != 200:
            self.client.drop()
            if resp.status_code == 404:
                return False
            raise CheckpointError(f"{url}: HTTP {resp.status_code} {resp.reason_phrase}")
        try:
            write_atomic(self.dir / name, b"".join(self.client.body(resp, url, limit=limit)))
        except (OSError, httpx2.HTTPError) as e:
            raise CheckpointError(f"{url}: download failed ({type(e).__name__})") from None
        return True

    def _shard_names(self, has_index: bool) -> list[str]:
        if not has_index:
            return [SINGLE_NAME]
        try:
            weight_map = load_index(self.dir / INDEX_NAME)
        except CheckpointError as e:  # name the URL, not the cache file
            raise CheckpointError(str(e).replace(str(self.dir / INDEX_NAME),
                                                 f"{self.url}/{INDEX_NAME}", 1)) from None
        return sorted(set(weight_map.values()))

    def config_only(self):
        """The `ConfigOnly` view (config.json and the index fetched into the cache), or None
        when the server has weights (the index's first shard, else model.safetensors), has no
        config.json, or was opened with its weights before."""
        from dataclasses import replace

        from reap.checkpoint.config_only import open_config_only

        if _read_manifest(self.meta / "remote.json", self.url) is not None:
            return None
        if not self._fetch_small("config.json", MAX_JSON_BYTES):
            return None
        if self.has(self._shard_names(self._fetch_small(INDEX_NAME, MAX_INDEX_BYTES))[0]):
            return None
        src = open_config_only(self.dir)
        return replace(src, path=self.url) if src is not None else None

    def has(self, name: str) -> bool:
        """Whether the server has file `name` (not a 404; other answers are checked on use)."""
        resp = self.client.get(self._fetch_url(name), 0, 1)
        self.client.drop()
        return resp.status_code != 404

    # ---- shards ----------------------------------------------------------------------------

    def ensure_header(self, name: str) -> None:
        """Make the shard's header present and validate it (`check_entries`, as a local shard:
        its entries must exactly cover the size the server reports)."""
        st = self._state(name)
        url = self._file_url(name)
        self.ensure(name, 0, min(8, st["size"]))
        raw = _read_bytes(self.dir / name, 0, 8)
        n = length_prefix(raw) if len(raw) == 8 else -1
        if not 0 <= n <= min(st["size"] - 8, MAX_HEADER_BYTES):
            raise CheckpointError(f"{url}: bad safetensors header length {n} for a file of "
                                  f"{st['size']} bytes (limit {MAX_HEADER_BYTES})")
        self.ensure(name, 8, 8 + n)
        header = parse_header(url, _read_bytes(self.dir / name, 8, n))
        check_entries(url, header, 8 + n, st["size"])

    def ensure(self, name: str, start: int, end: int) -> None:
        """Make bytes [start, end) of shard `name` present in the cache file (fetching what is
        missing, widened to whole blocks); CheckpointError if the server cannot supply them."""
        if end <= start:
            return
        with self._lock:
            for attempt in range(self.retries + 1):
                try:
                    st = self._state(name)
                    if end > st["size"]:
                        raise CheckpointError(f"{self._file_url(name)}: bytes {start}-{end} "
                                              f"asked of a file of {st['size']} bytes")
                    lo = start // self.block * self.block
                    hi = min(st["size"], -(-end // self.block) * self.block)
                    for a, b in _missing(st["ranges"], lo, hi):
                        for c in range(a, b, self.max_request):
                            self._fetch_range(name, st, c, min(b, c + self.max_request))
                    return
                except _Transient:
                    if attempt == self.retries:
                        raise

    def _state(self, name: str) -> dict:
        """The shard's {size, ranges}; probes the server for its size on first use."""
        st = self._states.get(name)
        if st is None:
            st = _read_sidecar(self._sidecar(name), self._file_url(name))
            if st is None or not (self.dir / name).is_file():
                st = self._probe(name)
            self._states[name] = st
        return st

    def _probe(self, name: str) -> dict:
        """Learn a shard's size from its first block (fetched with it); create the sparse file."""
        url = self._fetch_url(name)
        resp = self._open_range(url, 0, self.block, None)
        size = content_range(resp, url, 0, self.block, None)
        try:
            (self.dir / name).unlink(missing_ok=True)  # never write through a link
            with open(self.dir / name, "wb") as f:
                f.truncate(size)  # sparse: only fetched ranges take disk space
        except OSError as e:
            self.client.drop()
            raise CheckpointError(f"{url}: cannot make a cache file of {size} bytes "
                                  f"({e.strerror})") from None
        st = {"url": self._file_url(name), "size": size, "ranges": []}
        self._save(name, st)
        self._receive(name, st, resp, 0, min(self.block, size))
        return st

    def _open_range(self, url: str, a: int, b: int, size: int | None):
        """A checked 206 response for bytes [a, b) (the connection is dropped on a bad one)."""
        resp = self.client.get(url, a, b)
        try:
            check_status(resp, url, a, b)
            content_range(resp, url, a, b, size)
        except CheckpointError:
            self.client.drop()
            raise
        return resp

    def _fetch_range(self, name: str, st: dict, a: int, b: int) -> None:
        self._receive(name, st, self._open_range(self._fetch_url(name), a, b, st["size"]), a, b)

    def _receive(self, name: str, st: dict, resp, a: int, b: int) -> None:
        """Stream a response body into the cache file at [a, b); record what arrived."""
        got = a
        fd = os.open(self.dir / name, os.O_WRONLY | os.O_NOFOLLOW)  # never into a linked file
        try:
            for piece in self.client.body(resp, st["url"], b - a):
                os.pwrite(fd, piece, got)
                got += len(piece)
        except (OSError, httpx2.HTTPError):
            pass  # keep what arrived; reported as a short read below
        finally:
            if got > a:
                os.fsync(fd)  # data reaches the disk before the sidecar claims it
                st["ranges"] = _merge(st["ranges"] + [[a, got]])
                self._save(name, st)
            os.close(fd)
        if got < b:
            self.client.drop()
            raise _Transient(f"{st['url']}: short read: got {got - a} of {b - a} bytes at "
                             f"offset {a}")

    def _sidecar(self, name: str) -> Path:
        return self.meta / f"{name}.ranges.json"

    def _save(self, name: str, st: dict) -> None:
        write_atomic(self._sidecar(name), json.dumps(st).encode())


def _read_bytes(path: Path, offset: int, n: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, n, offset)
    finally:
        os.close(fd)


def _read_json_file(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None  # missing or torn: treated as absent and rebuilt
    return data if isinstance(data, dict) else None


def _read_sidecar(path: Path, url: str) -> dict | None:
    st = _read_json_file(path)
    if st is None or st.get("url") != url or type(st.get("size")) is not int:
        return None
    try:
        st["ranges"] = _merge([[int(a), int(b)] for a, b in st.get("ranges", [])])
    except (TypeError, ValueError):
        return None  # not ours: refetched
    return st


def _read_manifest(path: Path, url: str) -> dict | None:
    m = _read_json_file(path)
    if m is None or m.get("url") != url or not isinstance(m.get("shards"), list):
        return None
    files = m.get("files")
    if not isinstance(files, dict) or set(files) != set(SMALL_FILES):
        return None
    if any(ok and not (path.parent.parent / n).is_file() for n, ok in files.items()):
        return None
    for n in m["shards"]:
        shard_name(n, str(path))
    return m


class RemoteCheckpoint(Checkpoint):
    """A `Checkpoint` whose shards live at an http(s) URL; reads fetch missing bytes first.

    Extra attributes: url, cache (the `HttpCache`; its client counts requests and bytes)."""

    cache: HttpCache
    url: str

    @classmethod
    def open(cls, url: str | HttpCache,  # type: ignore[override]
             cache_dir: str | os.PathLike | None = None, direct: bool = False,
             **cache_options) -> RemoteCheckpoint:
        """Open the checkpoint directory at `url` (or that of a cache) through its cache."""
        cache = url if isinstance(url, HttpCache) else HttpCache(url, cache_dir, **cache_options)
        cache.prepare()
        ck = super().open(cache.dir, direct=direct)
        ck.cache, ck.url = cache, cache.url
        return ck

    def ensure(self, file: str, start: int, end: int) -> None:
        """Make bytes [start, end) of shard `file` (a `TensorInfo.file` path) present locally.
        Readers that pread the shard files themselves call this first."""
        self.cache.ensure(os.path.basename(file), start, end)
