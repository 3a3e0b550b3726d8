"""Hugging Face Hub models, `ORG/NAME[@REVISION]` (a branch, tag or commit), through
huggingface_hub: its token, `HF_ENDPOINT`, `HF_HUB_OFFLINE` and shared cache under `HF_HOME`.

`reap.cli` calls `resolve_args` once per command line: a local path or http(s) URL is kept; a Hub
id becomes its cache snapshot directory (`snapshot_download`: missing files fetched into the same
cache) or, for commands that read only parts of shards (`info`, `plan`, `run --plan-only`,
`--no-download`), the URL `<endpoint>/<repo>/resolve/<commit>`, opened as a `HubCache` (cached
files in place, the rest of a shard by Range requests, the token sent only to the Hub's origin).
Hub failures are one-line `ReapError`s (exit 2). `push` uploads a pruned build.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

from reap.checkpoint.http_range import origin
from reap.checkpoint.reader import Checkpoint
from reap.checkpoint.remote import SMALL_FILES, HttpCache, RemoteCheckpoint, is_url
from reap.errors import ReapError

_REPO = r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*"
_ID = re.compile(rf"({_REPO})(?:@([^\s@]+))?")  # ORG/NAME[@REVISION]
_HEX40 = r"[0-9a-f]{40}"
WEIGHTS = ["*.json", "*.safetensors", "*.jinja", "*.model"]  # what reap reads of a repo


def parse(model) -> tuple[str, str | None] | None:
    """(repo id, revision or None) of a model argument in the Hub form; None for anything else,
    an existing local path of the same name included (local paths win)."""
    if not isinstance(model, str) or os.path.lexists(model) or is_url(model):
        return None
    m = _ID.fullmatch(model)
    return (m[1], m[2]) if m else None


_WHY = {  # huggingface_hub's error -> what to say (a subclass before its base)
    "GatedRepoError": "gated repo: accept its terms on the Hub, give a token (HF_TOKEN)",
    "RevisionNotFoundError": "no such revision on the Hub",
    "RepositoryNotFoundError": "no such repo on the Hub (a private one needs HF_TOKEN), nor path",
    "RemoteEntryNotFoundError": "no such file in the repo",
    "OfflineModeIsEnabled": "not in the Hub cache (HF_HUB_OFFLINE=1)",
    "LocalEntryNotFoundError": "not in the Hub cache (nor a local path), and the Hub is "
                               "unreachable or HF_HUB_OFFLINE=1",
}


@contextlib.contextmanager
def hub_errors(what: str):
    """huggingface_hub's failures as one-line ReapErrors naming `what`."""
    import httpx2
    from huggingface_hub import errors

    try:
        yield
    except (OSError, errors.HFValidationError, httpx2.HTTPError) as x:
        why = next((m for n, m in _WHY.items() if isinstance(x, getattr(errors, n))), None)
        raise ReapError(f"{what}: {why or str(x).splitlines()[0][:200]}") from None


def resolve(model: str, partial: bool = False) -> str:
    """Where a Hub-form model is read from (see the module docstring); other strings as given."""
    ref = parse(model)
    if ref is None:
        return model
    from huggingface_hub import constants

    snap = _snapshot(model, *ref, list(SMALL_FILES) if partial else WEIGHTS)
    return f"{constants.ENDPOINT}/{ref[0]}/resolve/{snap.name}" if partial else str(snap)


def _snapshot(what: str, repo: str, rev: str | None, patterns: list[str]) -> Path:
    from huggingface_hub import snapshot_download

    with hub_errors(what):
        return Path(snapshot_download(repo, revision=rev, allow_patterns=patterns))


def resolve_args(args, names: tuple[str, ...]) -> None:
    """Resolve the model arguments `names` of a parsed command line in place; records
    `args.hub_sources` {argument: {"model", "commit"}} (provenance) when any was in Hub form."""
    cmd = args.command
    partial = (cmd == "info" or (cmd == "plan" and args.criterion != "recon")
               or getattr(args, "plan_only", False) or getattr(args, "no_download", False))
    if getattr(args, "push_to", None) and not re.fullmatch(_REPO, args.push_to):
        raise ReapError(f"--push-to {args.push_to}: expected a Hub repo id ORG/NAME")
    if cmd == "prune" and parse(args.model):  # the cache's blobs, links and refs: the source
        _refuse_cache_out(args.out)
    found: dict = {}
    for name in names:
        value = getattr(args, name, None)
        if isinstance(value, list):  # eval's builds: LABEL=MODEL or MODEL
            value = [_build(v, found) for v in value]
        elif parse(value):
            value = _record(found, name, value, resolve(value, partial))
        setattr(args, name, value)
    if found:
        args.hub_sources = found
    if cmd == "serve" and found and args.served_name is None:
        args.served_name = parse(found["model"]["model"])[0]


def _build(arg: str, found: dict) -> str:
    label, sep, model = arg.partition("=")
    if not sep or os.path.lexists(arg):
        label, model = "", arg
    if not parse(model):
        return arg
    where = _record(found, f"build {label or model}", model, resolve(model))
    return f"{label or parse(model)[0].split('/')[1]}={where}"


def _record(found: dict, name: str, model: str, where: str) -> str:
    found[name] = {"model": model, "commit": Path(where).name}  # a snapshot or resolve URL
    return where


def _refuse_cache_out(out: str) -> None:
    from huggingface_hub import constants

    from reap.fileio import overlap

    if overlap(out, [constants.HF_HUB_CACHE]):
        raise ReapError(f"{out}: the output lies in the Hub cache ({constants.HF_HUB_CACHE}), "
                        "which holds the source; choose an output directory outside it")


