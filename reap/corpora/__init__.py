"""Calibration and evaluation corpora: recipes, shipped data, specs and token sampling.

Library API (later stages build on these names):
- `list_corpora() -> list[CorpusInfo]`: every corpus with a recipe, with per-split counts.
- `load_documents(name, split) -> list[Document]`: a shipped corpus, a local file, or `hf:`.
- `parse_spec(spec) -> list[(name, weight)]`: `zh+code`, `zh:3+code:1`, paths, `hf:` names.
- `sample_sequences(spec, split, tokenizer, n_tokens, seq_len, seed=0)
  -> list[SampledSequence]` and `calibration_sequences(...)` (calibration split only).
- `corpus_fingerprint(spec, split) -> str`: sha256 of exactly the text a spec reads.
Splits are "train", "calibration" and "eval" (held out: never used to calibrate).
The builder that writes shipped corpora is `reap.corpora.builder` (never imported at run time).
"""

from reap.corpora.mix import (
    ByteTokenizer,
    SampledSequence,
    allocate,
    calibration_sequences,
    corpus_fingerprint,
    load_documents,
    parse_spec,
    sample_sequences,
)
from reap.corpora.store import (
    SPLITS,
    CorpusInfo,
    Document,
    SplitInfo,
    corpus_info,
    corpus_names,
    split_of,
)


def list_corpora() -> list[CorpusInfo]:
    """Every corpus with a recipe (shipped, local-only, mixes), sorted by name."""
    return [corpus_info(n) for n in corpus_names()]


__all__ = [
    "SPLITS", "ByteTokenizer", "CorpusInfo", "Document", "SampledSequence", "SplitInfo",
    "allocate", "calibration_sequences", "corpus_fingerprint", "corpus_info", "list_corpora",
    "load_documents", "parse_spec", "sample_sequences", "split_of",
]
