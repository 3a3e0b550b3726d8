"""Hub repo ids (`ORG/NAME[@REVISION]`) through huggingface_hub, against a local Hub stand-in.

`StandIn` answers the few endpoints huggingface_hub calls: model info by revision, the recursive
tree, HEAD/GET `resolve/{rev}/{file}` (X-Repo-Commit, ETag; LFS files redirect to a blob store
on another port, like the Hub's CDN, with X-Linked-Etag/X-Linked-Size), Range everywhere, a gated
repo (401 without the token), and the upload endpoints (create repo, validate-yaml, preupload,
commit) so a pushed build becomes a repo it serves. huggingface_hub reads HF_ENDPOINT, HF_HOME
and HF_HUB_OFFLINE when imported, so every command runs `reap` in a subprocess.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hf_stand_in_token"


class StandIn:
    """A Hub on 127.0.0.1: `repos[repo] = {"refs": {name: sha}, "commits": {sha: {path: bytes}},
    "gated": bool}`; `requests` logs (method, path, Range) of both ports."""

    def __init__(self):
        self.repos: dict[str, dict] = {}
        self.blobs: dict[str, bytes] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self.created: list[dict] = []
        self.hub = self._serve()
        self.cdn = self._serve()
        self.url = f"http://127.0.0.1:{self.hub.server_address[1]}"
        self.cdn_url = f"http://127.0.0.1:{self.cdn.server_address[1]}"

    def _serve(self) -> ThreadingHTTPServer:
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        httpd.daemon_threads = True
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        return httpd

    def add(self, repo: str, files: dict[str, bytes], refs=("main",), gated=False) -> str:
        r = self.repos.setdefault(repo, {"refs": {}, "commits": {}, "gated": gated})
        sha = hashlib.sha1(repr(sorted((k, hashlib.sha256(v).hexdigest()) for k, v in
                                       files.items())).encode()).hexdigest()
        r["commits"][sha] = dict(files)
        for name in refs:
            r["refs"][name] = sha
        for path, data in files.items():
            if _lfs(path):
                self.blobs[hashlib.sha256(data).hexdigest()] = data
        return sha

    def close(self):
        for httpd in (self.hub, self.cdn):
            httpd.shutdown()
            httpd.server_close()


def _lfs(path: str) -> bool:
    return path.endswith(".safetensors")


def _git_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _handler(hub: StandIn):
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_HEAD(self):
            self._route(head=True)

        def do_GET(self):
            self._route(head=False)

        def _route(self, head: bool):
            hub.requests.append((self.command, self.path, self.headers.get("Range")))
            path = self.path.partition("?")[0]
            if self.server is hub.cdn:
                data = hub.blobs.get(path.removeprefix("/blobs/"))
                return self._file(data, {}, head) if data else self._send(404)
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+))?/?", path)
            if m:
                return self._api(m[1], m[2], urllib.parse.unquote(m[3] or "main"))
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if m:
                return self._resolve(m[1], urllib.parse.unquote(m[2]),
                                     urllib.parse.unquote(m[3]), head)
            self._send(404)

        def _commit(self, repo: str, rev: str) -> tuple[str, dict] | None:
            r = hub.repos.get(repo)
            if r is None:
                self._send(401, headers={"X-Error-Code": "RepoNotFound"})
                return None
            sha = r["refs"].get(rev, rev if rev in r["commits"] else None)
            if sha is None:
                self._send(404, headers={"X-Error-Code": "RevisionNotFound"})
                return None
            return sha, r["commits"][sha]

        def _api(self, repo: str, kind: str | None, rev: str):
            found = self._commit(repo, rev)
            if found is None:
                return
            sha, files = found
            if kind == "tree":
                body = [{"type": "file", "path": p, "size": len(d), "oid": _git_sha(d),
                         **({"lfs": {"oid": hashlib.sha256(d).hexdigest(), "size": len(d),
                                     "pointerSize": 134}} if _lfs(p) else {})}
                        for p, d in sorted(files.items())]
            else:
                body = {"id": repo, "sha": sha, "private": False,
                        "gated": "manual" if hub.repos[repo]["gated"] else False,
                        "siblings": [{"rfilename": p} for p in sorted(files)]}
            self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})

        def _resolve(self, repo: str, rev: str, name: str, head: bool):
            gated = hub.repos.get(repo, {}).get("gated")
            if gated and self.headers.get("Authorization") != f"Bearer {TOKEN}":
                return self._send(401, headers={"X-Error-Code": "GatedRepo",
                                                "X-Error-Message": "Access is restricted"})
            found = self._commit(repo, rev)
            if found is None:
                return
            sha, files = found
            data = files.get(name)
            if data is None:
                return self._send(404, headers={"X-Error-Code": "EntryNotFound",
                                                "X-Repo-Commit": sha})
            if _lfs(name):
                digest = hashlib.sha256(data).hexdigest()
                return self._send(302, headers={
                    "Location": f"{hub.cdn_url}/blobs/{digest}", "X-Repo-Commit": sha,
                    "X-Linked-Etag": f'"{digest}"', "X-Linked-Size": str(len(data))})
            self._file(data, {"X-Repo-Commit": sha, "ETag": f'"{_git_sha(data)}"'}, head)

        def _file(self, data: bytes, headers: dict, head: bool):
            rng = self.headers.get("Range")
            status = 200
            if rng:
                a, _, b = rng.removeprefix("bytes=").partition("-")
                a, b = int(a), min(int(b or len(data) - 1), len(data) - 1)
                headers["Content-Range"] = f"bytes {a}-{b}/{len(data)}"
                data, status = data[a : b + 1], 206
            headers["Accept-Ranges"] = "bytes"
            self._send(status, data, headers, head)

        def _send(self, status: int, body: bytes = b"", headers=None, head=False):
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def do_POST(self):
            hub.requests.append(("POST", self.path, None))
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                return self._send(401, headers={"X-Error-Code": "RepoNotFound"})
            path = self.path.partition("?")[0]
            answer: object = {}
            if path == "/api/repos/create":
                req = json.loads(body)
                hub.created.append(req)
                repo = f"{req['organization']}/{req['name']}"
                hub.repos.setdefault(repo, {"refs": {}, "commits": {}, "gated": False})
                answer = {"url": f"{hub.url}/{repo}"}
            elif m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/preupload/[^/]+", path):
                files = json.loads(body)["files"]
                answer = {"files": [{"path": f["path"], "uploadMode": "regular",
                                     "shouldIgnore": False} for f in files]}
            elif m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/commit/([^/]+)", path):
                files = {}
                for line in body.splitlines():
                    item = json.loads(line)
                    if item["key"] == "file":
                        v = item["value"]
                        files[v["path"]] = base64.b64decode(v["content"])
                sha = hub.add(m[1], files, refs=(urllib.parse.unquote(m[2]),))
                answer = {"commitUrl": f"{hub.url}/{m[1]}/commit/{sha}", "commitOid": sha}
            self._send(200, json.dumps(answer).encode(), {"Content-Type": "application/json"})

    return H


# ---- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from reap.synth import synth

    out = tmp_path_factory.mktemp("hub") / "tiny"
    return Path(synth("k3-tiny", out, seed=5, dtype="float32", max_shard_bytes=400_000))


@pytest.fixture(scope="module")
def hub(tiny):
    files = {p.name: p.read_bytes() for p in tiny.iterdir() if p.is_file()}
    h = StandIn()
    h.tiny_main = h.add("org/tiny", files)
    h.tiny_v1 = h.add("org/tiny", {**files, "config.json": files["config.json"] + b"\n"}, ("v1",))
    h.add("org/gated", files, gated=True)
    h.add("org/bare", {n: files[n] for n in ("config.json", "model.safetensors.index.json")})
    yield h
    h.close()


@pytest.fixture
def home(tmp_path) -> Path:
    return tmp_path / "hf"


def reap(hub: StandIn, home: Path, *argv, token: str | None = None, offline: bool = False,
         cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(home), REAP_CACHE=str(home / "reap"),
               HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_DISABLE_TELEMETRY="1",
               PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if token:
        env["HF_TOKEN"] = token
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([sys.executable, "-m", "reap.cli", *map(str, argv)], check=False, env=env,
                          cwd=cwd or home.parent, capture_output=True, text=True, timeout=300)


def one_line_error(p: subprocess.CompletedProcess, code: int = 2) -> str:
    assert p.returncode == code, p.stderr
    err = p.stderr.strip()
    assert err.startswith("reap: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


# ---- tests --------------------------------------------------------------------------------


def test_info_at_a_revision_reads_headers_by_ranges(hub, tiny, home):
    """`reap info org/tiny@v1`: the small files come through huggingface_hub into the Hub
    cache; the shards, not cached, are read by ranges from the blob store: their headers only."""
    hub.requests.clear()
    p = reap(hub, home, "info", "org/tiny@v1", "--json")
    assert p.returncode == 0, p.stderr
    local = reap(hub, home, "info", tiny, "--json")
    got, want = json.loads(p.stdout), json.loads(local.stdout)
    assert got["model"].endswith(f"/org/tiny/resolve/{hub.tiny_v1}")
    for k in ("components", "total_params", "stored_tensor_bytes", "tensors_on_disk"):
        assert got[k] == want[k], k
    snap = home / "hub" / "models--org--tiny" / "snapshots" / hub.tiny_v1
    assert (snap / "config.json").read_bytes().endswith(b"\n")  # v1's, not main's
    assert not list(snap.glob("*.safetensors"))  # not downloaded
    ranges = [r for _, path, r in hub.requests if path.startswith("/blobs/")]
    assert ranges and all(r.startswith("bytes=0-") for r in ranges), ranges


def test_pipeline_on_a_hub_repo_and_push(hub, tiny, home, tmp_path):
    """calibrate -> plan -> prune (--push-to) -> verify on `org/tiny`, then `run` of the pushed
    repo: the weights are downloaded once into the Hub cache and read there in place; the push
    creates a private repo holding the build, its manifest and a model card."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "text": f"w{i} " * 30}) + "\n"
                              for i in range(20)))
    stats, plan, out = tmp_path / "stats", tmp_path / "plan.json", tmp_path / "pruned"
    steps = [("calibrate", "org/tiny", "--corpus", corpus, "--tokens", "32", "--seq-len", "16",
              "--out", stats, "--no-progress"),
             ("plan", stats, "--model", "org/tiny", "--keep", "8", "--out", plan),
             ("prune", "org/tiny", "--plan", plan, "--out", out, "--no-progress",
              "--push-to", "me/tiny-pruned"),
             ("verify", out, "--source", "org/tiny")]
    for argv in steps:
        p = reap(hub, home, *argv, token=TOKEN)
        assert p.returncode == 0, (argv[0], p.stderr)
    blobs = home / "hub" / "models--org--tiny" / "blobs"
    assert len(list(blobs.iterdir())) == len(list(tiny.iterdir()))  # each file fetched once
    manifest = json.loads((out / "reap_manifest.json").read_text())
    source = manifest["provenance"]["arguments"]["hub_sources"]["model"]
    assert source == {"model": "org/tiny", "commit": hub.tiny_main}
    assert hub.created == [{"name": "tiny-pruned", "organization": "me", "visibility": "private"}]
    pushed = hub.repos["me/tiny-pruned"]["commits"][hub.repos["me/tiny-pruned"]["refs"]["main"]]
    assert set(pushed) == {p.name for p in out.iterdir()} | {"README.md"}
    card = pushed["README.md"].decode()
    assert f"org/tiny (commit {hub.tiny_main})" in card and "criterion: reap" in card
    p = reap(hub, home, "run", "me/tiny-pruned", "--prompt-ids", "1,2,3", "--max-tokens", "2",
             "--quiet", "--budget", "2GB")
    assert p.returncode == 0, p.stderr


