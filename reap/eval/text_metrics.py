"""Per-generation text metrics: repetition, script fidelity, Python validity and length.

Text is measured in *units*, so one definition works for every script: each CJK ideograph, kana
or hangul syllable is one unit, a run of other word characters (a word, a number, an
identifier) is one unit, and a run of one repeated punctuation character (`,`, `===`) is one
unit; whitespace separates units and is not one.

    m = generation_metrics(text, domain="zh", prompt=prompt)
    m["distinct_2"], m["longest_repeat"], m["looping"], m["script"], m["python_valid"]

- `distinct_n`: unique n-grams of units / all n-grams (0.0 when the text has fewer than n units).
- `longest_repeated_ngram`: the largest n such that some n-gram of units occurs twice or more
  (occurrences may overlap).
- `find_loop`: the text *ends* in at least `min_repeats` consecutive copies of one block of
  p <= `max_period` units (the last copy may be cut short), spanning >= `min_span` units: how
  greedy decoding degenerates. "ha ha ha" or a list is not a loop; "的的的..." or a sentence
  repeated to the end of the budget is.
- `script_share`: the share of letters (Unicode category L*) in the domain's script: CJK
  ideographs for zh, kana or kanji for ja (kana alone reported as `kana`), ASCII letters for en,
  Latin letters for eu; for code the ASCII share of all non-space characters. 0.0 without letters.
- `python_valid`: the first fenced block (```...```) if the text has one, else prompt + text,
  parses with `ast` (also tried without the generation's last, possibly cut, line).
"""

from __future__ import annotations

import ast
import re
import unicodedata
import warnings
from dataclasses import dataclass

_CJK = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002ebef\U0002f800-\U0002fa1f"
_KANA = "\u3040-\u309f\u30a0-\u30ff\u31f0-\u31ff\uff66-\uff9f"
_HANGUL = "\uac00-\ud7af"
_SINGLE = _CJK + _KANA + _HANGUL
_UNIT_RE = re.compile(rf"[{_SINGLE}]|[^\W{_SINGLE}]+|([^\w\s])\1*")
_CJK_RE = re.compile(f"[{_CJK}]")
_KANA_RE = re.compile(f"[{_KANA}]")
_LATIN_RE = re.compile("[A-Za-z\u00c0-\u00ff\u0100-\u024f\u1e00-\u1eff]")
_FENCE_RE = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.DOTALL)

# domains whose prompts expect Python code (validity is checked for these)
CODE_DOMAINS = ("code", "code-py", "py", "python")


def units(text: str) -> list[str]:
    """The text split into units (see the module docstring)."""
    return [m.group(0) for m in _UNIT_RE.finditer(text)]


def distinct_n(u: list[str], n: int) -> float:
    """Unique n-grams / all n-grams of the unit list `u`; 0.0 if it has fewer than n units."""
    grams = [tuple(u[i : i + n]) for i in range(len(u) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def _has_repeat(u: list[str], n: int) -> bool:
    grams = [tuple(u[i : i + n]) for i in range(len(u) - n + 1)]
    return len(set(grams)) < len(grams)


def longest_repeated_ngram(u: list[str]) -> int:
    """Largest n such that an n-gram of units occurs at least twice (0 if none repeats).
    Repetition is monotone in n (a repeated n-gram's prefix repeats too): binary search."""
    lo, hi = 0, max(len(u) - 1, 0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _has_repeat(u, mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class Loop:
    """A loop at the end of a text: `period` units repeated `repeats` times over `span` units."""

    period: int
    span: int
    repeats: float


def find_loop(u: list[str], min_repeats: int = 3, min_span: int = 12,
              max_period: int = 64) -> Loop | None:
    """The shortest-period loop the unit list ends in, or None (see the module docstring)."""
    n = len(u)
    for p in range(1, min(max_period, n // min_repeats) + 1):
        run = 0  # trailing positions i with u[i] == u[i - p]
        while run < n - p and u[n - 1 - run] == u[n - 1 - run - p]:
            run += 1
        span = run + p
        if span >= min_repeats * p and span >= min_span:
            return Loop(p, span, span / p)
    return None


def _letters(text: str) -> list[str]:
    return [c for c in text if unicodedata.category(c).startswith("L")]


def script_share(text: str, domain: str) -> float | None:
    """Share of the text in the script the domain expects (see the module docstring); None for a
    domain without an expected script."""
    if domain in CODE_DOMAINS:
        chars = [c for c in text if not c.isspace()]
        return sum(c.isascii() for c in chars) / len(chars) if chars else 0.0
    test = {
        "zh": lambda c: bool(_CJK_RE.match(c)),
        "ja": lambda c: bool(_CJK_RE.match(c) or _KANA_RE.match(c)),
        "en": lambda c: c.isascii(),
        "eu": lambda c: bool(_LATIN_RE.match(c)),
    }.get(domain)
    if test is None:
        return None
    letters = _letters(text)
    return sum(map(test, letters)) / len(letters) if letters else 0.0


def kana_share(text: str) -> float:
    """Share of letters that are kana (tells Japanese from Chinese, which both use kanji)."""
    letters = _letters(text)
    return sum(bool(_KANA_RE.match(c)) for c in letters) / len(letters) if letters else 0.0


def fenced_block(text: str) -> str | None:
    """The content of the first ``` fenced block (to the end if it is never closed), or None."""
    m = _FENCE_RE.search(text)
    return m.group(1) if m else None


def parses(source: str) -> bool:
    """Non-blank Python source that `ast.parse` accepts."""
    if not source.strip():
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences and the like
            ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


def python_valid(text: str, prompt: str = "") -> bool:
    """Does the generation make valid Python (see the module docstring)?"""
    block = fenced_block(text)
    if block is not None:
        return parses(block)
    cut = text[: text.rfind("\n") + 1]
    return any(g.strip() and parses(prompt + g) for g in (text, cut))


def generation_metrics(text: str, domain: str, prompt: str = "", tokens: int | None = None) -> dict:
    """All metrics of one generation (a flat JSON-ready dict); `tokens` = generated token count."""
    u = units(text)
    loop = find_loop(u)
    out = {
        "chars": len(text),
        "units": len(u),
        "tokens": tokens,
        "distinct_1": distinct_n(u, 1),
        "distinct_2": distinct_n(u, 2),
        "distinct_3": distinct_n(u, 3),
        "longest_repeat": longest_repeated_ngram(u),
        "looping": loop is not None,
        "loop_period": loop.period if loop else None,
        "script": script_share(text, domain),
        "python_valid": python_valid(text, prompt) if domain in CODE_DOMAINS else None,
    }
    if domain == "ja":
        out["kana"] = kana_share(text)
    return out
