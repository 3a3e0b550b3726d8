"""`reap eval` reports from a hand-made results document: markdown tables keep one column per
build whatever the text holds, the HTML page is self-contained and escaped (checked with an HTML
parser), plots are real PNGs, files are written atomically, and the page renders in headless
Chromium with the generations in distinct columns (a screenshot, checked pixel by pixel)."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser

import numpy as np
import pytest

from reap.errors import ReapError
from reap.eval.generations import Prompt, with_metrics
from reap.eval.page import COLOURS
from reap.eval.results import _generation_results
from reap.eval.pipeline import write_report
from reap.eval.report import fmt_value
from reap.eval.summary import reference_quality, summarize_quality

HOSTILE = 'a | b <script>alert("x")</script></div>\x1b[31m & done'
PROMPTS = [
    Prompt("zh-1", "zh", "春节是中国最重要的传统节日。每到春节，人们都会"),
    Prompt("zh-2", "zh", "长江是中国第一长河，它发源于"),
    Prompt("code-1", "code", "def is_prime(n):\n"),
    Prompt("en-1", "en", "Once upon a time"),
]
OUTPUTS = {
    "full": [
        "回家和家人团聚，吃年夜饭。",
        "青藏高原，流经十一个省区。",
        "    if n < 2:\n        return False\n    return all(n % d for d in range(2, n))\n",
        " there lived a fisherman and his wife.",
    ],
    "zh-only": [
        "回家过年，贴春联，放鞭炮。",
        "唐古拉山脉。",
        "    是的是的是的是的是的是的是的是的是的是的是的是的",
        HOSTILE,
    ],
    "en+code": [
        "the the the the the the the the the the the the the",
        "the river flows east.",
        "    for d in range(2, n):\n        if n % d == 0:\n            return False\n",
        " there lived a fisherman and his wife.",
    ],
}


class _S:
    def __init__(self, tokens, nll, ref_nll, agree, kl):
        self.tokens, self.nll, self.ref_nll, self.agree, self.kl = tokens, nll, ref_nll, agree, kl


def make_results(with_quality: bool = True) -> dict:
    """A results document as `evaluate` writes it, from the summary and metric functions."""
    from dataclasses import asdict

    labels = list(OUTPUTS)
    gens = {}
    for lb, texts in OUTPUTS.items():
        rows = [
            {
                "id": p.id,
                "domain": p.domain,
                "ids": [ord(c) for c in t],
                "text": t,
                "finish_reason": "length",
            }
            for p, t in zip(PROMPTS, texts)
        ]
        gens[lb] = with_metrics(rows, PROMPTS)
    quality = {}
    if with_quality:
        rng = np.random.default_rng(0)
        for c, shift in (("zh", 0.3), ("code", 0.1)):
            per = {
                lb: [
                    _S(50, 50 * (4 + k * shift + rng.normal(0, 0.2)), 50 * 4, 50 - 9 * k, 2.0 * k)
                    for _ in range(8)
                ]
                for k, lb in enumerate(labels)
            }
            quality[c] = {labels[0]: asdict(reference_quality(per[labels[1]], 100))}
            quality[c].update({lb: asdict(summarize_quality(per[lb], 100)) for lb in labels[1:]})
    return {
        "format": "reap.eval/1",
        "reference": {"label": "full", "path": "runs/full", "fingerprint": "ab" * 32},
        "builds": [
            {"label": lb, "path": f"runs/{lb}", "fingerprint": "cd" * 32} for lb in labels[1:]
        ],
        "columns": labels,
        "arguments": {"max_docs": 8, "max_tokens_per_doc": 50, "bootstrap": 100, "gen_tokens": 16},
        "corpora": {c: {"sha256": "ef" * 32, "docs": 8, "tokens": 400} for c in quality},
        "prompts": {"source": "shipped", "count": len(PROMPTS), "sha256": "00" * 32},
        "quality": quality,
        **_generation_results(labels, gens, PROMPTS),
        "cache": {"hits": 0, "misses": 0, "dir": "cache"},
        "expert_failures": {},
    }


def test_fmt_value():
    assert fmt_value({"value": 1.23456, "lo": 1.1, "hi": 1.3}, "{:.3f}") == "1.235 [1.100, 1.300]"
    assert fmt_value({"value": 2.0, "lo": None, "hi": None}, "{:.1f}") == "2.0"
    assert fmt_value(None, "{:.1f}") == "-" and fmt_value(0.5, "{:.2f}") == "0.50"


def _table_rows(md: str) -> list[str]:
    return [ln for ln in md.splitlines() if ln.startswith("|")]


def test_markdown_tables_keep_one_column_per_build(tmp_path):
    r = make_results()
    write_report(r, tmp_path, plots=False)
    for name in ("report.md", "generations.md"):
        rows = _table_rows((tmp_path / name).read_text())
        assert rows
        for ln in rows:
            if ln.startswith(("| corpus |", "| zh |", "| code |")):
                continue  # the corpora table
            assert ln.count("|") == len(r["columns"]) + 2, ln
    gen = (tmp_path / "generations.md").read_text()
    assert "&lt;script&gt;" in gen and "<script>" not in gen and "\x1b" not in gen
    md = (tmp_path / "report.md").read_text()
    assert "| perplexity / reference | 1.0000 [1.0000, 1.0000] |" in md
    assert "## zh" in md and "## code" in md and "## en" in md


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.attrs, self.text, self.classes = [], [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs.append(dict(attrs))
        self.classes.append(dict(attrs).get("class", ""))

    def handle_data(self, data):
        self.text.append(data)


def test_html_is_self_contained_escaped_and_in_columns(tmp_path):
    r = make_results()
    write_report(r, tmp_path)
    page = (tmp_path / "report.html").read_text()
    p = _Page()
    p.feed(page)
    allowed = {
        "html",
        "head",
        "meta",
        "title",
        "style",
        "body",
        "h1",
        "h2",
        "p",
        "table",
        "tr",
        "th",
        "td",
        "div",
        "span",
        "img",
    }
    assert set(p.tags) <= allowed, set(p.tags) - allowed
    assert all("href" not in a for a in p.attrs)
    srcs = [a["src"] for t, a in zip(p.tags, p.attrs) if t == "img"]
    assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert "url(" not in page and "@import" not in page
    n = len(r["columns"])
    assert p.classes.count("head") == (n + 1) * len(r["generations"])
    cells = [c for c in p.classes if c.startswith("cell")]
    assert len(cells) == len(PROMPTS) * (n + 1)
    assert 'a | b <script>alert("x")</script></div>\u241b[31m & done' in "".join(p.text)
    assert sum("flag" in c for c in cells) >= 2  # the looping zh and the unparsable code


def test_plots_are_pngs_and_absent_metrics_have_none(tmp_path):
    import matplotlib.image as mpimg

    written = write_report(make_results(), tmp_path)
    pngs = sorted(p for p in written if p.startswith("plots/"))
    assert "plots/ppl_ratio.png" in pngs and "plots/python_valid.png" in pngs
    for p in pngs:
        img = mpimg.imread(tmp_path / p)
        assert img.ndim == 3 and img.shape[0] > 200 and img.std() > 0.05, p
    only_gen = tmp_path / "g"
    written = write_report(make_results(with_quality=False), only_gen)
    assert not any("ppl_ratio" in p or "kl" in p for p in written)
    assert (only_gen / "plots" / "looping.png").is_file()


def test_reports_are_rebuilt_from_results_json_and_written_atomically(tmp_path):
    write_report(make_results(), tmp_path, plots=False)
    first = {n: (tmp_path / n).read_text() for n in ("report.md", "report.html")}
    again = json.loads((tmp_path / "results.json").read_text())
    write_report(again, tmp_path / "b", plots=False)
    assert first == {n: (tmp_path / "b" / n).read_text() for n in first}
    assert not [f for f in os.listdir(tmp_path) if ".tmp." in f]
    blocked = tmp_path / "c"
    (blocked / "report.md").mkdir(parents=True)  # a directory where the file must go
    with pytest.raises(ReapError) as e:  # bad input (exit 2): reap replaces only files
        write_report(make_results(), blocked, plots=False)
    assert e.value.exit_code == 2 and "report.md" in str(e.value)


# -- headless Chromium --------------------------------------------------------------------------
def _hex(c: str) -> np.ndarray:
    return np.array([int(c[i : i + 2], 16) for i in (1, 3, 5)])


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium not installed")
def test_html_renders_in_chromium_with_one_column_per_build(tmp_path):
    from PIL import Image

    r = make_results(with_quality=False)
    write_report(r, tmp_path, plots=False)
    shot = tmp_path / "shot.png"
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [
                "chromium",
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                f"--user-data-dir={profile}",
                f"--screenshot={shot}",
                "--window-size=1400,900",
                (tmp_path / "report.html").resolve().as_uri(),
            ],
            capture_output=True,
            timeout=120,
            check=False,
            env={**os.environ, "HOME": profile},
        )
    assert shot.is_file()
    img = np.asarray(Image.open(shot).convert("RGB")).astype(int)  # [H, W, 3]
    assert img.shape == (900, 1400, 3)
    assert img.std() > 20  # not blank
    colours = ["#b7950b", *COLOURS[: len(r["columns"])]]  # the prompt header, then each build
    near = [np.abs(img - _hex(c)).sum(-1) < 12 for c in colours]  # [H, W] per colour
    y = int(np.argmax(near[0].sum(1)))  # the pixel row crossing the first grid header widest
    spans = []
    for c, m in zip(colours, near):
        xs = np.flatnonzero(m[y])
        assert len(xs) > 150, c  # a header block at least 150 px wide on that row
        spans.append((xs.min(), xs.max()))
    for (a0, a1), (b0, b1) in itertools.pairwise(spans):
        assert a1 < b0, spans  # disjoint, left to right in column order