def test_gated_repo_needs_a_token(hub, home):
    err = one_line_error(reap(hub, home, "info", "org/gated"))
    assert "org/gated: gated repo" in err and "HF_TOKEN" in err
    p = reap(hub, home, "info", "org/gated", token=TOKEN)
    assert p.returncode == 0, p.stderr


def test_a_config_only_repo_answers_from_config_and_index(hub, home):
    p = reap(hub, home, "info", "org/bare", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["config_only"] and out["index_missing"] == 0 and out["index_tensors"] > 0


@pytest.mark.parametrize("model, message", [("org/tiny@nope", "no such revision"),
                                            ("org/absent", "no such repo")])
def test_unknown_repo_or_revision_is_one_line(hub, home, model, message):
    err = one_line_error(reap(hub, home, "info", model))
    assert f"{model}: {message}" in err


def test_offline_cache_hit_makes_no_request(hub, home):
    """With the weights in the Hub cache, HF_HUB_OFFLINE=1 runs without a single request; an
    uncached repo is a one-line error."""
    run = ("run", "org/tiny", "--prompt-ids", "1,2", "--max-tokens", "2", "--quiet", "--budget",
           "2GB")
    p = reap(hub, home, *run, "--no-download")  # streamed: shard bytes by ranges
    assert p.returncode == 0, p.stderr
    assert not list((home / "hub" / "models--org--tiny" / "blobs").glob("*"))[4:]  # small files
    assert list((home / "reap" / "http").glob("*/model-00001-of-00004.safetensors"))
    assert reap(hub, home, *run).returncode == 0  # downloads the weights into the Hub cache
    hub.requests.clear()
    for argv in (("info", "org/tiny"), run):
        p = reap(hub, home, *argv, offline=True)
        assert p.returncode == 0, p.stderr
    assert hub.requests == []
    err = one_line_error(reap(hub, home, "info", "org/gated", offline=True))
    assert "not in the Hub cache" in err and "HF_HUB_OFFLINE" in err


def test_local_path_wins_and_prune_into_the_hub_cache_is_refused(hub, tiny, home, tmp_path):
    (tmp_path / "here" / "org").mkdir(parents=True)
    os.symlink(tiny, tmp_path / "here" / "org" / "tiny")  # ./org/tiny exists: a local path
    hub.requests.clear()
    p = reap(hub, home, "info", "org/tiny", "--json", cwd=tmp_path / "here")
    assert p.returncode == 0 and json.loads(p.stdout)["model"] == "org/tiny", p.stderr
    assert hub.requests == []
    plan = tmp_path / "plan.json"
    assert reap(hub, home, "plan", "--config", tiny, "--keep", "8", "--criterion", "random",
                "--out", plan).returncode == 0
    repo = home / "hub" / "models--org--tiny"
    for out in (repo / "snapshots" / "pruned", repo / "blobs" / "x", home / "hub" / "elsewhere"):
        err = one_line_error(reap(hub, home, "prune", "org/tiny", "--plan", plan, "--out", out))
        assert "Hub cache" in err and not out.exists()


# ---- in process: argument resolution and the model card -------------------------------------


def test_eval_builds_and_serve_names_resolve(monkeypatch, tmp_path):
    from argparse import Namespace

    from reap.checkpoint import hub as hub_module

    sha = "a" * 40
    monkeypatch.setattr(hub_module, "resolve", lambda model, partial=False: f"/hf/snapshots/{sha}")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "local").mkdir(parents=True)
    args = Namespace(command="eval", builds=["org/a@v2", "mine=org/b", "org/local", "x=org/local"],
                     reference="org/ref")
    hub_module.resolve_args(args, ("builds", "reference"))
    snap = f"/hf/snapshots/{sha}"
    assert args.builds == [f"a={snap}", f"mine={snap}", "org/local", "x=org/local"]
    assert args.reference == snap
    assert args.hub_sources["build org/a@v2"] == {"model": "org/a@v2", "commit": sha}
    args = Namespace(command="serve", model="org/chat", served_name=None)
    hub_module.resolve_args(args, ("model",))
    assert args.served_name == "org/chat" and args.model == snap
    with pytest.raises(Exception, match="--push-to x: expected a Hub repo id"):
        hub_module.resolve_args(Namespace(command="prune", model="m", push_to="x"), ("model",))


