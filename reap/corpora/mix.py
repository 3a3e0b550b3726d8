"""Corpus specs and token sampling: what calibration and evaluation read.

A spec names one or more corpora joined by `+`, each with an optional weight `:W` (default 1):
`zh`, `zh+code`, `zh:3+code:1`, `notes.txt:2+hf:wikitext:wikitext-2-raw-v1`. A mix corpus
(e.g. `eu`) spreads its weight over its parts by the recipe's weights. `sample_sequences`
packs documents, in a seeded order, into sequences of exactly `seq_len` tokens, giving each
component a number of sequences proportional to its weight (largest remainders, exact
fractions). Sequences remember their split; `calibration_sequences` cannot read eval.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import deque
from dataclasses import dataclass, replace
from fractions import Fraction

from reap.corpora.local import is_local, local_documents
from reap.corpora.store import (
    Document,
    check_split,
    corpus_dir,
    load_shipped,
    read_corpus_json,
    split_bytes,
)
from reap.errors import ReapError

_WEIGHT_RE = re.compile(r"^(?P<name>.+):(?P<w>[0-9]*\.?[0-9]+)$")


@dataclass(frozen=True)
class SampledSequence:
    """`seq_len` token ids from corpus term `corpus` (as named in the spec), starting inside
    document `doc_id` ("part:id" for a part of a mix corpus), drawn from `split`."""

    corpus: str
    doc_id: str
    ids: list[int]
    split: str = "calibration"


class ByteTokenizer:
    """The byte-level tokenizer: ids are the UTF-8 bytes (0..255); `eos_id` optional (e.g. 256)."""

    def __init__(self, eos_id: int | None = None):
        self.eos_id = eos_id

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def parse_spec(spec: str) -> list[tuple[str, float]]:
    """`zh:3+code:1` -> [("zh", 3.0), ("code", 1.0)]; names are checked (corpus with a recipe,
    existing path, or hf:), weights must be positive and finite, a name at most once."""
    if not spec or not spec.strip():
        raise ReapError("empty corpus spec")
    out: list[tuple[str, float]] = []
    for term in spec.split("+"):
        term = term.strip()
        m = _WEIGHT_RE.match(term)
        name, weight = (m.group("name"), float(m.group("w"))) if m else (term, 1.0)
        if not name or (":" in name and not is_local(name)):
            raise ReapError(f"bad corpus term {term!r} in {spec!r}: use NAME or NAME:WEIGHT "
                            f"with a positive number")
        if not (weight > 0 and math.isfinite(weight)):
            raise ReapError(f"bad weight in {term!r}: must be a positive number")
        if any(n == name for n, _ in out):
            raise ReapError(f"corpus {name!r} named twice in {spec!r}")
        if not is_local(name):
            corpus_dir(name)  # unknown corpus -> ReapError naming the known ones
        out.append((name, weight))
    return out


def _leaves(name: str, weight: Fraction) -> list[tuple[str, Fraction]]:
    """A spec term -> [(leaf corpus or path, weight)]; a mix corpus spreads its weight."""
    if is_local(name):
        return [(name, weight)]
    mix = read_corpus_json(corpus_dir(name) / "recipe.json").get("mix") or {}
    if not mix:
        return [(name, weight)]
    total = sum(Fraction(str(w)) for w in mix.values())
    return [leaf for part, w in mix.items() for leaf in _leaves(part, weight * Fraction(str(w)) / total)]


def allocate(total: int, weights: list[Fraction]) -> list[int]:
    """Split `total` items in proportion to `weights` exactly: floors of the exact shares, then
    one more to the largest remainders (ties to the earlier component)."""
    wsum = sum(weights)
    shares = [Fraction(total) * w / wsum for w in weights]
    counts = [math.floor(s) for s in shares]
    order = sorted(range(len(weights)), key=lambda i: (-(shares[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def load_documents(name: str, split: str) -> list[Document]:
    """Documents of one split of a corpus (shipped, local-only build, mix), a local file or
    directory, or an `hf:` dataset."""
    check_split(split)
    return local_documents(name, split) if is_local(name) else load_shipped(name, split)


def seeded_order(docs: list[Document], seed: int) -> list[Document]:
    """Documents in the deterministic order of sha256(f"{seed}:{id}")."""
    return sorted(docs, key=lambda d: hashlib.sha256(f"{seed}:{d.id}".encode()).digest())


def pack(docs: list[Document], tokenizer, count: int, seq_len: int, label: str,
         split: str) -> list[SampledSequence]:
    """The first `count` sequences of `seq_len` tokens from `docs` concatenated in the given
    order (eos between documents if the tokenizer has `eos_id`)."""
    eos = getattr(tokenizer, "eos_id", None)
    buf: list[int] = []
    owners: deque[list] = deque()  # [doc_id, tokens of it still in buf], in buffer order
    out: list[SampledSequence] = []
    for doc in docs:
        if len(out) == count:
            break
        ids = list(tokenizer.encode(doc.text)) + ([eos] if eos is not None else [])
        buf += ids
        owners.append([doc.id, len(ids)])
        while len(buf) >= seq_len and len(out) < count:
            out.append(SampledSequence(label, owners[0][0], buf[:seq_len], split))
            buf = buf[seq_len:]
            used = seq_len
            while used:
                take = min(used, owners[0][1])
                owners[0][1] -= take
                used -= take
                if owners[0][1] == 0:
                    owners.popleft()
    if len(out) < count:
        have = sum(len(tokenizer.encode(d.text)) for d in docs)
        raise ReapError(f"{label}: the {split} split has about {have} tokens, "
                        f"{count * seq_len} needed ({count} x {seq_len})")
    return out


def sample_sequences(spec: str, split: str, tokenizer, n_tokens: int, seq_len: int,
                     seed: int = 0) -> list[SampledSequence]:
    """n_tokens // seq_len sequences of exactly `seq_len` token ids from `split` of the spec's
    corpora, allocated by weight (exact largest remainders), each component's documents packed
    in sha256(seed:id) order. split: "calibration", "train" or "eval"."""
    check_split(split)
    if seq_len < 1 or n_tokens < seq_len:
        raise ReapError(f"need seq_len >= 1 and n_tokens >= seq_len (got {n_tokens}, {seq_len})")
    terms = parse_spec(spec)
    leaves = [(term, leaf, w) for term, tw in terms
              for leaf, w in _leaves(term, Fraction(str(tw)))]
    counts = allocate(n_tokens // seq_len, [w for _, _, w in leaves])
    out: list[SampledSequence] = []
    for (term, leaf, _), count in zip(leaves, counts):
        if count:
            docs = seeded_order(load_documents(leaf, split), seed)
            seqs = pack(docs, tokenizer, count, seq_len, term, split)
            if leaf != term:  # a part of a mix: say which part the document came from
                seqs = [replace(s, doc_id=f"{leaf}:{s.doc_id}") for s in seqs]
            out += seqs
    return out


def calibration_sequences(spec: str, tokenizer, n_tokens: int, seq_len: int,
                          seed: int = 0) -> list[SampledSequence]:
    """`sample_sequences` on the calibration split: the entry point for calibration, which has
    no way to reach held-out eval text."""
    return sample_sequences(spec, "calibration", tokenizer, n_tokens, seq_len, seed)


def corpus_fingerprint(spec: str, split: str) -> str:
    """sha256 identifying exactly which text a spec reads from `split`: over one line per leaf
    corpus "name weight sha256(canonical split content)"."""
    check_split(split)
    lines = []
    for term, tw in parse_spec(spec):
        for leaf, w in _leaves(term, Fraction(str(tw))):
            content = hashlib.sha256(split_bytes(load_documents(leaf, split))).hexdigest()
            lines.append(f"{leaf} {w} {content}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest()
