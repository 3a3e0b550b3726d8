"""Format extractors: raw file bytes of one source file -> documents' plain text.

Every extractor is a pure function of its input, so a rebuild from the same package versions
reproduces the corpus byte for byte. Formats: HTML (stdlib parser), fortune files, OSIS Bible
text in SWORD zText modules, reStructuredText, and source code (kept verbatim). Man pages live
in `reap.corpora.builder.roff`.
"""

from __future__ import annotations

import re
import struct
import unicodedata
import zlib
from html import unescape
from html.parser import HTMLParser
from pathlib import Path

from reap.corpora.builder.text import join_lines, strip_ansi

_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param",
         "source", "track", "wbr", "keygen"}
_BLOCK = {"p", "div", "h1", "h2", "h3", "h4", "h5", "h6", "li", "tr", "br", "dt", "dd", "table",
          "ul", "ol", "dl", "section", "article", "blockquote", "title", "th", "td", "caption",
          "figcaption", "main", "body", "hr", "center", "summary", "details", "tbody", "thead"}
# Whole subtrees that are not prose: scripts, page chrome, navigation, code blocks.
_SKIP_TAGS = {"script", "style", "head", "nav", "header", "footer", "aside", "pre", "noscript",
              "button", "select", "textarea", "svg", "math", "form", "template", "iframe"}
_SKIP_CLASS = re.compile(
    r"\b(navheader|navfooter|toc|related|sphinxsidebar|footer|header|breadcrumbs?|sidebar|"
    r"highlight|literal-block|programlisting|screen|synopsis|headerlink|debug|navigation)\b")


