"""The shipped corpus store: file format, split rule, reading and listing.

Under the corpora root (the repository's `corpora/`, or `$REAP_CORPORA_DIR`): `<name>/recipe.json`,
`<name>/manifest.json` (what was built, with sha256) and `<name>/<split>.jsonl.xz`, one
`{"id", "text", "source"}` per line sorted by id. A *mix* corpus (e.g. `eu`) names other corpora.

Split rule: a document's key (its path with the language removed, plus `#i` for the i-th chunk
of a big file) hashes to sha256 mod 1000: < 50 eval, < 150 calibration, else train, so every
translation of a document lands in the same split.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from reap.errors import ReapError

SPLITS = ("train", "calibration", "eval")
EVAL_PER_MILLE, CALIBRATION_PER_MILLE = 50, 100


@dataclass(frozen=True)
class Document:
    """One document of a corpus: `id` is unique within the corpus, `source` names the package
    (or file) it came from, `corpus` the corpus it was loaded from."""

    id: str
    text: str
    source: str
    corpus: str = ""


@dataclass(frozen=True)
class SplitInfo:
    """Counts of one split as shipped: docs, bytes (= tokens of the byte-level tokenizer), chars,
    words (CJK characters count one each), and the sha256 of its uncompressed JSONL."""

    docs: int
    bytes: int
    chars: int
    words: int
    sha256: str


@dataclass(frozen=True)
class CorpusInfo:
    """What `list_corpora` reports about one corpus."""

    name: str
    description: str
    languages: list[str]
    licences: list[str]
    splits: dict[str, SplitInfo] = field(default_factory=dict)
    sha256: str = ""
    mix: dict[str, float] = field(default_factory=dict)
    local_only: bool = False


def split_of(key: str) -> str:
    """The split of a document key: sha256(key) mod 1000 -> eval (< 50), calibration (< 150),
    train (else)."""
    h = int(hashlib.sha256(key.encode("utf-8")).hexdigest(), 16) % 1000
    if h < EVAL_PER_MILLE:
        return "eval"
    return "calibration" if h < EVAL_PER_MILLE + CALIBRATION_PER_MILLE else "train"


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise ReapError(f"unknown split {split!r}: choose one of {', '.join(SPLITS)}")
    return split


def corpora_root() -> Path:
    """The shipped corpora: the repository's `corpora/` next to the package."""
    return Path(__file__).resolve().parents[2] / "corpora"


def local_root() -> Path:
    """Where local-only corpora are built: `$XDG_CACHE_HOME/reap/corpora-local`."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "reap" / "corpora-local"


def corpora_roots() -> list[Path]:
    """Directories searched for corpora, in order: `$REAP_CORPORA_DIR` (os.pathsep-separated)
    if set, else the shipped `corpora/` then the local-only build directory."""
    env = os.environ.get("REAP_CORPORA_DIR")
    if env:
        return [Path(p) for p in env.split(os.pathsep) if p]
    return [corpora_root(), local_root()]


def corpus_names(root: Path | None = None) -> list[str]:
    """Names of the corpora that have a recipe (under `root`, or every search directory)."""
    roots = [root] if root else corpora_roots()
    return sorted({p.parent.name for r in roots for p in r.glob("*/recipe.json")})


def read_corpus_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ReapError(f"{path}: not found") from None
    except (OSError, ValueError) as e:
        raise ReapError(f"{path}: unreadable JSON ({e})") from None


def corpus_dir(name: str, root: Path | None = None) -> Path:
    """The directory of corpus `name`: the first search directory where it was built, else the
    first that has its recipe."""
    roots = [root] if root else corpora_roots()
    for marker in ("manifest.json", "recipe.json"):
        for r in roots:
            if (r / name / marker).is_file():
                return r / name
    known = ", ".join(corpus_names(root)) or "none"
    raise ReapError(f"unknown corpus {name!r} (known: {known}; or give a .txt/.jsonl/.parquet "
                    f"path or hf:NAME)")


def doc_line(doc: Document) -> bytes:
    """The canonical JSONL line of a document (what the split sha256 is computed over)."""
    rec = {"id": doc.id, "text": doc.text, "source": doc.source}
    return (json.dumps(rec, ensure_ascii=False, sort_keys=True) + "\n").encode("utf-8")


def split_bytes(docs: list[Document]) -> bytes:
    """Canonical uncompressed content of a split: the documents' lines sorted by id."""
    return b"".join(doc_line(d) for d in sorted(docs, key=lambda d: d.id))


def read_split_file(path: Path) -> bytes:
    """Uncompressed JSONL bytes of a shipped split file."""
    try:
        return lzma.decompress(path.read_bytes())
    except FileNotFoundError:
        raise ReapError(f"{path}: split file missing (run `reap corpora build`)") from None
    except lzma.LZMAError as e:
        raise ReapError(f"{path}: corrupt xz data ({e})") from None


@lru_cache(maxsize=64)
def _load_cached(path: str, mtime: float, corpus: str) -> tuple[Document, ...]:
    raw = read_split_file(Path(path))
    docs = []
    for i, line in enumerate(raw.decode("utf-8").splitlines()):
        try:
            rec = json.loads(line)
            docs.append(Document(rec["id"], rec["text"], rec["source"], corpus))
        except (ValueError, KeyError, TypeError):
            raise ReapError(f"{path}: line {i + 1} is not a {{id, text, source}} record") from None
    return tuple(docs)


def load_shipped(name: str, split: str, root: Path | None = None) -> list[Document]:
    """Documents of one split of a shipped corpus. A mix corpus gives its parts' documents in
    recipe order, ids prefixed "part:" (translations in two parts share a key)."""
    check_split(split)
    d = corpus_dir(name, root)
    recipe = read_corpus_json(d / "recipe.json")
    if recipe.get("mix"):
        return [Document(f"{part}:{d.id}", d.text, d.source, d.corpus)
                for part in recipe["mix"] for d in load_shipped(part, split, root)]
    path = d / f"{split}.jsonl.xz"
    if not path.exists():
        raise ReapError(f"{path}: split file missing (run `reap corpora build {name}`)")
    return list(_load_cached(str(path), path.stat().st_mtime, name))


def corpus_info(name: str, root: Path | None = None) -> CorpusInfo:
    """Recipe + manifest of one corpus as a `CorpusInfo` (splits empty if not built)."""
    d = corpus_dir(name, root)
    recipe = read_corpus_json(d / "recipe.json")
    manifest = read_corpus_json(d / "manifest.json") if (d / "manifest.json").exists() else {}
    splits = {s: SplitInfo(**{k: v[k] for k in SplitInfo.__dataclass_fields__})
              for s, v in manifest.get("splits", {}).items()}
    licences = sorted({s["licence"] for s in recipe.get("sources", [])})
    if recipe.get("mix"):
        licences = sorted({lic for p in recipe["mix"] for lic in corpus_info(p, root).licences})
    return CorpusInfo(
        name=name, description=recipe.get("description", ""),
        languages=list(recipe.get("languages", [])), licences=licences, splits=splits,
        sha256=manifest.get("sha256", ""), mix=dict(recipe.get("mix", {})),
        local_only=any(s.get("local_only") for s in recipe.get("sources", [])),
    )
