"""Man pages (roff with the `man` macros) to plain text, in pure Python.

Not a full troff: it understands the macros and escapes that real man pages use, so the build
does not depend on the installed groff version (its output would change the corpus hash). Text
in fill mode is joined into one line per paragraph (CJK-aware), headings and list tags get a
line of their own, no-fill blocks keep their lines, tables and macro definitions are dropped.
"""

from __future__ import annotations

import re

from reap.corpora.builder.text import join_lines

_NAMED = {
    "em": "\u2014", "en": "\u2013", "hy": "-", "bu": "\u2022", "lq": "\u201c", "rq": "\u201d",
    "oq": "\u2018", "cq": "\u2019", "aq": "'", "dq": '"', "co": "\u00a9", "rg": "\u00ae",
    "tm": "\u2122", "ti": "~", "ha": "^", "mu": "\u00d7", "de": "\u00b0", ">=": "\u2265",
    "<=": "\u2264", "!=": "\u2260", "Fo": "\u00ab", "Fc": "\u00bb", "fo": "\u2039", "fc": "\u203a",
    "ga": "`", "aa": "\u00b4", "sc": "\u00a7", "ps": "\u00b6", "->": "\u2192", "<-": "\u2190",
    "pl": "+", "mi": "\u2212", "eq": "=", "sl": "/", "rs": "\\", "ba": "|", "at": "@", "sh": "#",
    "Do": "$", "lB": "[", "rB": "]", "lC": "{", "rC": "}", "la": "\u27e8", "ra": "\u27e9",
    "bv": "|", "br": "|", "ul": "_", "ru": "_", "pc": "\u00b7", "dg": "\u2020", "ct": "\u00a2",
    "Po": "\u00a3", "Eu": "\u20ac", "Ye": "\u00a5", "12": "\u00bd", "14": "\u00bc", "34": "\u00be",
    "R": "\u00ae", "Tm": "\u2122", "ss": "\u00df", "lh": "\u261c", "rh": "\u261e",
}
_ACCENTS = {"'": "\u0301", "`": "\u0300", ":": "\u0308", "^": "\u0302", "~": "\u0303", ",": "\u0327"}

_ESCAPE_RE = re.compile(
    r"\\(?:"
    r"(?P<font>f(?:\[[^\]]*\]|\(..|.))"
    r"|(?P<size>s(?:[-+]?\d|\([-+]?\d\d|\[[^\]]*\]|[-+]\(\d\d))"
    r"|(?P<named>\((?P<n2>..)|\[(?P<nb>[^\]]*)\])"
    r"|(?P<string>\*(?:\((?P<s2>..)|\[(?P<sb>[^\]]*)\]|(?P<s1>.)))"
    r"|(?P<arg>[hvwoLlDXZbRx]'[^']*')"
    r"|(?P<reg>[nmMgkF](?:\(..|\[[^\]]*\]|.))"
    r"|(?P<num>N'(?P<code>\d+)')"
    r"|(?P<char>.)"
    r")",
    re.DOTALL,
)
_SIMPLE = {"-": "-", "e": "\\", "\\": "\\", " ": " ", "~": " ", "0": " ", "'": "\u00b4",
           "`": "`", ".": ".", "t": " ", "E": "\\", "_": "_"}
_PARA_MACROS = {"PP", "LP", "P", "sp", "br", "HP", "RS", "RE", "in", "ti", "TQ", "bp", "EE",
                "fi", "nf", "EX", "IP", "TP", "SH", "SS", "TH", "TS", "TE", "YS", "SY", "UE",
                "ME", "Sh", "Pp", "Bl", "El", "It", "Bd", "Ed", "Ss"}
_FONT_MACROS = {"B", "I", "SM", "SB", "BR", "RB", "IR", "RI", "BI", "IB", "Nm", "Ar", "Fl",
                "Cm", "Pa", "Xr", "Em", "Sy", "Li", "Dq", "Sq", "Ql", "Nd", "Va", "Ev", "Fn", "Ft"}