class HubCache(HttpCache):
    """The `HttpCache` of a Hub repo at one commit (`url` = `<endpoint>/<repo>/resolve/<commit>`):
    files in the Hub cache's `snapshot` are linked, never copied nor written; shard bytes missing
    are fetched by ranges from where huggingface_hub locates the file (the Hub's CDN)."""

    def __init__(self, url: str, repo: str, commit: str, snapshot: Path, **options):
        from huggingface_hub.utils import build_hf_headers

        super().__init__(url, **options)
        self.repo, self.commit, self.snapshot = repo, commit, snapshot
        self.client.headers[origin(url)] = build_hf_headers()  # the token stays on the Hub
        self._located: dict[str, str] = {}

    def _fetch_small(self, name: str, limit: int = 0) -> bool:
        src = self.snapshot / name  # `open_cache` fetched every small file the repo has
        if src.is_file():
            (self.dir / name).unlink(missing_ok=True)
            os.symlink(os.path.realpath(src), self.dir / name)
        return src.is_file()

    def _probe(self, name: str) -> dict:
        src = self.snapshot / name
        if not src.is_file():
            return super()._probe(name)
        (self.dir / name).unlink(missing_ok=True)  # a stale partial copy: gone before the sidecar
        size = src.stat().st_size
        self._save(name, st := {"url": self._file_url(name), "size": size, "ranges": [[0, size]]})
        self._fetch_small(name)  # the whole shard, linked
        return st

    def _fetch_url(self, name: str) -> str:
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        if name not in self._located:
            with hub_errors(self._file_url(name)):
                url = hf_hub_url(self.repo, name, revision=self.commit)
                self._located[name] = get_hf_file_metadata(url).location
        return self._located[name]

    def has(self, name: str) -> bool:
        from huggingface_hub import file_exists

        with hub_errors(self._file_url(name)):
            return (self.snapshot / name).is_file() or file_exists(self.repo, name,
                                                                   revision=self.commit)


def open_cache(url: str, cache_dir: str | os.PathLike | None = None, **options) -> HttpCache:
    """The cache of `url`: a `HubCache` for a Hub URL `<endpoint>/<repo>/resolve/<commit>`, else
    an `HttpCache`."""
    from huggingface_hub import constants

    m = re.fullmatch(re.escape(constants.ENDPOINT) + rf"/(.+)/resolve/({_HEX40})/?", url)
    if m is None:
        return HttpCache(url, cache_dir, **options)
    snap = _snapshot(url, m[1], m[2], list(SMALL_FILES))  # no request once cached
    return HubCache(url, m[1], m[2], snap, cache_dir=cache_dir, **options)


def open_checkpoint(model: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                    direct: bool = False) -> Checkpoint:
    """A local checkpoint path or an http(s) URL (a Hub one included) -> an open `Checkpoint`."""
    if is_url(str(model)):
        return RemoteCheckpoint.open(open_cache(str(model), cache_dir), direct=direct)
    return Checkpoint.open(model, direct=direct)


def push(build: str, repo: str) -> str:
    """Upload a pruned build (every file, the manifest included) with a model card (README.md,
    `model_card`) to Hub repo `repo`, created private when new; returns the commit URL."""
    from huggingface_hub import CommitOperationAdd, HfApi

    ops = [CommitOperationAdd(p.name, str(p)) for p in sorted(Path(build).iterdir())
           if p.is_file() and p.name != "README.md"]
    ops.append(CommitOperationAdd("README.md", model_card(build).encode()))
    api = HfApi()
    with hub_errors(f"--push-to {repo}"):
        api.create_repo(repo, private=True, exist_ok=True)
        return api.create_commit(repo, ops, commit_message="reap prune").commit_url


def model_card(build: str) -> str:
    """A pruned build's model card: source repo and revision, plan, criterion, corpora, and the
    per-corpus numbers of an evaluation found in the build (`results.json`, `reap eval`)."""
    from reap.checkpoint.header import load_json

    m = load_json(Path(build) / "reap_manifest.json", "prune manifest")
    prov = m["provenance"]
    hub = ((prov.get("arguments") or {}).get("hub_sources") or {}).get("model")
    source = f"{hub['model']} (commit {hub['commit']})" if hub else m["source"]["path"]
    corpora = [s.get("corpus") for s in (prov.get("plan_provenance") or {}).get("stats", [])]
    merge = (m.get("merge") or {}).get("method")  # a merged build's experts are averages
    lines = ["---", f"tags: [reap, moe, {'merged' if merge else 'pruned'}]", "---",
             f"# {Path(build).name}", "",
             (f"Experts merged ({merge}) with reap from {source}; those not merged bit-identical."
              if merge else f"Pruned with reap from {source}, kept experts bit-identical."), "",
             (f"- plan: `reap_plan.json` (sha256 {m['plan_sha256']}), experts per MoE layer: "
              f"{m['n_experts']['kept']} of {m['n_experts']['source']}"),
             f"- criterion: {prov.get('criterion')}; budget: {json.dumps(prov.get('budget'))}",
             f"- calibration corpora: {', '.join(map(str, corpora)) or 'none'}",
             "- manifest: `reap_manifest.json` (a sha256 per kept expert; `reap verify`)"]
    for path in sorted(Path(build).glob("**/results.json")):
        quality = json.loads(path.read_text()).get("quality") or {}
        lines += ["", f"## Evaluation (`{path.relative_to(build)}`)", "",
                  "| corpus | build | ppl | ppl ratio | top-1 agreement | KL |", "|---" * 6 + "|"]
        for corpus, builds in quality.items():
            for label, q in builds.items():
                cells = [f"{q[k]['value']:.4g}" if q.get(k) else "" for k in
                         ("ppl", "ppl_ratio", "agreement", "kl")]
                lines.append(f"| {corpus} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
