"""Corpora: shipped data vs manifests, split rule, extraction on fixtures, specs, sampling.

Offline and fast: the build path runs on a .deb made here in pure Python (no apt-get, no dpkg);
the real-download build is opt-in (REAP_TEST_NETWORK=1).
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import io
import json
import lzma
import os
import shutil
import struct
import sys
import tarfile
import zlib
from fractions import Fraction
from pathlib import Path

import pytest

from reap import corpora
from reap.cli import main as reap_main
from reap.corpora.builder import extract, roff
from reap.corpora.builder.pipeline import build_corpus
from reap.corpora.builder.recipes import load_recipe, source_key
from reap.corpora.builder.text import (
    chunk_text,
    count_words,
    dedupe_lines,
    filter_lines,
    join_lines,
    line_filter,
    looks_english,
)
from reap.corpora.mix import allocate, pack, seeded_order
from reap.corpora.store import Document, corpora_root, split_bytes
from reap.errors import ReapError

ROOT = corpora_root()
LEAVES = ["zh", "en", "de", "fr", "es", "it", "ja", "code-py", "code-c"]
SHIPPED = [n for n in LEAVES if (ROOT / n / "manifest.json").exists()]


# --- shipped data ------------------------------------------------------------------------------

def _rows(name: str, split: str) -> list[dict]:
    raw = lzma.decompress((ROOT / name / f"{split}.jsonl.xz").read_bytes())
    return [json.loads(line) for line in raw.decode().splitlines()], raw


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_split_matches_manifest(name):
    """sha256 and counts recomputed from the shipped files equal the manifest; every document
    sits in the split its key hashes to; ids sorted and unique."""
    manifest = json.loads((ROOT / name / "manifest.json").read_text())
    for split in corpora.SPLITS:
        rows, raw = _rows(name, split)
        m = manifest["splits"][split]
        assert hashlib.sha256(raw).hexdigest() == m["sha256"]
        texts = [r["text"] for r in rows]
        assert m["docs"] == len(rows) > 0
        assert m["bytes"] == sum(len(t.encode()) for t in texts)
        assert m["chars"] == sum(len(t) for t in texts)
        assert m["words"] == sum(count_words(t) for t in texts)
        ids = [r["id"] for r in rows]
        assert ids == sorted(set(ids))
        assert all(corpora.split_of(i) == split for i in ids)
    assert manifest["splits"]["calibration"]["bytes"] > 200_000
    assert all(s["version"] and len(s["sha256"]) == 64 for s in manifest["sources"])


def test_shipped_budget_and_notice():
    if not SHIPPED:
        pytest.skip("no corpus built")
    total = sum(f.stat().st_size for f in ROOT.rglob("*") if f.is_file())
    assert total < 13_000_000
    notice = (ROOT / "NOTICE.md").read_text()
    for name in SHIPPED:
        for s in json.loads((ROOT / name / "manifest.json").read_text())["sources"]:
            assert s["package"] in notice and s["version"] in notice and s["sha256"] in notice
        for split in corpora.SPLITS:
            f = ROOT / name / f"{split}.jsonl.xz"
            assert hashlib.sha256(f.read_bytes()).hexdigest() in notice


def test_translations_share_split():
    """Translated man pages / manuals share keys across de, fr, es, it, so they share splits."""
    have = [n for n in ("de", "fr", "es", "it") if n in SHIPPED]
    if len(have) < 2:
        pytest.skip("needs two European corpora")
    where = {}
    for n in have:
        for split in corpora.SPLITS:
            for d in corpora.load_documents(n, split):
                where.setdefault(d.id, set()).add(split)
    shared = [i for i, s in where.items() if i.startswith("man/")]
    assert len(shared) > 100
    assert all(len(s) == 1 for s in where.values())


def test_mix_manifest_and_documents():
    if not {"de", "fr", "es", "it"} <= set(SHIPPED):
        pytest.skip("eu parts not built")
    eu = corpora.corpus_info("eu")
    parts = [corpora.corpus_info(n) for n in ("de", "fr", "es", "it")]
    assert eu.splits["eval"].docs == sum(p.splits["eval"].docs for p in parts)
    docs = corpora.load_documents("eu", "eval")
    assert {d.corpus for d in docs} == {"de", "fr", "es", "it"} and len(docs) == eu.splits["eval"].docs
    assert len({d.id for d in docs}) == len(docs) and all(d.id.startswith(d.corpus + ":") for d in docs)


# --- text primitives --------------------------------------------------------------------------

def test_join_lines_cjk_rule():
    assert join_lines(["不可信任主", "机之间的通讯。"]) == "不可信任主机之间的通讯。"
    assert join_lines(["使用 OpenSSH", "客户端"]) == "使用 OpenSSH 客户端"
    assert join_lines(["the quick", "  brown fox "]) == "the quick brown fox"
    assert join_lines(["日本語の", "テキスト"]) == "日本語のテキスト"
    assert join_lines(["结束。", "下一句"]) == "结束。下一句"
    assert join_lines(["他说：", "\u201c", "人老了", "\u201d"]) == "他说：\u201c人老了\u201d"
    assert join_lines(["he said,", "\u201cyes\u201d", "\u201cno\u201d"]) == "he said, \u201cyes\u201d \u201cno\u201d"


def test_dedupe_filter_chunk_words():
    docs = ["NAME\nls - list\nThis page is part of release 6.03.", "NAME\ncp - copy\n\nThis page is part of release 6.03."]
    assert dedupe_lines(docs) == ["NAME\nls - list\nThis page is part of release 6.03.", "cp - copy"]
    assert filter_lines("中文一行\nEnglish only\n\n第二段", line_filter("zh")) == "中文一行\n\n第二段"
    assert filter_lines("カタカナだけ\nASCII", line_filter("ja")) == "カタカナだけ"
    assert looks_english("The file is opened with the default mode.", "de")
    assert not looks_english("Die Datei wird mit dem Standardmodus geöffnet.", "de")
    assert not looks_english("Le fichier est ouvert avec le mode par défaut.", "fr")
    assert looks_english("Open the file", "es") and not looks_english("Abre el archivo", "es")
    assert chunk_text("aaaa\nbbbb\ncccc", 10) == ["aaaa\nbbbb", "cccc"]
    assert count_words("中文 words 和 code") == 5  # 中 文 words 和 code


# --- extractors on fixtures -------------------------------------------------------------------

MAN = r""".\" comment
.TH LS 1 2022 "GNU" "User Commands"
.SH NAME
ls \- list directory contents
.SH DESCRIPTION
List information about the
.B FILEs
(the current directory by default).
.TP
\fB\-a\fR, \fB\-\-all\fR
do not ignore entries starting with \(lq.\(rq
.SH 描述
列出指定“文件”的
信息。
.nf
code line 1
  code line 2
.fi
.TS
tab(;);
l l.
a;b
.TE
.de XX
ignored macro body
..
.BR ls (1)
"""


def test_man_to_text():
    assert roff.man_to_text(MAN).split("\n") == [
        "NAME", "ls - list directory contents", "DESCRIPTION",
        "List information about the FILEs (the current directory by default).",
        "-a, --all", "do not ignore entries starting with \u201c.\u201d",
        "描述", "列出指定“文件”的信息。", "code line 1", "  code line 2", "ls(1)"]


HTML = """<html><head><title>T</title><script>var x=1;</script></head><body>
<header><a>Home</a></header><nav>Menu</nav><div class="navheader">Prev Next</div>
<h1>Titel &amp; mehr</h1><p>Erste Zeile
zweite Zeile <code>ls -l</code> Ende.</p><pre>code block</pre>
<p>中文第一行
第二行</p><ul><li>eins</li><li>zwei<br>drei</li></ul><footer>foot</footer></body></html>"""


def test_html_to_text():
    assert extract.html_to_text(HTML).split("\n") == [
        "Titel & mehr", "Erste Zeile zweite Zeile ls -l Ende.", "中文第一行第二行", "eins", "zwei", "drei"]


FORTUNE = ("\x1b[31mRoses are red,\x1b[0m\n  violets are blue.\n%\n"
           "This quotation is a long line of prose that was wrapped by the\n"
           "editor at about seventy columns for the fortune file format.\n-- Someone\n%\n")


def test_fortunes():
    assert extract.fortunes(FORTUNE) == [
        "Roses are red,\nviolets are blue.",
        "This quotation is a long line of prose that was wrapped by the editor at about seventy "
        "columns for the fortune file format.\n-- Someone"]


def test_rst_to_text():
    src = "Title\n=====\n\nSome *text* with :ref:`a link <x>` and\n``code``.\n\n.. note::\n\n   skipped\n\nExample::\n\n    literal\n\nEnd.\n"
    assert extract.rst_to_text(src).split("\n") == ["Title", "Some *text* with a link and code.", "Example:", "End."]


def test_tagged_text():
    src = "迈向/v  新/a  世纪/n  （/w  附/v  图片/n  １/m  张/q  ）/w\n[中央/n  人民/n  广播/vn  电台/n]nt  和/c  CCTV/nx  News/nx\n"
    assert extract.tagged_text(src) == "迈向新世纪（附图片１张）\n中央人民广播电台和 CCTV News"


def _sword_module(d: Path, books: list[str]) -> None:
    """A zText module with one zlib block per book: index (offset, size, raw size) triples."""
    d.mkdir(parents=True)
    blob, index = b"", b""
    for book in books:
        z = zlib.compress(book.encode())
        index += struct.pack("<3I", len(blob), len(z), len(book.encode()))
        blob += z
    (d / "nt.bzs").write_bytes(index)
    (d / "nt.bzz").write_bytes(blob)


BOOK = ('<div osisID="Matt" type="book"/><title>Matthew</title><chapter osisID="Matt.1" sID="Matt.1"/>'
        '<w lemma="x">The</w> <w lemma="y">book</w><note placement="foot">a note</note><w>of</w> '
        '<w>life</w>.<div type="x-p" sID="p1"/><w>Next</w> &amp; last.<chapter eID="Matt.1"/>'
        '<chapter osisID="Matt.2" sID="Matt.2"/>Second chapter.')


def test_sword_osis(tmp_path):
    _sword_module(tmp_path / "mod", ["<milestone/>", BOOK])
    books = extract.sword_books(tmp_path / "mod")
    assert books[1] == BOOK
    assert extract.osis_chapters(books[1]) == [("Matt.1", "The book of life.\nNext & last."),
                                               ("Matt.2", "Second chapter.")]


# --- build on a hand-made .deb (offline) ---------------------------------------------------------

def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo("./" + name)
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _deb(path: Path, package: str, version: str, files: dict[str, bytes]) -> None:
    members = [("debian-binary", b"2.0\n"),
               ("control.tar.xz", _tar({"control": f"Package: {package}\nVersion: {version}\n".encode()})),
               ("data.tar.xz", _tar(files))]
    out = b"!<arch>\n"
    for name, data in members:
        out += f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}`\n".encode() + data
        out += b"\n" if len(data) % 2 else b""
    path.write_bytes(out)


def _fixture_corpus(tmp_path: Path, n_pages: int = 60) -> tuple[Path, Path]:
    """Recipes dir + cache holding a fake man page package in two languages."""
    files = {}
    for i in range(n_pages):
        for lang, word in (("de", "Seite"), ("fr", "page")):
            body = f".TH P{i} 1\n.SH NAME\np{i} \\- {word} {i}\n.PP\n" + f"{word} {i} text. " * 20
            files[f"usr/share/man/{lang}/man1/p{i}.1.gz"] = gzip.compress(body.encode(), mtime=0)
    files["usr/share/doc/manpages-xx/copyright"] = b"License: GPL-3+\n"
    cache = tmp_path / "cache"
    (cache / "debs").mkdir(parents=True)
    _deb(cache / "debs" / "manpages-xx_1.0_all.deb", "manpages-xx", "1.0", files)
    recipes = tmp_path / "recipes"
    for lang in ("de", "fr"):
        (recipes / lang).mkdir(parents=True)
        (recipes / lang / "recipe.json").write_text(json.dumps({
            "name": lang, "description": f"test {lang}", "languages": [lang], "train_cap_mb": 0.004,
            "sources": [{"package": "manpages-xx", "licence": "GPL-3+", "format": "man",
                         "include": [f"usr/share/man/{lang}/man*/*"], "tag": "man",
                         "lang": f"(?<=usr/share/man/){lang}/", "dedupe": True}]}))
    return recipes, cache


def test_build_from_deb_is_deterministic(tmp_path, monkeypatch):
    recipes, cache = _fixture_corpus(tmp_path)
    out1, out2 = tmp_path / "o1", tmp_path / "o2"
    for out in (out1, out2):
        for lang in ("de", "fr"):
            build_corpus(lang, out=out, cache=cache, recipes=recipes, log=lambda m: None)
    m1 = json.loads((out1 / "de/manifest.json").read_text())
    assert m1 == json.loads((out2 / "de/manifest.json").read_text())
    assert m1["sources"][0]["version"] == "1.0" and m1["sources"][0]["licence_fields"] == ["GPL-3+"]
    assert m1["splits"]["train"]["full"]["docs"] > m1["splits"]["train"]["docs"]  # capped
    monkeypatch.setenv("REAP_CORPORA_DIR", str(out1))
    all_de = {s: corpora.load_documents("de", s) for s in corpora.SPLITS}
    ids = [d.id for s in corpora.SPLITS for d in all_de[s]]
    assert len(ids) == len(set(ids))
    for s in ("calibration", "eval"):  # translations in the same split, "NAME" deduped after doc 1
        assert [d.id for d in all_de[s]] == [d.id for d in corpora.load_documents("fr", s)]
    assert sum("NAME" in d.text.split("\n") for s in corpora.SPLITS for d in all_de[s]) <= 1
    doc = corpora.load_documents("fr", "calibration")[0]
    assert doc.text.startswith(doc.id.split("/")[-1].removesuffix(".1") + " - page")


def test_version_change_warns(tmp_path):
    recipes, cache = _fixture_corpus(tmp_path, 4)
    logs = []
    for _ in range(2):  # the second build finds the same version: no warning
        build_corpus("de", out=tmp_path / "o", cache=cache, recipes=recipes, log=logs.append)
    assert not any("warning" in m for m in logs)
    manifest = tmp_path / "o/de/manifest.json"
    m = json.loads(manifest.read_text())
    m["sources"][0]["version"] = "0.9"
    manifest.write_text(json.dumps(m))
    build_corpus("de", out=tmp_path / "o", cache=cache, recipes=recipes, log=logs.append)
    assert any("warning: manpages-xx is 1.0, the manifest was built from 0.9" in m for m in logs)


def test_local_only_recipe_guarded(tmp_path):
    recipes = tmp_path / "r"
    (recipes / "news").mkdir(parents=True)
    (recipes / "news" / "recipe.json").write_text(json.dumps({
        "name": "news", "description": "x", "languages": ["zh"],
        "sources": [{"package": "p", "licence": "unclear", "format": "text", "include": ["*"],
                     "tag": "t", "local_only": True}]}))
    with pytest.raises(ReapError, match="local-only"):
        build_corpus("news", out=tmp_path / "o", recipes=recipes)
    with pytest.raises(ReapError, match="must not be built"):
        build_corpus("news", out=recipes, recipes=recipes, local_only=True)


def test_recipes_parse_and_translation_keys():
    for name in corpora.corpus_names(ROOT):
        load_recipe(ROOT / name / "recipe.json")
    de = load_recipe(ROOT / "de" / "recipe.json").sources[0]
    fr = load_recipe(ROOT / "fr" / "recipe.json").sources[0]
    en = next(s for s in load_recipe(ROOT / "en" / "recipe.json").sources if s.format == "man")
    keys = {source_key(de, "usr/share/man/de/man1/ls.1.gz"), source_key(fr, "usr/share/man/fr/man1/ls.1.gz"),
            source_key(en, "usr/share/man/man1/ls.1.gz")}
    assert keys == {"man/usr/share/man/man1/ls.1"}


# --- split rule ------------------------------------------------------------------------------

def test_split_rule_reference():
    counts = {s: 0 for s in corpora.SPLITS}
    for i in range(20000):
        key = f"doc/{i}"
        h = int.from_bytes(hashlib.sha256(key.encode()).digest(), "big") % 1000
        want = "eval" if h < 50 else "calibration" if h < 150 else "train"
        assert corpora.split_of(key) == want
        counts[want] += 1
    assert 800 < counts["eval"] < 1200 and 1700 < counts["calibration"] < 2300


# --- specs and sampling ----------------------------------------------------------------------

def test_parse_spec():
    assert corpora.parse_spec("zh") == [("zh", 1.0)]
    assert corpora.parse_spec("zh:3+code:1") == [("zh", 3.0), ("code", 1.0)]
    assert corpora.parse_spec("en:0.5+./x.txt:2+hf:wikitext:wikitext-2-raw-v1") == [
        ("en", 0.5), ("./x.txt", 2.0), ("hf:wikitext:wikitext-2-raw-v1", 1.0)]
    for bad, msg in [("nope", "unknown corpus"), ("zh:0", "positive"), ("zh:abc", "bad corpus term"),
                     ("zh+zh", "twice"), ("", "empty"), ("zh+", "bad corpus term"), ("zh:-1", "bad")]:
        with pytest.raises(ReapError, match=msg):
            corpora.parse_spec(bad)


def test_allocate_exact():
    F = Fraction
    assert allocate(8, [F(3), F(1)]) == [6, 2]
    assert allocate(10, [F(1), F(1), F(1)]) == [4, 3, 3]
    assert allocate(7, [F(3, 4), F(1, 8), F(1, 8)]) == [5, 1, 1]
    for n in range(40):
        ws = [F(3), F(1, 2), F(1, 2), F(2)]
        got = allocate(n, ws)
        assert sum(got) == n
        assert all(abs(g - F(n) * w / sum(ws)) < 1 for g, w in zip(got, ws))


def _docs(n: int) -> list[Document]:
    return [Document(f"d{i}", f"document number {i} " * (i % 7 + 1), "t", "t") for i in range(n)]


def test_pack_matches_naive_reference():
    tok = corpora.ByteTokenizer(eos_id=256)
    docs = seeded_order(_docs(50), seed=3)
    seqs = pack(docs, tok, count=12, seq_len=37, label="t", split="train")
    stream, owner = [], []
    for d in docs:  # naive: concatenate everything, remember each token's document
        ids = tok.encode(d.text) + [256]
        stream += ids
        owner += [d.id] * len(ids)
    assert [s.ids for s in seqs] == [stream[i * 37:(i + 1) * 37] for i in range(12)]
    assert [s.doc_id for s in seqs] == [owner[i * 37] for i in range(12)]
    with pytest.raises(ReapError, match="tokens"):
        pack(docs, tok, count=10**6, seq_len=37, label="t", split="train")


def test_local_sources(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    texts = [f"local document {i} " * 5 for i in range(400)]
    (tmp_path / "a.txt").write_text("\n\n".join(texts))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    pq.write_table(pa.table({"text": texts}), tmp_path / "c.parquet")
    (tmp_path / "dir").mkdir()
    for i in range(30):
        (tmp_path / "dir" / f"f{i}.txt").write_text(texts[i])
    for name in ("a.txt", "b.jsonl", "c.parquet", "dir"):
        path = str(tmp_path / name)
        parts = {s: corpora.load_documents(path, s) for s in corpora.SPLITS}
        got = sorted(d.text.strip() for s in corpora.SPLITS for d in parts[s])
        want = texts[:30] if name == "dir" else texts
        assert got == sorted(t.strip() for t in want)
        assert all(corpora.split_of(d.id) == s for s in corpora.SPLITS for d in parts[s])
    seqs = corpora.sample_sequences(f"{tmp_path}/a.txt:1+{tmp_path}/b.jsonl:3", "train", corpora.ByteTokenizer(), 64 * 8, 64)
    assert [s.corpus.endswith("a.txt") for s in seqs].count(True) == 2 and len(seqs) == 8
    (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
    with pytest.raises(ReapError, match="bad.jsonl: line 1"):
        corpora.load_documents(str(tmp_path / "bad.jsonl"), "train")
    with pytest.raises(ReapError, match="no such file"):
        corpora.load_documents(str(tmp_path / "missing.txt"), "train")


def test_hf_sources(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ReapError, match="`datasets` package"):
        corpora.load_documents("hf:wikitext:wikitext-2-raw-v1", "train")

    class FakeDatasets:
        @staticmethod
        def load_dataset(name, config, split):
            if name == "offline":
                raise ConnectionError("Couldn't reach the hub")
            assert (name, config, split) == ("corp", None, "validation")
            return [{"content": f"row {i}"} for i in range(300)]

    monkeypatch.setitem(sys.modules, "datasets", FakeDatasets)
    docs = [d for s in corpora.SPLITS for d in corpora.load_documents("hf:corp::validation:content", s)]
    assert sorted(d.text for d in docs) == sorted(f"row {i}" for i in range(300))
    with pytest.raises(ReapError, match="cannot load hub dataset"):
        corpora.load_documents("hf:offline", "train")


@pytest.mark.skipif(not {"zh", "code-py", "code-c"} <= set(SHIPPED), reason="corpora not built")
def test_sample_sequences_shipped():
    tok = corpora.ByteTokenizer(eos_id=256)
    seqs = corpora.sample_sequences("zh:3+code:1", "calibration", tok, n_tokens=8 * 128 + 5, seq_len=128, seed=1)
    assert [s.corpus for s in seqs] == ["zh"] * 6 + ["code"] * 2
    assert all(len(s.ids) == 128 and s.split == "calibration" for s in seqs)
    assert seqs == corpora.sample_sequences("zh:3+code:1", "calibration", tok, 8 * 128, 128, seed=1)
    assert seqs != corpora.sample_sequences("zh:3+code:1", "calibration", tok, 8 * 128, 128, seed=2)
    cal_ids = {d.id for d in corpora.load_documents("zh", "calibration")}
    assert {s.doc_id for s in seqs[:6]} <= cal_ids
    assert {s.doc_id for s in seqs[6:]} <= {d.id for d in corpora.load_documents("code", "calibration")}
    assert all(s.split == "calibration" for s in corpora.calibration_sequences("zh", tok, 256, 128))
    with pytest.raises(ReapError, match="unknown split"):
        corpora.sample_sequences("zh", "test", tok, 256, 128)


@pytest.mark.skipif("zh" not in SHIPPED, reason="zh not built")
def test_fingerprint_and_list():
    m = json.loads((ROOT / "zh" / "manifest.json").read_text())
    content = m["splits"]["calibration"]["sha256"]
    want = hashlib.sha256(f"zh 1 {content}\n".encode()).hexdigest()
    assert corpora.corpus_fingerprint("zh", "calibration") == want
    assert corpora.corpus_fingerprint("zh", "eval") != want
    assert hashlib.sha256(split_bytes(corpora.load_documents("zh", "eval"))).hexdigest() == m["splits"]["eval"]["sha256"]
    info = {i.name: i for i in corpora.list_corpora()}
    assert info["zh"].splits["calibration"].docs == m["splits"]["calibration"]["docs"]
    assert "GFDL-1.2+" in info["zh"].licences


def test_cli(capsys):
    assert reap_main(["corpora", "list"]) == 0
    assert "zh" in capsys.readouterr().out
    assert reap_main(["corpora", "show", "nope"]) == 2
    assert "unknown corpus 'nope'" in capsys.readouterr().err
    if "zh" in SHIPPED:
        assert reap_main(["corpora", "show", "zh", "--split", "eval", "-n", "2"]) == 0
        assert capsys.readouterr().out.count("\n--- ") == 2


def test_corpora_imports_no_later_stage():
    later = ("reap.calibrate", "reap.analyze", "reap.prune", "reap.engine", "reap.eval")
    for path in Path(corpora.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.startswith(later) for n in names), path


@pytest.mark.skipif(os.environ.get("REAP_TEST_NETWORK") != "1" or not shutil.which("apt-get"),
                    reason="set REAP_TEST_NETWORK=1 (needs apt-get and the Debian mirror)")
def test_build_real_package_reproduces_manifest(tmp_path):
    build_corpus("code-py", out=tmp_path, cache=tmp_path / "cache", log=lambda m: None)
    got = json.loads((tmp_path / "code-py/manifest.json").read_text())
    want = json.loads((ROOT / "code-py/manifest.json").read_text())
    if got["sources"][0]["version"] == want["sources"][0]["version"]:
        assert got["sha256"] == want["sha256"]
