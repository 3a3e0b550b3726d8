"""Prompt sets and greedy generations for the side-by-side comparison.

A prompt set is JSONL, one `{"id", "domain", "prompt"}` object per line; ids are unique within a
set. The shipped sets live in `corpora/prompts/<domain>.jsonl` (zh, en, eu, ja, code), written
as openings a base model continues (completion style, no chat template), so the same prompt
works on any build.

    prompts = load_prompts(domains=["zh", "code"])          # or load_prompts("mine.jsonl")
    rows = generate_all(engine, tokenizer, prompts, gen_tokens=64, batch=16)

Every build decodes greedily (temperature 0: deterministic) in lockstep batches of prompts of
one domain. Prompts are encoded and outputs decoded with the reference's tokenizer, so builds
are compared on the same ids; decoding stops at the end-of-text id.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from reap.errors import ReapError
from reap.eval.text_metrics import generation_metrics

DOMAINS = ("zh", "en", "eu", "ja", "code")


@dataclass(frozen=True)
class Prompt:
    """One prompt of a set: `domain` selects the script and code checks of its outputs."""

    id: str
    domain: str
    prompt: str


def prompts_dir() -> Path:
    """Where the shipped prompt sets are: `corpora/prompts/` of the repository."""
    from reap.corpora.store import corpora_root

    return corpora_root() / "prompts"


def read_prompt_file(path: str | Path) -> list[Prompt]:
    """The prompts of one JSONL file (a one-line ReapError naming file:line on bad input)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ReapError(f"{path}: cannot read prompts ({e})") from None
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except ValueError as e:
            raise ReapError(f"{path}:{i}: invalid JSON ({e})") from None
        ok = isinstance(d, dict) and all(isinstance(d.get(k), str) for k in ("id", "domain"))
        if not ok or not isinstance(d.get("prompt"), str) or not d["prompt"]:
            raise ReapError(f"{path}:{i}: need an object with string 'id', 'domain' and a "
                            "non-empty 'prompt'")
        out.append(Prompt(d["id"], d["domain"], d["prompt"]))
    if not out:
        raise ReapError(f"{path}: no prompts")
    return out


def load_prompts(path: str | Path | None = None, domains: list[str] | None = None) -> list[Prompt]:
    """A user's prompt file, or the shipped sets; only `domains` if given (in that order)."""
    if path is not None:
        prompts = read_prompt_file(path)
    else:
        names = domains or list(DOMAINS)
        missing = [d for d in names if not (prompts_dir() / f"{d}.jsonl").is_file()]
        if missing:
            raise ReapError(f"no shipped prompt set for domain {missing[0]!r} "
                            f"(shipped: {', '.join(DOMAINS)}; or give --prompts FILE.jsonl)")
        prompts = [p for d in names for p in read_prompt_file(prompts_dir() / f"{d}.jsonl")]
    if domains is not None:
        prompts = [p for d in domains for p in prompts if p.domain == d]
        if not prompts:
            raise ReapError(f"no prompts for domains {', '.join(domains)}")
    seen: set[str] = set()
    for p in prompts:
        if p.id in seen:
            raise ReapError(f"prompt id {p.id!r} appears twice")
        seen.add(p.id)
    return prompts


def prompts_digest(prompts: list[Prompt]) -> str:
    """sha256 of the prompts as evaluated (ids, domains and text, in order)."""
    rows = [[p.id, p.domain, p.prompt] for p in prompts]
    return hashlib.sha256(json.dumps(rows, ensure_ascii=False).encode()).hexdigest()


def _batches(prompts: list[Prompt], batch: int) -> list[list[int]]:
    """Indices of prompts grouped by domain (first-seen order), at most `batch` per group."""
    by_domain: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        by_domain.setdefault(p.domain, []).append(i)
    return [idx[j : j + batch] for idx in by_domain.values() for j in range(0, len(idx), batch)]


def generate_all(engine, tokenizer, prompts: list[Prompt], gen_tokens: int, batch: int = 16,
                 on_tokens: Callable[[int], None] | None = None) -> list[dict]:
    """Greedy generations of every prompt, in prompt order: dicts with id, domain, ids (generated
    token ids, end-of-text excluded), text and finish_reason (metrics: `with_metrics`)."""
    rows: list[dict | None] = [None] * len(prompts)
    for group in _batches(prompts, max(1, batch)):
        ids = [tokenizer.encode(prompts[i].prompt) for i in group]
        gens = engine.generate(ids, max_tokens=gen_tokens, temperature=0.0)
        for i, g in zip(group, gens):
            out = list(g.ids[:-1]) if g.finish_reason == "eos" else list(g.ids)
            rows[i] = {"id": prompts[i].id, "domain": prompts[i].domain, "ids": out,
                       "text": tokenizer.decode(out), "finish_reason": g.finish_reason}
        if on_tokens is not None:
            on_tokens(len(group) * gen_tokens)  # the budget each sequence could use
    return rows  # type: ignore[return-value]


def with_metrics(rows: list[dict], prompts: list[Prompt]) -> list[dict]:
    """Copies of generation rows (same order as `prompts`) with their `metrics` added."""
    return [{**r, "metrics": generation_metrics(r["text"], p.domain, p.prompt, len(r["ids"]))}
            for r, p in zip(rows, prompts)]
