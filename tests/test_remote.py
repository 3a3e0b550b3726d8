"""Checkpoints over HTTP: Range fetches into a resumable sparse cache, checked answers.

A small Range-capable file server runs on 127.0.0.1 inside the test; it counts requests and
bytes and can misbehave on demand (drop the connection mid-body, lie about the file size, ignore
Range, serve an index with an unsafe shard name). Every tensor read through `RemoteCheckpoint` is
compared with the same tensor read by the local `Checkpoint`.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from reap.checkpoint import Checkpoint, CheckpointWriter, TensorSpec, open_checkpoint
from reap.checkpoint.remote import HttpCache, RemoteCheckpoint, default_cache_dir
from reap.checkpoint.spec import shard_name
from reap.errors import EXIT_USAGE, CheckpointError, ReapError


class FileServer:
    """Serves a directory with single-range GETs; knobs: drop_after, lie_size, ignore_range,
    override (path -> bytes), redirect (path -> Location), stall (seconds before answering),
    drip ((seconds per byte, "all" or "body"): each answer trickles out, for at most 10 s)."""

    def __init__(self, root: Path):
        self.root = root
        self.requests: list[tuple[str, str | None]] = []  # (path, Range header)
        self.sent = 0
        self.drop_after: int | None = None  # send this many body bytes of the next range, then cut
        self.lie_size = 0  # added to the total size stated in Content-Range
        self.ignore_range = False
        self.override: dict[str, bytes] = {}
        self.redirect: dict[str, str] = {}
        self.stall = 0.0
        self.drip: tuple[float, str] | None = None
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda request, address: None  # clients hanging up on purpose
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/models/tiny"

    def range_requests(self) -> int:
        return sum(1 for _, r in self.requests if r)

    def _handler(self):
        fs = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                rng = self.headers.get("Range")
                fs.requests.append((self.path, rng))
                name = self.path.removeprefix("/models/tiny/")
                time.sleep(fs.stall)
                if name in fs.redirect:
                    return self._send(302, b"", {"Location": fs.redirect[name]})
                data = fs.override.get(name)
                if data is None:
                    p = fs.root / name
                    if "/" in name or not p.is_file():
                        return self._send(404, b"not found")
                    data = p.read_bytes()
                if not rng or fs.ignore_range:
                    return self._send(200, data)
                a, b = (int(x) for x in rng.removeprefix("bytes=").split("-"))
                if a >= len(data):
                    return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
                body = data[a : min(b, len(data) - 1) + 1]
                total = len(data) + fs.lie_size
                cr = f"bytes {a}-{a + len(body) - 1}/{total}"
                cut = fs.drop_after
                if cut is not None:
                    fs.drop_after = None
                    self._send(206, body[:cut], {"Content-Range": cr}, length=len(body))
                    self.close_connection = True
                    return
                self._send(206, body, {"Content-Range": cr})

            def _send(self, status, body, headers=None, length=None):
                if fs.drip is not None:
                    return self._drip(status, body, headers or {})
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body) if length is None else length))
                self.end_headers()
                self.wfile.write(body)
                fs.sent += len(body)

            def _drip(self, status, body, headers):
                seconds, what = fs.drip
                head = f"HTTP/1.1 {status} OK\r\nContent-Length: {len(body)}\r\n"
                head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
                if what == "body":
                    self.wfile.write(head.encode())
                    head = ""
                raw = head.encode() + body
                end = time.monotonic() + 10  # bounded: the test never waits on it for long
                for i in range(len(raw)):
                    if time.monotonic() > end:
                        break
                    self.wfile.write(raw[i : i + 1])
                    self.wfile.flush()
                    time.sleep(seconds)
                self.close_connection = True

        return H

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def write_checkpoint(out: Path) -> Path:
    """Three shards, prefixed names, assorted dtypes; one 'expert' of six contiguous tensors."""
    g = torch.Generator().manual_seed(0)
    specs, data = [], {}
    shapes = [("model.embed_tokens.weight", "BF16", (64, 32))]
    shapes += [(f"model.layers.0.experts.{e}.w{i}.weight_packed", "U8", (32, 16))
               for e in range(3) for i in (1, 2, 3)]
    shapes += [(f"model.layers.{i}.norm.weight", "F32", (32,)) for i in range(4)]
    shapes += [("lm_head.weight", "F32", (64, 32))]
    for name, dtype, shape in shapes:
        specs.append(TensorSpec(name, dtype, shape))
        if dtype == "U8":
            data[name] = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
        else:
            t = torch.randn(shape, generator=g)
            data[name] = t.to(torch.bfloat16) if dtype == "BF16" else t
    w = CheckpointWriter(out, specs, max_shard_bytes=6000, prefix="language_model.")
    for s in specs:
        w.write(s.name, data[s.name])
    w.close({"model_type": "test", "hidden_size": 32},
            {"tokenizer.json": "{}", "chat_template.jinja": "{{ messages }}"})
    return out


@pytest.fixture
def remote(tmp_path):
    src = write_checkpoint(tmp_path / "src")
    fs = FileServer(src)
    yield src, fs, tmp_path / "cache"
    fs.close()


def same_tensors(ck: Checkpoint, local: Checkpoint, names) -> None:
    for n in names:
        assert torch.equal(ck.read(n), local.read(n)), n


def test_open_reads_headers_only_then_tensors_on_demand(remote):
    src, fs, cache = remote
    local = Checkpoint.open(src)
    assert len({t.file for t in local.tensors.values()}) >= 3
    ck = RemoteCheckpoint.open(fs.url, cache, block=64)
    assert set(ck.tensors) == set(local.tensors) and ck.config == local.config
    assert ck.prefix == "language_model." and ck.fingerprint() == local.fingerprint()
    assert (cache / "chat_template.jinja").read_text() == "{{ messages }}"
    shard_bytes = sum(os.path.getsize(f) for f in {t.file for t in local.tensors.values()})
    cached = sum(b - a for st in ck.cache._states.values() for a, b in st["ranges"])
    assert cached < shard_bytes // 2  # only the headers (+ one block each)
    names = [f"model.layers.0.experts.1.w{i}.weight_packed" for i in (1, 2, 3)]
    before = fs.range_requests()
    got = ck.read_many(names)  # one contiguous span: one Range request
    assert fs.range_requests() == before + 1
    assert all(torch.equal(got[n], local.read(n)) for n in names)
    info = ck.tensors["model.layers.3.norm.weight"]  # a reader doing its own pread (the engine)
    ck.ensure(info.file, info.start, info.end)
    fd = os.open(info.file, os.O_RDONLY)
    assert os.pread(fd, info.nbytes, info.start) == local.read_raw(info.name)
    os.close(fd)
    same_tensors(ck, local, local.tensors)
    info = ck.tensors["lm_head.weight"]
    n = len(fs.requests)
    ck.ensure(info.file, info.start, info.end)  # the hook for readers doing their own preads
    assert len(fs.requests) == n  # already present
    for f in {t.file for t in local.tensors.values()}:  # cache files are byte-identical now
        assert (cache / Path(f).name).read_bytes() == Path(f).read_bytes()


def test_second_open_reuses_cache_without_requests(remote):
    _src, fs, cache = remote
    ck = RemoteCheckpoint.open(fs.url, cache, block=1)
    ck.read("lm_head.weight")
    n_first = len(fs.requests)
    ck2 = RemoteCheckpoint.open(fs.url, cache, block=1)
    assert ck2.read("lm_head.weight").shape == (64, 32)
    assert len(fs.requests) == n_first  # nothing at all: small files, headers and tensor cached
    ck2.read("model.embed_tokens.weight")  # not yet fetched: exactly its bytes
    info = ck2.tensors["model.embed_tokens.weight"]
    assert len(fs.requests) == n_first + 1
    assert fs.requests[-1][1] == f"bytes={info.start}-{info.end - 1}"


def test_interrupted_download_resumes(remote):
    src, fs, cache = remote
    local = Checkpoint.open(src)
    ck = RemoteCheckpoint.open(fs.url, cache, block=1, retries=0)
    info = ck.tensors["lm_head.weight"]  # 8 KiB
    sent_before = fs.sent
    fs.drop_after = 3000
    with pytest.raises(CheckpointError, match="short read: got 3000 of 8192"):
        ck.read("lm_head.weight")
    # A fresh process (new open) fetches only the 5192 missing bytes.
    ck2 = RemoteCheckpoint.open(fs.url, cache, block=1, retries=0)
    assert torch.equal(ck2.read("lm_head.weight"), local.read("lm_head.weight"))
    assert fs.requests[-1][1] == f"bytes={info.start + 3000}-{info.end - 1}"
    assert fs.sent - sent_before == info.nbytes
    # With retries the same interruption is invisible to the reader.
    ck3 = RemoteCheckpoint.open(fs.url, cache, block=1, retries=1)
    fs.drop_after = 100
    assert torch.equal(ck3.read("model.embed_tokens.weight"),
                       local.read("model.embed_tokens.weight"))


def test_server_lying_about_size_is_caught(remote):
    _src, fs, cache = remote
    fs.lie_size = 16  # claims 16 more bytes than the header describes
    with pytest.raises(CheckpointError, match="header describes"):
        RemoteCheckpoint.open(fs.url, cache.with_name("c1"), block=1)
    with pytest.raises(CheckpointError, match="asked bytes 0-1048575, server sent 0-"):
        RemoteCheckpoint.open(fs.url, cache.with_name("c2"))  # a short answer for that size
    fs.lie_size = 0
    ck = RemoteCheckpoint.open(fs.url, cache, block=1)
    fs.lie_size = -8  # the file "changed" under the cache
    with pytest.raises(CheckpointError, match="earlier"):
        ck.read("lm_head.weight")


def test_truncated_shard_gives_416(remote):
    src, fs, cache = remote
    ck = RemoteCheckpoint.open(fs.url, cache, block=1)
    info = ck.tensors["lm_head.weight"]
    name = Path(info.file).name
    data = (src / name).read_bytes()
    fs.override[name] = data[: info.start]  # the server's copy lost its tail
    with pytest.raises(CheckpointError, match="416"):
        ck.read("lm_head.weight")


def test_http_errors_are_one_line_checkpoint_errors(remote, tmp_path):
    src, fs, _cache = remote
    with pytest.raises(CheckpointError, match="404"):
        RemoteCheckpoint.open(fs.url + "-missing", tmp_path / "c1")
    fs.ignore_range = True
    with pytest.raises(CheckpointError, match="ignored the Range request"):
        RemoteCheckpoint.open(fs.url, tmp_path / "c2")
    fs.ignore_range = False
    index = json.loads((src / "model.safetensors.index.json").read_text())
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = "../../etc/passwd"
    fs.override["model.safetensors.index.json"] = json.dumps(index).encode()
    with pytest.raises(CheckpointError, match="unsafe file name"):
        RemoteCheckpoint.open(fs.url, tmp_path / "c3")
    assert not (tmp_path / "etc").exists()


def test_names_and_dispatch(tmp_path, remote):
    src, fs, cache = remote
    for bad in ("..", "../x", "/etc/passwd", "a/b", ".hidden", ""):
        with pytest.raises(CheckpointError):
            shard_name(bad, "index")
    d = default_cache_dir("https://example.com:8443/org/../model?x=1")
    assert ".." not in d.parts and d.parent.name == "http" and "example.com_8443" in d.name
    assert d != default_cache_dir("https://example.com:8443/org/model2")
    assert isinstance(open_checkpoint(fs.url, cache), RemoteCheckpoint)
    assert type(open_checkpoint(src)) is Checkpoint


def test_concurrent_reads_are_consistent(remote):
    src, fs, cache = remote
    local = Checkpoint.open(src)
    ck = RemoteCheckpoint.open(fs.url, cache, block=1)
    names = sorted(local.tensors)
    errors = []

    def worker(part):
        try:
            for n in part:
                assert torch.equal(ck.read(n), local.read(n))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(names[i::3],)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert isinstance(ck.cache, HttpCache)


def test_engine_generates_from_a_url(tmp_path, monkeypatch):
    """`reap serve URL`'s path: the engine on a remote k3-tiny gives the local tokens; a second
    open of the same URL fetches nothing."""
    from reap.serve.backend import open_backend
    from reap.synth import synth

    src = Path(synth("k3-tiny", tmp_path / "k3-tiny", seed=0, dtype="float32"))
    monkeypatch.setenv("REAP_CACHE", str(tmp_path / "reap-cache"))
    local = open_backend(str(src), "m", context=32)
    want = local.engine.generate([list(b"hi")], max_tokens=3, temperature=0)[0].ids
    local.close()
    fs = FileServer(src)
    try:
        remote = open_backend(fs.url, "m", context=32)
        assert remote.engine.generate([list(b"hi")], max_tokens=3, temperature=0)[0].ids == want
        remote.close()
        shards = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        assert 0 < fs.sent <= shards + 200_000  # shards at most once (+ small files)
        n = len(fs.requests)
        again = open_backend(fs.url, "m", context=32)
        assert again.engine.generate([list(b"hi")], max_tokens=3, temperature=0)[0].ids == want
        again.close()
        assert len(fs.requests) == n
        assert (tmp_path / "reap-cache" / "http").is_dir()
    finally:
        fs.close()


# ---- a hostile server (issue 18): redirects elsewhere, slow answers, huge files, odd names ----


def test_redirects_are_followed_only_within_the_origin(remote, tmp_path):
    src, fs, _cache = remote
    other = FileServer(src)  # the same files on another port: another origin
    try:
        for target in (other.url + "/config.json", "file:///etc/passwd",
                       "https://127.0.0.1/models/tiny/config.json"):
            fs.redirect["config.json"] = target
            with pytest.raises(CheckpointError, match="redirect to .* refused") as e:
                RemoteCheckpoint.open(fs.url, tmp_path / "c1")
            assert e.value.exit_code == EXIT_USAGE and "\n" not in str(e.value)
        assert other.requests == []
    finally:
        other.close()
    fs.override["moved-config.json"] = (src / "config.json").read_bytes()
    fs.redirect["config.json"] = "/models/tiny/moved-config.json"  # same origin: followed
    ck = RemoteCheckpoint.open(fs.url, tmp_path / "c2")
    assert ck.config == json.loads((src / "config.json").read_text())


@pytest.mark.parametrize("drip", ["all", "body"])
def test_a_dripping_server_meets_the_deadline(remote, tmp_path, monkeypatch, drip):
    _src, fs, _cache = remote
    monkeypatch.setenv("REAP_HTTP_DEADLINE", "1.5")
    fs.drip = (0.05, drip)  # 20 bytes/s: each read returns well within the read timeout
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match=r"within the 1.5 s deadline \(REAP_HTTP_DEADLINE"):
        RemoteCheckpoint.open(fs.url, tmp_path / "c")
    assert time.monotonic() - t0 < 6


def test_a_silent_server_meets_the_read_timeout(remote, tmp_path, monkeypatch):
    _src, fs, _cache = remote
    monkeypatch.setenv("REAP_HTTP_TIMEOUT", "0.5")
    fs.stall = 4.0
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match="timed out"):
        RemoteCheckpoint.open(fs.url, tmp_path / "c")
    assert time.monotonic() - t0 < 3.5  # not waiting for the answer
    monkeypatch.setenv("REAP_HTTP_TIMEOUT", "soon")
    with pytest.raises(ReapError, match="REAP_HTTP_TIMEOUT: expected a number of seconds"):
        RemoteCheckpoint.open(fs.url, tmp_path / "c")


def test_oversized_files_are_refused_while_they_stream(remote, tmp_path):
    src, fs, _cache = remote
    fs.override["config.json"] = b'{"pad": "' + b"x" * (17 << 20) + b'"}'
    cache = HttpCache(fs.url, tmp_path / "c1")
    with pytest.raises(CheckpointError, match="config.json: larger than the limit of 16777216"):
        cache.prepare()
    assert cache.client.bytes <= (17 << 20)  # stopped at the cap, not after the whole body
    assert not (tmp_path / "c1" / "config.json").exists()
    del fs.override["config.json"]
    name = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    first = min(name.values())
    fs.override[first] = struct.pack("<Q", 150_000_000) + b"{}" + b" " * 64
    fs.lie_size = 200_000_000  # the server claims room for a 150 MB header
    with pytest.raises(CheckpointError, match="header length 150000000 .*limit 100000000"):
        RemoteCheckpoint.open(fs.url, tmp_path / "c2", block=1)
    asked = [r for p, r in fs.requests if r and p.endswith(first)]
    assert asked and all(int(r.split("-")[1]) < 8 for r in asked)  # never the header itself


def test_cache_bookkeeping_cannot_collide_with_shard_names(remote, tmp_path):
    src, fs, cache = remote
    for bad in ("config.json", "remote.json", "tokenizer.json", "x.safetensors.ranges.json",
                ".reap", "model.safetensors.index.json"):
        with pytest.raises(CheckpointError, match="unsafe file name"):
            shard_name(bad, "index")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = "config.json"
    fs.override["model.safetensors.index.json"] = json.dumps(index).encode()
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: weight_map: unsafe"):
        RemoteCheckpoint.open(fs.url, tmp_path / "c1")
    del fs.override["model.safetensors.index.json"]
    RemoteCheckpoint.open(fs.url, cache)
    top = sorted(p.name for p in cache.iterdir())
    assert ".reap" in top and not [n for n in top if n.endswith(".ranges.json")]
    assert "remote.json" not in top and (cache / ".reap" / "remote.json").is_file()
