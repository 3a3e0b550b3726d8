"""Text cleaning shared by every corpus recipe: line joining, language filters, dedupe, chunking.

All functions are pure (str in, str out) so the build is deterministic and testable on
hand-made strings. Vocabulary: a *document* is one unit of the split (a man page, an HTML page,
a Bible chapter, a chunk of a big file); a *line* is one paragraph or heading after joining.
"""

from __future__ import annotations

import re
import unicodedata

# Han ideographs (BMP blocks, compatibility block, supplementary planes).
_HAN = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003134f"
_KANA = "\u3040-\u30ff\u31f0-\u31ff\uff66-\uff9f"
# Characters written without spaces between them: Han, kana, CJK punctuation, fullwidth forms.
_CJK = _HAN + _KANA + "\u3000-\u303f\uff00-\uffef\uac00-\ud7af"
_CJK_RE = re.compile(f"[{_CJK}]")
_HAN_RE = re.compile(f"[{_HAN}]")
_HAN_OR_KANA_RE = re.compile(f"[{_HAN}{_KANA}]")
_WORD_RE = re.compile(f"[{_CJK}]|[^\\s{_CJK}]+")
_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][0-9A-Za-z]|\x1b[=>78]")
_SPACES_RE = re.compile(r"[ \t\u00a0\u2000-\u200b\u202f\u205f]+")


def is_cjk(ch: str) -> bool:
    """True for a character written without spaces around it (Han, kana, CJK punctuation)."""
    return bool(_CJK_RE.match(ch))


def join_lines(lines: list[str]) -> str:
    """Join hard-wrapped lines of one paragraph: one space between pieces, none between two CJK
    characters (a break inside a Chinese or Japanese sentence is not a word boundary), nor
    between a CJK character and a quote or dash next to it."""
    out = ""
    for raw in lines:
        piece = collapse_spaces(raw)
        if not piece:
            continue
        if out and not _tight(out[-1], piece[0]):
            out += " "
        out += piece
    return out


# Punctuation shared by CJK and Western text: no space next to a CJK character, a space otherwise.
_NEUTRAL = set("\u201c\u201d\u2018\u2019\u2014\u2026\u00b7")


def _tight(a: str, b: str) -> bool:
    """True if no space goes between characters `a` and `b` when joining two pieces."""
    ca, cb = is_cjk(a), is_cjk(b)
    return (ca and cb) or (ca and b in _NEUTRAL) or (a in _NEUTRAL and cb)


def collapse_spaces(text: str) -> str:
    """Runs of horizontal whitespace -> one space, trimmed; control characters removed."""
    text = "".join(c for c in text if c in "\t\n" or unicodedata.category(c)[0] != "C")
    return _SPACES_RE.sub(" ", text).strip()


def strip_ansi(text: str) -> str:
    """Remove terminal colour and cursor escape sequences (some fortune files carry them)."""
    return _ANSI_RE.sub("", text).replace("\x1b", "")


def count_words(text: str) -> int:
    """Words: each CJK character counts as one, other runs of non-space characters as one."""
    return sum(1 for _ in _WORD_RE.finditer(text))


def has_han(line: str) -> bool:
    """True if the line holds at least one Han ideograph (the `zh` line filter)."""
    return bool(_HAN_RE.search(line))


def has_han_or_kana(line: str) -> bool:
    """True if the line holds a Han ideograph or kana (the `ja` line filter)."""
    return bool(_HAN_OR_KANA_RE.search(line))


# Short function words that are frequent in one language and rare in the others listed here.
_STOPWORDS = {
    "en": frozenset("the and of to is are this that with for you be by not from which can will has "
                    "have when were should must these there their into only your been would does"
                    .split()),
    "de": frozenset("der die das und ist nicht mit von den zu ein eine für auf im des sich dem "
                    "werden wird oder auch sie es als bei aus sind kann wenn nur".split()),
    "fr": frozenset("le la les des et est une un pour dans du que qui sur pas par au avec ce sont "
                    "ou être cette il vous peut aux ne".split()),
    "es": frozenset("el la los las de que y en un una es por para con no se del al como lo su más "
                    "este esta puede son".split()),
    "it": frozenset("il lo la gli le di che e un una è per non con del della dei si sono da in "
                    "come al nel questo può alla".split()),
}
_LETTERS_RE = re.compile(r"[^\W\d_]+")


def looks_english(line: str, lang: str) -> bool:
    """True if a line of a `lang` (de/fr/es/it) document is really untranslated English.

    English function words must outnumber the target language's: at least two of them, or one
    in a short line with none of the target's."""
    words = _LETTERS_RE.findall(line.lower())
    en = sum(w in _STOPWORDS["en"] for w in words)
    tgt = sum(w in _STOPWORDS[lang] for w in words)
    if en >= 2:
        return en > tgt
    return en == 1 and tgt == 0 and len(words) <= 6


def line_filter(name: str | None):
    """The per-line language filter of a recipe: None, "zh", "ja" or "not-en:<lang>"."""
    if not name:
        return None
    if name == "zh":
        return has_han
    if name == "ja":
        return has_han_or_kana
    if name.startswith("not-en:") and name[7:] in _STOPWORDS:
        lang = name[7:]
        return lambda line: not looks_english(line, lang)
    raise ValueError(f"unknown line filter {name!r}")


def filter_lines(text: str, keep) -> str:
    """Keep the lines of `text` for which `keep(line)` is true; blank lines (entry separators)
    stay, runs of them collapse to one."""
    return _tidy(ln for ln in text.split("\n") if not ln.strip() or keep(ln))


def _tidy(lines) -> str:
    """Join lines, collapsing runs of blank lines into one and trimming blank ends."""
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")


def dedupe_lines(texts: list[str]) -> list[str]:
    """Drop every line already seen earlier in this or an earlier text of the list
    (boilerplate: page footers, repeated headings, "This page is part of ..."); the first
    occurrence is kept, blank lines stay. Order matters: callers pass texts in sorted order."""
    seen: set[str] = set()
    out = []
    for text in texts:
        kept = []
        for line in text.split("\n"):
            norm = collapse_spaces(line)
            if norm in seen:
                continue
            if norm:
                seen.add(norm)
            kept.append(line)
        out.append(_tidy(kept))
    return out


def chunk_text(text: str, max_bytes: int, sep: str = "\n") -> list[str]:
    """Split `text` at `sep` boundaries into pieces of at most `max_bytes` UTF-8 bytes (a single
    longer piece stays whole), so one big file cannot swallow a whole split."""
    chunks, cur, size = [], [], 0
    for piece in text.split(sep):
        n = len(piece.encode()) + len(sep)
        if cur and size + n > max_bytes:
            chunks.append(sep.join(cur))
            cur, size = [], 0
        cur.append(piece)
        size += n
    if cur:
        chunks.append(sep.join(cur))
    return [c.strip("\n") for c in chunks if c.strip()]