def _named(name: str) -> str:
    if name in _NAMED:
        return _NAMED[name]
    m = re.fullmatch(r"u([0-9A-Fa-f]{4,6})(?:_.*)?", name)
    if m:
        return chr(int(m.group(1), 16))
    if len(name) == 2 and name[1] in _ACCENTS:  # e.g. \(e' -> é (rare in UTF-8 pages)
        return name[0] + _ACCENTS[name[1]]
    return ""


def _escape(m: re.Match) -> str:
    if m.group("named"):
        return _named(m.group("n2") or m.group("nb"))
    if m.group("string"):
        name = m.group("s2") or m.group("sb") or m.group("s1")
        return {"lq": "\u201c", "rq": "\u201d", "R": "\u00ae", "Tm": "\u2122", "Aq": "'"}.get(name, "")
    if m.group("num"):
        return chr(int(m.group("code")))
    if m.group("char") is not None:
        return _SIMPLE.get(m.group("char"), "")
    return ""  # fonts, sizes, motions, registers


def unescape(text: str) -> str:
    """Roff escapes in a text line -> characters; font/size/motion escapes removed."""
    text = re.sub(r'\\".*$', "", text)  # inline comment
    return _ESCAPE_RE.sub(_escape, text)


def _args(rest: str) -> list[str]:
    """Macro arguments: space-separated, double quotes group ("" inside is a literal quote)."""
    return [m.group(1).replace('""', '"') if m.group(1) is not None else m.group(2)
            for m in re.finditer(r'"((?:[^"]|"")*)"?|(\S+)', rest)]


class _Page:
    """Accumulates output lines; `para` holds the fill-mode lines of the current paragraph."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.para: list[str] = []
        self.fill = True

    def flush(self) -> None:
        if self.para:
            self.lines.append(join_lines(self.para))
            self.para = []

    def text(self, s: str) -> None:
        if self.fill:
            self.para.append(s)
        else:
            self.lines.append(s.rstrip())

    def alone(self, s: str) -> None:
        self.flush()
        if s.strip():
            self.lines.append(join_lines([s]))


def man_to_text(source: str) -> str:
    """A man page's roff source -> plain text, one paragraph/heading/tag per line."""
    page, skip_until, tag_next = _Page(), None, False
    for raw in source.replace("\r\n", "\n").split("\n"):
        if skip_until is not None:
            if raw.strip().startswith(skip_until):
                skip_until = None
            continue
        if raw.startswith((".", "'")):
            name, _, rest = raw[1:].strip().partition(" ")
            if name.startswith('\\"') or name in ("", '\\"'):
                continue
            if name in ("de", "de1", "am", "ig"):
                skip_until = ".."
            elif name == "TS":
                page.flush()
                skip_until = ".TE"
            elif name in ("so", "mso"):
                continue
            elif name in _FONT_MACROS or name in ("SH", "SS", "IP", "Sh", "Ss"):
                alternate = len(name) == 2 and name.isupper() and name not in ("SH", "SS", "IP", "SM", "SB")
                args = _args(rest)
                if name == "IP":
                    args = args[:1]
                words = unescape(("" if alternate else " ").join(args))
                if name in ("SH", "SS", "IP", "Sh", "Ss") or tag_next:
                    page.alone(words)
                    tag_next = False
                else:
                    page.text(words)
            elif name in _PARA_MACROS:
                page.flush()
                if name in ("nf", "EX", "Bd"):
                    page.fill = False
                elif name in ("fi", "EE", "Ed"):
                    page.fill = True
                tag_next = name in ("TP", "TQ")
            continue
        line = unescape(raw)
        if tag_next:
            page.alone(line)
            tag_next = False
        elif not raw.strip():
            page.flush()
        else:
            page.text(line)
    page.flush()
    return "\n".join(ln for ln in page.lines if ln.strip())
