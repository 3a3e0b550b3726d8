"""Corpus recipes: which files of which packages become which documents.

A recipe is `corpora/<name>/recipe.json`: a description, languages, a byte cap for the shipped
train split, and a list of sources. A source names a Debian package (or, for local-only text, a
PyPI sdist), glob patterns of files inside it, an extractor `format`, a `tag` and a `lang`
pattern that build the document key (tag + path with the language removed, so translations
share keys), an optional per-line language `filter`, `dedupe` for boilerplate, and `max_mb`, a
cap on its cleaned text (documents kept in a fixed hash order).
"""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import lzma
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from reap.corpora.builder import extract, roff
from reap.corpora.builder.text import chunk_text, dedupe_lines, filter_lines, line_filter
from reap.corpora.store import Document, read_corpus_json
from reap.errors import ReapError

CHUNK_BYTES = 16384  # documents above this are cut at line boundaries into chunks
MIN_DOC_BYTES = 120  # shorter documents (stubs, `.so` redirects, empty translations) dropped
FORMATS = ("man", "html", "rst", "fortune", "sword", "code", "text", "tagged")


@dataclass(frozen=True)
class Source:
    """One source of a recipe (see the module docstring for the fields)."""

    package: str
    licence: str
    format: str
    include: list[str]
    tag: str
    exclude: list[str] = field(default_factory=list)
    lang: str = ""
    filter: str | None = None
    dedupe: bool = False
    max_mb: float | None = None
    archive: str | None = None
    pypi: str | None = None
    local_only: bool = False


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    languages: list[str]
    sources: list[Source] = field(default_factory=list)
    mix: dict[str, float] = field(default_factory=dict)
    train_cap_mb: float = 2.5

    @property
    def local_only(self) -> bool:
        return any(s.local_only for s in self.sources)


def load_recipe(path: Path) -> Recipe:
    """Parse and check a recipe.json."""
    raw = read_corpus_json(path)
    try:
        sources = [Source(**s) for s in raw.pop("sources", [])]
        recipe = Recipe(sources=sources, **raw)
    except TypeError as e:
        raise ReapError(f"{path}: bad recipe ({e})") from None
    for s in recipe.sources:
        if s.format not in FORMATS:
            raise ReapError(f"{path}: source {s.package}: unknown format {s.format!r}")
        line_filter(s.filter)
    return recipe


def _matches(rel: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(rel, p) for p in patterns)


def _files(root: Path, src: Source) -> list[tuple[str, bytes]]:
    """(relative path, raw bytes) of the source's files, sorted by path; members of `archive`
    (a tarball inside the package) when the source names one."""
    if src.archive:
        tars = sorted(root.glob(src.archive))
        if not tars:
            raise ReapError(f"{src.package}: no archive matching {src.archive}")
        out = []
        with tarfile.open(tars[-1]) as tar:
            for m in tar:
                rel = m.name.split("/", 1)[-1]
                if m.isfile() and _matches(rel, src.include) and not _matches(rel, src.exclude):
                    out.append((rel, tar.extractfile(m).read()))
        return sorted(out)
    rels = sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_symlink())
    rels = [r for r in rels if _matches(r, src.include) and not _matches(r, src.exclude)]
    return [(r, b"" if (root / r).is_dir() else (root / r).read_bytes()) for r in rels]


def _decode(rel: str, data: bytes) -> str:
    if rel.endswith(".gz"):
        data = gzip.decompress(data)
    elif rel.endswith(".xz"):
        data = lzma.decompress(data)
    return data.decode("utf-8", errors="replace")


# extractor `format` -> file text -> document text ("text" keeps it verbatim, as code does)
_TEXT_OF = {"man": roff.man_to_text, "html": extract.html_to_text, "rst": extract.rst_to_text,
            "code": extract.code_text, "fortune": lambda t: "\n\n".join(extract.fortunes(t)),
            "tagged": extract.tagged_text, "text": extract.code_text}


def _extract(root: Path, rel: str, data: bytes, fmt: str) -> list[tuple[str, str]]:
    """One file -> [(key suffix, text)]; the suffix is "" for a single-document file."""
    if fmt == "sword":
        return [(f"#{cid}", text) for book in extract.sword_books(root / rel)
                for cid, text in extract.osis_chapters(book)]
    return [("", _TEXT_OF.get(fmt, extract.code_text)(_decode(rel, data)))]


def source_key(src: Source, rel: str) -> str:
    """Document key of a file: tag + path with the language pattern and .gz removed."""
    path = re.sub(src.lang, "", rel) if src.lang else rel
    return src.tag + "/" + re.sub(r"\.(gz|xz)$", "", path)


def source_documents(src: Source, root: Path, log=print) -> list[Document]:
    """All documents of one source, cleaned, deduped, chunked and capped."""
    files = _files(root, src)
    if not files:
        raise ReapError(f"{src.package}: no file matches {src.include}")
    keep = line_filter(src.filter)
    keys, texts = [], []
    for rel, data in files:
        for suffix, text in _extract(root, rel, data, src.format):
            keys.append(source_key(src, rel) + suffix)
            texts.append(filter_lines(text, keep) if keep else text)
    if src.dedupe:
        texts = dedupe_lines(texts)
    docs = []
    for key, text in zip(keys, texts):
        if len(text.encode()) < MIN_DOC_BYTES:
            continue
        sep = "\n\n" if src.format == "fortune" else "\n"  # never cut inside a fortune
        chunks = chunk_text(text, CHUNK_BYTES, sep)
        for i, chunk in enumerate(chunks):
            docs.append(Document(key if len(chunks) == 1 else f"{key}#{i}", chunk, src.package))
    return docs if src.max_mb is None else capped(docs, src.max_mb, "cap:")


def capped(docs: list[Document], max_mb: float, salt: str) -> list[Document]:
    """The documents, taken in sha256(salt + id) order, that fit in `max_mb` MB of text (a
    document that does not fit is skipped, later smaller ones may still fit), sorted by id."""
    order = sorted(docs, key=lambda d: hashlib.sha256(f"{salt}{d.id}".encode()).digest())
    kept, total, limit = [], 0, int(max_mb * 1_000_000)
    for d in order:
        n = len(d.text.encode())
        if total + n > limit:
            continue
        kept.append(d)
        total += n
    return sorted(kept, key=lambda d: d.id)