def test_model_card_states_source_plan_corpora_and_eval_numbers(tmp_path):
    from reap.checkpoint.hub import model_card

    build = tmp_path / "tiny-pruned"
    (build / "eval").mkdir(parents=True)
    hub_sources = {"model": {"model": "org/tiny@v1", "commit": "c" * 40}}
    stats = [{"corpus": "zh"}, {"corpus": "code"}]
    manifest = {"plan_sha256": "ab" * 32, "n_experts": {"source": 16, "kept": [8]},
                "source": {"path": "/hf/snapshots/x"},
                "provenance": {"criterion": "reap", "budget": {"keep": 8},
                               "arguments": {"hub_sources": hub_sources},
                               "plan_provenance": {"stats": stats}}}
    (build / "reap_manifest.json").write_text(json.dumps(manifest))
    est = {k: {"value": v} for k, v in (("ppl", 12.5), ("ppl_ratio", 1.04), ("agreement", 0.91),
                                         ("kl", 0.031))}
    (build / "eval" / "results.json").write_text(json.dumps({"quality": {"zh": {"pruned": est}}}))
    card = model_card(str(build))
    assert f"org/tiny@v1 (commit {'c' * 40})" in card
    assert "criterion: reap" in card and "corpora: zh, code" in card and "[8] of 16" in card
    assert "| zh | pruned | 12.5 | 1.04 | 0.91 | 0.031 |" in card
