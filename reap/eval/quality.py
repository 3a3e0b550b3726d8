"""Language-model quality and agreement with the reference, streamed document by document.

A build and the reference read the same held-out documents in lockstep, one prefill chunk at a
time (`Engine.step` with all positions); each chunk's next-token logits of both are reduced at
once to per-document sums and dropped, so memory holds one chunk of logits per engine and
document in flight, never a whole evaluation. Per document (T = scored positions, the last
token has no target):

    nll       = -sum_t log p_build(x[t+1] | x[:t+1])        (nats)
    ref_nll   = the same under the reference
    agree     = #{t : argmax p_ref(t) == argmax p_build(t)}   (lowest id among equal maxima)
    kl        = sum_t KL(p_ref(t) || p_build(t))              (nats)

Log-probabilities are computed in float64 over blocks of rows. Documents are encoded with the
reference's tokenizer, truncated to `max_tokens` ids, and preceded by the end-of-text id when the
tokenizer has one (so the first real token is scored, as after a document boundary).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from reap.errors import ReapError

ROW_ELEMENTS = 1 << 22  # log-softmax in float64 over at most this many logits at a time


@dataclass
class EvalDoc:
    """One held-out document to score: `ids` as the engines read them."""

    corpus: str
    doc_id: str
    ids: list[int]


@dataclass
class DocScore:
    """The per-document sums (see the module docstring); `tokens` = scored positions."""

    corpus: str
    doc_id: str
    tokens: int
    nll: float
    ref_nll: float
    agree: int
    kl: float

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def document_order(corpus: str, doc_id: str) -> bytes:
    """The fixed evaluation order of documents: sha256 of "corpus/id"."""
    return hashlib.sha256(f"{corpus}/{doc_id}".encode()).digest()


def select_documents(name: str, tokenizer, max_docs: int | None, max_tokens: int) -> list[EvalDoc]:
    """The eval split of corpus `name`, in `document_order`, the first `max_docs` (None: all)
    that give at least one scored position, each encoded and cut to `max_tokens` ids."""
    from reap.corpora import load_documents

    if max_tokens < 2:
        raise ReapError(f"--max-tokens-per-doc must be at least 2, got {max_tokens}")
    docs = sorted(load_documents(name, "eval"), key=lambda d: document_order(d.corpus, d.id))
    eos = getattr(tokenizer, "eos_id", None)
    out: list[EvalDoc] = []
    for d in docs:
        if max_docs is not None and len(out) >= max_docs:
            break
        ids = ([eos] if eos is not None else []) + tokenizer.encode(d.text)
        if len(ids) >= 2:
            out.append(EvalDoc(d.corpus or name, d.id, ids[:max_tokens]))
    if not out:
        raise ReapError(f"corpus {name!r}: no eval document with at least 2 tokens")
    return out


def chunk_sums(ref_logits: torch.Tensor, logits: torch.Tensor,
               targets: torch.Tensor) -> tuple[float, float, int, float]:
    """(nll, ref_nll, agree, kl) summed over rows: logits [N, V] of the build and the
    reference at N positions, targets [N] the next token ids."""
    n, v = logits.shape
    step = max(1, ROW_ELEMENTS // max(v, 1))
    nll = ref_nll = kl = 0.0
    agree = 0
    for a in range(0, n, step):
        lr = torch.log_softmax(ref_logits[a : a + step].double(), dim=-1)  # [n, V]
        lb = torch.log_softmax(logits[a : a + step].double(), dim=-1)  # [n, V]
        tg = targets[a : a + step, None]  # [n, 1]
        nll -= float(lb.gather(1, tg).sum())
        ref_nll -= float(lr.gather(1, tg).sum())
        agree += int((ref_logits[a : a + step].argmax(-1) == logits[a : a + step].argmax(-1)).sum())
        p = lr.exp()
        kl += float(torch.where(p > 0, p * (lr - lb), torch.zeros_like(p)).sum())
    return nll, ref_nll, agree, kl


def score_documents(ref, build, docs: list[EvalDoc], batch: int = 4,
                    on_tokens: Callable[[int], None] | None = None) -> list[DocScore]:
    """Score `docs` with engines `build` and `ref` in lockstep, `batch` documents at a time.
    `on_tokens(n)` is called after each chunk with the number of positions it scored."""
    out: list[DocScore] = []
    for i in range(0, len(docs), max(1, batch)):
        out += _score_batch(ref, build, docs[i : i + batch], on_tokens)
    return out


def lockstep_logits(engines: list, seqs: list[list[int]], on_tokens=None):
    """Feed each id list but its last id through every engine in lockstep, one prefill chunk at
    a time; yields (k, pos, one [n, V] logits per engine) where row j predicts seqs[k][pos+j+1]."""
    chunk = min(e.plan.prefill_chunk for e in engines)
    states = [[e.new_sequence() for _ in seqs] for e in engines]
    pos = [0] * len(seqs)
    while live := [k for k, s in enumerate(seqs) if pos[k] < len(s) - 1]:
        chunks = [seqs[k][pos[k] : min(pos[k] + chunk, len(seqs[k]) - 1)] for k in live]
        outs = [e.step([st[k] for k in live], chunks, all_positions=True)
                for e, st in zip(engines, states)]  # [n_j, V] per live sequence
        for j, k in enumerate(live):
            yield k, pos[k], [o[j] for o in outs]
            pos[k] += len(chunks[j])
        if on_tokens is not None:
            on_tokens(sum(map(len, chunks)))


def _score_batch(ref, build, docs: list[EvalDoc], on_tokens) -> list[DocScore]:
    sums = [[0.0, 0.0, 0, 0.0] for _ in docs]
    for k, pos, (lr, lb) in lockstep_logits([ref, build], [d.ids for d in docs], on_tokens):
        targets = torch.tensor(docs[k].ids[pos + 1 : pos + 1 + len(lr)])  # [n]
        for m, x in enumerate(chunk_sums(lr, lb, targets)):
            sums[k][m] += x
    return [DocScore(d.corpus, d.doc_id, len(d.ids) - 1, *s) for d, s in zip(docs, sums)]
