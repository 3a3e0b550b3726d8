"""What an evaluation reads (`Workload`): its columns, the reference tokenizer, the held-out
documents of each corpus (with the corpus sha256), the prompts and the lm-eval tasks;
`prepare_workload` checks the inputs and loads them, with one-line errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from reap.errors import ReapError
from reap.eval.builds import Build, make_builds
from reap.eval.cache import key_of
from reap.eval.generations import load_prompts
from reap.eval.quality import select_documents
from reap.provenance import sha256_file

BENCH_CONTEXT = 2048  # positions an engine holds for lm-eval tasks (their max_length)


@dataclass
class Workload:
    """What an evaluation reads: the columns, the reference tokenizer, documents per corpus
    (with the corpus sha256), the prompts and the lm-eval tasks (`benchmarks`: tasks, the
    digest of the files under --task-path and lm-eval's version; None without --tasks)."""

    ref: Build
    others: list[Build]
    tokenizer: object
    docs: dict[str, list]
    corpus_sha: dict[str, str]
    prompts: list
    benchmarks: dict | None = None

    def context(self, gen_tokens: int) -> int:
        """The longest sequence an engine must hold: a document, a prompt + generation, or an
        lm-eval request."""
        return max([len(d.ids) for ds in self.docs.values() for d in ds]
                   + [len(self.tokenizer.encode(p.prompt)) + gen_tokens for p in self.prompts]
                   + [BENCH_CONTEXT] * bool(self.benchmarks))


def prepare_workload(builds, reference, corpora, max_docs, max_tokens_per_doc, prompts,
                     gen_domains, gen_tokens, tasks=(), task_path=None) -> Workload:
    """Check the inputs and load everything the evaluation reads (one-line errors)."""
    from reap.corpora import corpus_fingerprint

    if not builds:
        raise ReapError("give at least one build to compare with the reference")
    cols = make_builds([reference, *builds])
    tokenizer = _tokenizer(cols[0].path)
    for b in cols[1:]:
        tok = b.identity.get("tokenizer")
        if tok is not None and tok != cols[0].identity.get("tokenizer"):
            raise ReapError(f"{b.path}: its tokenizer.json differs from the reference's; builds "
                            f"are compared on the reference's token ids")
    docs = {c: select_documents(c, tokenizer, max_docs, max_tokens_per_doc) for c in corpora}
    corpus_sha = {c: corpus_fingerprint(c, "eval") for c in corpora}
    plist = load_prompts(prompts, gen_domains) if gen_tokens > 0 else []
    if not docs and not plist and not tasks:
        raise ReapError("nothing to evaluate: give --corpus, --tasks, or prompts with "
                        "--gen-tokens > 0")
    bench = benchmark_spec(list(tasks), task_path) if tasks else None
    return Workload(cols[0], cols[1:], tokenizer, docs, corpus_sha, plist, bench)


def benchmark_spec(tasks: list[str], task_path: str | None) -> dict:
    """The lm-eval tasks as their results' cache key sees them (a one-line error without
    lm-eval, for an unknown task or a --task-path that is not a directory)."""
    from reap.eval.harness import task_manager  # ReapError without lm-eval

    root = None if task_path is None else Path(task_path)
    if root is not None and not root.is_dir():
        raise ReapError(f"--task-path {task_path}: not a directory")
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root else []
    digest = key_of({str(p.relative_to(root)): sha256_file(p) for p in files})
    task_manager(task_path, tuple(tasks))  # unknown tasks: an error before any engine opens
    return {"tasks": tasks, "task_files": digest, "lm_eval": version("lm_eval")}


def _tokenizer(path: str):
    from reap.tokenizer import load_tokenizer

    if str(path).lower().startswith(("http://", "https://")):
        raise ReapError("the reference must be a local checkpoint directory (its tokenizer "
                        "encodes the documents and prompts)")
    return load_tokenizer(path)
