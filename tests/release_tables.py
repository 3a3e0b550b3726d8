"""Reading the release fixtures' tensor tables (`tests/fixtures/releases/*/tensors.md`): the
weight list of a `model_inspector.py` report, each row one tensor or a group whose numeric name
segments the tool merged into ranges (`layers.0-2,4-6.self_attn.A_log (×6 layers)`; a long list
may be cut with `...`, then the row's `×N` count stands for the missing ids).

    table = expand(read_rows(path), layout_names)   # name -> (shape, dtype code)
"""

from __future__ import annotations

import re
from pathlib import Path

RELEASES = Path(__file__).parent / "fixtures" / "releases"
TORCH_CODES = {
    "torch.bfloat16": "BF16",
    "torch.float32": "F32",
    "torch.float16": "F16",
    "torch.uint8": "U8",
    "torch.int32": "I32",
    "torch.float8_e4m3fn": "F8_E4M3",
}
_ROW = re.compile(r"^\| `([^`]+)`(?: \(([^)]*)\))? \| `\[([0-9, ]*)\]` \| `([a-z0-9_.]+)` \|")
PREFIX = "language_model."


def read_rows(path: Path) -> list[tuple[str, list[int], tuple[int, ...], str]]:
    """(name with ranges, `×N` counts, shape, dtype code) of each table row."""
    rows = []
    for line in path.read_text().splitlines():
        m = _ROW.match(line)
        if m:
            counts = [int(c) for c in re.findall(r"×(\d+)", m.group(2) or "")]
            shape = tuple(int(x) for x in m.group(3).split(",") if x.strip())
            rows.append((m.group(1), counts, shape, TORCH_CODES[m.group(4)]))
    return rows


def _ids(spec: str) -> tuple[list[int], bool]:
    """The ids a range segment lists ("0-2,4-6" -> [0, 1, 2, 4, 5, 6]) and whether `...` cut it."""
    out, cut = [], False
    for part in spec.split(","):
        if part == "~":
            cut = True
        elif "-" in part:
            a, b = part.split("-")
            out += range(int(a), int(b) + 1)
        else:
            out.append(int(part))
    return out, cut


def _is_range(seg: str) -> bool:
    return bool(re.fullmatch(r"[0-9,~-]+", seg)) and ("-" in seg or "," in seg)


def _tail(name: str) -> str:
    return ".".join(name.rsplit(".", 2)[-2:])


def _matches(pattern: str, key: str, by_key: dict) -> list[tuple[int, ...]]:
    hits = (re.fullmatch(pattern, n) for n in by_key.get(key, ()))
    return [tuple(int(g) for g in m.groups()) for m in hits if m]


def expand(rows, names: set[str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """name (without `language_model.`) -> (shape, dtype) for every tensor the rows list. A
    cut list (`...`) is completed from `names` (the layout's), after checking that the ids it
    lists are there and the count matches the row's `×N`: the rest of the comparison is exact."""
    out, by_key = {}, {}
    if any("..." in row[0] for row in rows):  # names by their last two segments (cut lists)
        for n in names:
            by_key.setdefault(_tail(n), []).append(n)
    for name, counts, shape, dtype in rows:
        segs = name.removeprefix(PREFIX).replace("...", "~").split(".")
        ranged = [i for i, s in enumerate(segs) if _is_range(s)]
        if not ranged:
            out[".".join(segs)] = (shape, dtype)
            continue
        pattern = ".".join(r"(\d+)" if i in ranged else re.escape(s) for i, s in enumerate(segs))
        combos = [()]
        for k, i in enumerate(ranged):
            ids, cut = _ids(segs[i])
            if cut:
                have = sorted({f[k] for f in _matches(pattern, _tail(".".join(segs)), by_key)})
                assert set(ids) <= set(have) and len(have) == counts[k], (name, have)
                ids = have
            assert len(ids) == counts[k], (name, ids, counts)
            combos = [c + (j,) for c in combos for j in ids]
        template = ".".join(
            "{}" if i in ranged else s.replace("{", "{{").replace("}", "}}")
            for i, s in enumerate(segs)
        )
        out.update((template.format(*combo), (shape, dtype)) for combo in combos)
    return out
