"""User-named text sources: local `.txt` / `.jsonl` / `.parquet` files and `hf:` hub datasets.

They split like shipped corpora (`store.split_of` of each document's key: file name plus block
index, or the record's `id`), so held-out text stays held out whatever the source. A `.txt` file
holds one document per blank-line-separated block (a directory: one per file); `.jsonl` and
`.parquet` a `text` field (and `id`); `hf:NAME[:CONFIG][:SPLIT][:FIELD]` needs `datasets`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from reap.corpora.store import Document, check_split, split_of
from reap.errors import ReapError

LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")
HF_MAX_DOCS = 200_000  # a hub dataset is read up to this many documents


def is_local(name: str) -> bool:
    """True if a spec term names a file, a directory or a hub dataset rather than a corpus."""
    return name.startswith("hf:") or name.endswith(LOCAL_SUFFIXES) or "/" in name


def local_documents(name: str, split: str) -> list[Document]:
    """Documents of `split` from a local path or `hf:` dataset (see the module docstring)."""
    check_split(split)
    docs = _hf(name) if name.startswith("hf:") else _path_docs(Path(name))
    ids = [d.id for d in docs]
    if len(set(ids)) != len(ids):
        raise ReapError(f"{name}: document ids are not unique")
    return [d for d in docs if split_of(d.id) == split]


def _path_docs(path: Path) -> list[Document]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise ReapError(f"{path}: directory holds no .txt file")
        return [Document(str(f.relative_to(path)), _read(f).strip(), str(path), str(path))
                for f in files if _read(f).strip()]
    if not path.is_file():
        raise ReapError(f"{path}: no such file or directory")
    if path.suffix == ".txt":
        blocks = re.split(r"\n\s*\n", _read(path).replace("\r\n", "\n"))
        return [Document(f"{path.name}#{i}", b.strip(), str(path), str(path))
                for i, b in enumerate(blocks) if b.strip()]
    if path.suffix == ".jsonl":
        return _records(path, _jsonl(path))
    if path.suffix == ".parquet":
        return _records(path, _parquet(path))
    raise ReapError(f"{path}: unsupported file type (use .txt, .jsonl or .parquet)")


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ReapError(f"{path}: cannot read as UTF-8 text ({e})") from None


def _jsonl(path: Path) -> list[dict]:
    out = []
    for i, line in enumerate(_read(path).splitlines()):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            raise ReapError(f"{path}: line {i + 1} is not JSON") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
            raise ReapError(f"{path}: line {i + 1} has no string field 'text'")
        out.append(rec)
    return out


def _parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ReapError(f"{path}: reading .parquet needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several unrelated types for a bad file
        raise ReapError(f"{path}: unreadable parquet ({e})") from None
    if "text" not in table.column_names:
        raise ReapError(f"{path}: no column 'text' (columns: {', '.join(table.column_names)})")
    cols = ["text"] + (["id"] if "id" in table.column_names else [])
    return table.select(cols).to_pylist()


def _records(path: Path, recs: list[dict]) -> list[Document]:
    return [Document(str(r["id"]) if r.get("id") is not None else f"{path.name}#{i}",
                     r["text"], str(path), str(path))
            for i, r in enumerate(recs) if isinstance(r.get("text"), str) and r["text"].strip()]


def parse_hf(name: str) -> tuple[str, str | None, str, str]:
    """`hf:NAME[:CONFIG][:SPLIT][:FIELD]` -> (name, config or None, split, field)."""
    parts = name[3:].split(":")
    if not parts[0] or len(parts) > 4:
        raise ReapError(f"bad hub dataset {name!r}: use hf:NAME[:CONFIG][:SPLIT][:FIELD]")
    parts += [""] * (4 - len(parts))
    return parts[0], parts[1] or None, parts[2] or "train", parts[3] or "text"


def _hf(name: str) -> list[Document]:
    dataset, config, hf_split, field = parse_hf(name)
    try:
        import datasets
    except ImportError:
        raise ReapError(f"{name}: hub datasets need the `datasets` package "
                        f"(pip install datasets)") from None
    try:
        data = datasets.load_dataset(dataset, config, split=hf_split)
    except Exception as e:  # offline, unknown name, bad config: one line, not a traceback
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ReapError(f"{name}: cannot load hub dataset ({msg})") from None
    docs = []
    for i, rec in enumerate(data):
        if i >= HF_MAX_DOCS:
            break
        if field not in rec:
            raise ReapError(f"{name}: records have no field {field!r} (fields: {', '.join(rec)})")
        if isinstance(rec[field], str) and rec[field].strip():
            docs.append(Document(f"{dataset}/{config or ''}/{hf_split}#{i}", rec[field], name, name))
    return docs