class _HtmlText(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.skip_depth: int | None = None  # stack depth of the skipped element
        self.block: list[str] = []
        self.lines: list[str] = []

    def _flush(self) -> None:
        text = join_lines("".join(self.block).split("\n"))
        if text:
            self.lines.append(text)
        self.block = []

    def handle_starttag(self, tag: str, attrs) -> None:
        a = dict(attrs)
        if tag in _BLOCK:
            self._flush()
        if tag in _VOID:
            return
        self.stack.append(tag)
        if self.skip_depth is None and (
                tag in _SKIP_TAGS or _SKIP_CLASS.search(f"{a.get('class') or ''} {a.get('id') or ''}")):
            self.skip_depth = len(self.stack)

    def handle_endtag(self, tag: str) -> None:
        if tag in _BLOCK:
            self._flush()
        if tag not in self.stack:
            return
        while self.stack:
            top = self.stack.pop()
            if self.skip_depth is not None and len(self.stack) < self.skip_depth:
                self.skip_depth = None
            if top == tag:
                break

    def handle_data(self, data: str) -> None:
        if self.skip_depth is None:
            self.block.append(data)


def html_to_text(source: str) -> str:
    """HTML page -> text: one line per block element (paragraph, heading, list item); scripts,
    navigation, page chrome and code blocks dropped; wrapped lines joined CJK-aware."""
    parser = _HtmlText()
    parser.feed(source)
    parser.close()
    parser._flush()
    return "\n".join(parser.lines)


def fortunes(source: str) -> list[str]:
    """A fortune file (entries separated by lines holding only `%`) -> the entries, ANSI colour
    codes stripped, hard-wrapped prose re-joined (see `unwrap`), short lines (verse) kept."""
    entries = re.split(r"(?m)^%\s*$", strip_ansi(source.replace("\r\n", "\n")))
    out = []
    for e in entries:
        text = "\n".join(unwrap([ln for ln in e.strip("\n").split("\n") if ln.strip()]))
        if text:
            out.append(text)
    return out


def display_width(line: str) -> int:
    """Terminal columns of a line: wide (CJK) characters count two."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in line)


def unwrap(lines: list[str]) -> list[str]:
    """Re-join hard-wrapped lines: a line filling at least 3/4 of the block's widest line (and
    that width at least 40 columns) continues on the next line, unless the next starts an
    attribution ("--"). Verse, whose lines are short or uneven, keeps its breaks."""
    width = max((display_width(ln.rstrip()) for ln in lines), default=0)
    out: list[list[str]] = []
    wrapped = False
    for ln in lines:
        if wrapped and not ln.lstrip().startswith("--"):
            out[-1].append(ln)
        else:
            out.append([ln])
        wrapped = width >= 40 and display_width(ln.rstrip()) >= 0.75 * width
    return [join_lines(group) for group in out]


def rst_to_text(source: str) -> str:
    """reStructuredText -> prose: directives, comments, literal blocks, tables and heading
    underlines dropped; inline roles reduced to their text; paragraphs joined CJK-aware."""
    lines, para, skip_indent = [], [], None

    def end_paragraph() -> None:
        if para:
            lines.append(join_lines(para))
            para.clear()

    for raw in source.replace("\r\n", "\n").split("\n"):
        indent = len(raw) - len(raw.lstrip())
        if skip_indent is not None:
            if raw.strip() and indent <= skip_indent:
                skip_indent = None
            else:
                continue
        s = raw.strip()
        if not s or re.fullmatch(r"([=\-~^\"'`#*+:._])\1{2,}", s) or s.startswith(("+-", "+=", "|")):
            end_paragraph()
            continue
        if s.startswith(".. ") or s == ".." or s.endswith("::"):
            end_paragraph()
            skip_indent = indent
            if s.endswith("::") and not s.startswith("..") and s[:-2].strip():
                lines.append(join_lines([s[:-1]]))  # "Example::" introduces a literal block
            continue
        s = re.sub(r":[a-z:]+:`([^`<]*?)(?:\s*<[^>]*>)?`", r"\1", s)
        s = re.sub(r"`([^`<]*?)(?:\s*<[^>]*>)?`_{0,2}", r"\1", s)
        para.append(s.replace("``", "").replace("**", ""))
    end_paragraph()
    return "\n".join(ln for ln in lines if ln.strip(" :"))


def tagged_text(source: str) -> str:
    """Part-of-speech tagged text (`word/tag` tokens, `[...]nt` compounds), one paragraph per
    line -> plain text, tokens joined CJK-aware (no space between Chinese words)."""
    out = []
    for line in source.replace("\r\n", "\n").split("\n"):
        words = [re.sub(r"/[A-Za-z]+$", "", re.sub(r"\][A-Za-z]+$", "", t)).lstrip("[")
                 for t in line.split()]
        text = join_lines([w for w in words if w])
        if text:
            out.append(text)
    return "\n".join(out)


def code_text(source: str) -> str:
    """Source code, kept verbatim except: tabs kept, trailing spaces and CRs removed."""
    return "\n".join(ln.rstrip() for ln in source.replace("\r\n", "\n").split("\n")).strip("\n")


# --- SWORD zText Bible modules (public-domain translations ship this way in Debian) ---

_OSIS_CHAPTER = re.compile(r'<chapter\b[^>]*\bsID="([^"]+)"[^>]*/>')
_OSIS_DROP = re.compile(r"<note\b.*?</note>|<title\b.*?</title>|<milestone\b[^>]*/>", re.DOTALL)


def sword_books(module_dir: Path) -> list[str]:
    """The uncompressed OSIS text of every book in a SWORD zText module directory (BlockType
    BOOK: one zlib block per book; the .bzs index holds (offset, size, raw size) triples)."""
    books = []
    for testament in ("ot", "nt"):
        bzs, bzz = module_dir / f"{testament}.bzs", module_dir / f"{testament}.bzz"
        if not bzs.exists():
            continue
        index, data = bzs.read_bytes(), bzz.read_bytes()
        for i in range(len(index) // 12):
            off, size, _ = struct.unpack_from("<3I", index, 12 * i)
            books.append(zlib.decompress(data[off:off + size]).decode("utf-8"))
    return books


def osis_chapters(book: str) -> list[tuple[str, str]]:
    """One book's OSIS markup -> [(osisID of the chapter, e.g. "Matt.1", plain text)]; notes,
    titles and Strong's markup dropped, one line per paragraph."""
    parts = _OSIS_CHAPTER.split(book)
    out = []
    for osis_id, body in zip(parts[1::2], parts[2::2]):
        # Word elements abutting a note or another word element lost their space in the module.
        body = re.sub(r"(</w>)(?:<note\b.*?</note>)*(?=<(?:w|transChange)\b)", r"\1 ", body, flags=re.DOTALL)
        body = re.sub(r"(</transChange>)(?=<w\b)", r"\1 ", body)
        body = _OSIS_DROP.sub("", body)
        body = re.sub(r'<div[^>]*type="x-p"[^>]*/>|<lb\b[^>]*/>|<p\b[^>]*>|</p>', "\n", body)
        body = re.sub(r"<[^>]+>", "", body)
        paras = [join_lines([ln]) for ln in unescape(body).split("\n")]
        text = "\n".join(p for p in paras if p)
        if text:
            out.append((osis_id, text))
    return out
