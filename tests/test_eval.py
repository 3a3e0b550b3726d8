"""`reap eval`: text metrics on hand-made strings, the bootstrap against a naive loop and normal
theory, streamed perplexity / agreement / KL against the in-memory forward of a tiny model and
its pruned build (cross-entropy and KL computed independently here), a build compared with
itself, the per-build cache, and CLI errors / exit codes."""

from __future__ import annotations

import functools
import json
import random
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from reap.checkpoint import Checkpoint
from reap.cli import main
from reap.eval import text_metrics
from reap.eval.summary import ratio_replicates, summarize_quality
from reap.models import family
from reap.models.base import dict_weights


# -- metrics on hand-made strings ---------------------------------------------------------------
def test_units_split_words_cjk_and_punctuation_runs():
    assert text_metrics.units("Hello, world!!! 你好 x_1=2 ===== カナ") == [
        "Hello",
        ",",
        "world",
        "!!!",
        "你",
        "好",
        "x_1",
        "=",
        "2",
        "=====",
        "カ",
        "ナ",
    ]


def test_distinct_n_exact_values():
    u = text_metrics.units("a b a b c")
    assert text_metrics.distinct_n(u, 1) == 3 / 5
    assert text_metrics.distinct_n(u, 2) == 3 / 4  # ab ba ab bc
    assert text_metrics.distinct_n(u, 3) == 1.0  # aba bab abc
    assert text_metrics.distinct_n(text_metrics.units("的的的的"), 1) == 1 / 4
    assert text_metrics.distinct_n(text_metrics.units("的的的的"), 2) == 1 / 3
    assert text_metrics.distinct_n(["a"], 2) == 0.0 and text_metrics.distinct_n([], 1) == 0.0


def test_longest_repeated_ngram_matches_brute_force():
    def brute(u):
        best = 0
        for n in range(1, len(u)):
            grams = [tuple(u[i : i + n]) for i in range(len(u) - n + 1)]
            if len(set(grams)) < len(grams):
                best = n
        return best

    rng = random.Random(0)
    for _ in range(200):
        u = [rng.choice("abc") for _ in range(rng.randint(0, 25))]
        assert text_metrics.longest_repeated_ngram(u) == brute(u), u
    assert text_metrics.longest_repeated_ngram(text_metrics.units("the cat sat . the cat ran")) == 2


LOOPING = [
    "I like cats. " * 6,
    "今天天气很好。" + "的" * 20,
    "We went to the shop and then " + "we went home and " * 4 + "we went",  # cut mid-copy
    "def f():\n    return 1\n" + "    return x\n" * 8,
]
NOT_LOOPING = [
    "ha ha ha, that was funny.",
    (
        "The water cycle describes how water moves between the oceans, the air and the land. It "
        "starts when the sun heats the sea and water evaporates into the atmosphere."
    ),
    ", ".join(str(i) for i in range(1, 30)),
    "# ==========================\ndef area(r):\n    return 3.14159 * r * r\n",
    "春节是中国最重要的传统节日。每到春节，人们都会回家和家人团聚，吃年夜饭，放鞭炮。",
    "",
]


@pytest.mark.parametrize("text", LOOPING)
def test_looping_text_is_flagged(text):
    m = text_metrics.generation_metrics(text, "en")
    assert m["looping"] and m["loop_period"] >= 1


@pytest.mark.parametrize("text", NOT_LOOPING)
def test_non_looping_text_is_not_flagged(text):
    assert not text_metrics.generation_metrics(text, "en")["looping"]


def test_loop_period_and_span():
    loop = text_metrics.find_loop(text_metrics.units("x y " + "a b c " * 5))
    assert (loop.period, loop.span, loop.repeats) == (3, 15, 5.0)


def test_python_validity():
    head = "def f(x):\n"
    assert text_metrics.python_valid("    return x + 1\n", head)
    assert text_metrics.python_valid("    y = x * 2\n    return y\nprint(f(", head)  # cut last line dropped
    assert not text_metrics.python_valid("    return (x +\n", head)
    assert not text_metrics.python_valid("return ]]] x", head)
    assert text_metrics.python_valid("Sure:\n```python\nimport os\nprint(os.sep)\n```\nDone.")
    assert text_metrics.python_valid("```\nx = 1\n")  # a fence never closed runs to the end
    assert not text_metrics.python_valid("```python\nx = (\n```\nx = 1\n")  # the fenced block decides
    assert not text_metrics.python_valid("", "import os\n")  # an empty generation is not code
    assert not text_metrics.python_valid("garbage words here", "import os\n")
    assert not text_metrics.python_valid("x = 1\x00\n", "")  # null bytes: rejected, no crash
    assert not text_metrics.python_valid("\n\n", "import sys\n\n")


def test_script_shares():
    assert text_metrics.script_share("你好世界abc", "zh") == 4 / 7
    assert text_metrics.script_share("你好，世界！123", "zh") == 1.0  # punctuation, digits: not letters
    assert text_metrics.script_share("Hello, wörld", "en") == 9 / 10
    assert text_metrics.script_share("日本語のテキスト abc", "ja") == 8 / 11
    assert text_metrics.kana_share("日本語のテキスト abc") == 5 / 11
    assert text_metrics.script_share("Ça va très bien мир", "eu") == 12 / 15
    assert text_metrics.script_share("x = 1  # é", "code") == 4 / 5
    assert text_metrics.script_share("123 !!", "zh") == 0.0 and text_metrics.script_share("", "code") == 0.0
    assert text_metrics.script_share("text", "xx") is None
    m = text_metrics.generation_metrics("カタカナ", "ja")
    assert m["script"] == 1.0 and m["kana"] == 1.0 and m["python_valid"] is None


# -- bootstrap ----------------------------------------------------------------------------------
def test_bootstrap_replicates_equal_a_naive_loop_over_the_same_draws():
    rng = np.random.default_rng(1)
    num, den = rng.random((7, 2)), rng.integers(1, 20, 7).astype(float)
    got = ratio_replicates(num, den, 300, seed=5)
    draws = np.random.default_rng(5).integers(0, 7, size=(256, 7))  # the first block
    for b in range(256):
        idx = list(draws[b])
        want = [sum(num[i, j] for i in idx) / sum(den[i] for i in idx) for j in range(2)]
        assert np.allclose(got[b], want, rtol=1e-12)


class _S:
    def __init__(self, tokens, nll, ref_nll, agree=0, kl=0.0):
        self.tokens, self.nll, self.ref_nll, self.agree, self.kl = tokens, nll, ref_nll, agree, kl


def test_bootstrap_interval_agrees_with_normal_theory():
    rng = np.random.default_rng(0)
    losses = rng.normal(3.0, 0.5, 400)
    scores = [_S(10, 10 * x, 10 * 3.0, 5, 0.1) for x in losses]
    s = summarize_quality(scores, n_boot=2000)
    se = losses.std(ddof=1) / np.sqrt(len(losses))
    assert s.loss.value == pytest.approx(losses.mean(), rel=1e-12)
    assert s.loss.lo == pytest.approx(losses.mean() - 1.96 * se, abs=0.15 * se)
    assert s.loss.hi == pytest.approx(losses.mean() + 1.96 * se, abs=0.15 * se)
    assert s.agreement.value == 0.5 and s.kl.value == pytest.approx(0.01)
    assert s.ppl_ratio.value == pytest.approx(np.exp(losses.mean() - 3.0))
    assert summarize_quality(scores, n_boot=0).loss.lo is None


# -- streamed scoring against the in-memory forward ---------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A float32 k3-tiny and a build of it pruned to 8 of 16 experts per layer (random plan)."""
    from reap.prune.plan import make_plan
    from reap.prune.write import prune
    from reap.synth import synth

    d = tmp_path_factory.mktemp("eval")
    tiny = synth("k3-tiny", d / "tiny", seed=3, dtype="float32")
    cfg = json.loads((d / "tiny" / "config.json").read_text())
    prune(
        model=tiny, plan=make_plan(config=cfg, criterion="random", keep=8, seed=1), out=d / "pruned"
    )
    return str(d / "tiny"), str(d / "pruned")


def _in_memory_logits(path: str, ids: list[int]) -> torch.Tensor:
    ck = Checkpoint.open(path)
    fam = family(ck.config)
    model = fam.Model(fam.Config.from_dict(ck.config))
    get = dict_weights({n: ck.read(n) for n in ck.tensors})
    with torch.inference_mode():
        return model.forward(get, torch.tensor([ids]))[0].double()  # [T, V]


def test_streamed_scores_equal_the_in_memory_forward(models):
    from reap.engine import Engine
    from reap.eval.quality import score_documents, select_documents
    from reap.tokenizer import load_tokenizer

    tiny, pruned = models
    docs = select_documents("en", load_tokenizer(tiny), max_docs=2, max_tokens=40)
    docs[1].ids = docs[1].ids[:29]  # documents of different lengths in one lockstep batch
    with (
        Engine.open(tiny, preset="max", context=64, batch=2, prefill_chunk=16) as ref,
        Engine.open(pruned, preset="max", context=64, batch=2, prefill_chunk=16) as build,
    ):
        rows = []
        step = build.step
        build.step = lambda seqs, chunks, **kw: (
            rows.extend(map(len, chunks)),
            step(seqs, chunks, **kw),
        )[1]
        scores = score_documents(ref, build, docs, batch=2)
    assert max(rows) == 16  # streamed: one prefill chunk of logits per document at a time
    for d, s in zip(docs, scores):
        lr, lb = _in_memory_logits(tiny, d.ids)[:-1], _in_memory_logits(pruned, d.ids)[:-1]
        targets = torch.tensor(d.ids[1:])
        assert s.tokens == len(d.ids) - 1
        assert s.nll == pytest.approx(
            float(F.cross_entropy(lb, targets, reduction="sum")), rel=1e-5
        )
        assert s.ref_nll == pytest.approx(
            float(F.cross_entropy(lr, targets, reduction="sum")), rel=1e-5
        )
        kl = F.kl_div(
            F.log_softmax(lb, -1), F.log_softmax(lr, -1), log_target=True, reduction="sum"
        )
        assert s.kl == pytest.approx(float(kl), rel=1e-4, abs=1e-6)
        assert s.agree == sum(int(torch.argmax(a) == torch.argmax(b)) for a, b in zip(lr, lb))
        assert 0 < s.agree < s.tokens and s.kl > 0
    ppl = np.exp(sum(s.nll for s in scores) / sum(s.tokens for s in scores))
    assert summarize_quality(scores, n_boot=0).ppl.value == pytest.approx(ppl, rel=1e-12)


# -- whole evaluations --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    p = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    rows = [
        {"id": "z1", "domain": "zh", "prompt": "你好，"},
        {"id": "c1", "domain": "code", "prompt": "def f(x):\n"},
        {"id": "e1", "domain": "en", "prompt": "Once upon a time"},
        {"id": "e2", "domain": "en", "prompt": "The cat"},
    ]
    p.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return str(p)


def _evaluate(models, prompts, out, **kw):
    from reap.eval import evaluate

    tiny, pruned = models
    args = {
        "builds": [tiny, f"small={pruned}"],
        "reference": tiny,
        "corpora": ["en"],
        "out": str(out),
        "max_docs": 2,
        "max_tokens_per_doc": 24,
        "prompts": prompts,
        "gen_tokens": 6,
        "bootstrap": 50,
        "progress": False,
        "preset": "max",
    }
    return evaluate(**{**args, **kw})


def test_build_compared_with_itself_and_the_cache(models, prompts, tmp_path, monkeypatch):
    r = _evaluate(models, prompts, tmp_path)
    ref, me, small = r["columns"]
    assert (ref, me, small) == ("tiny", "tiny#2", "small")
    q = r["quality"]["en"]
    assert q[me]["agreement"]["value"] == 1.0 and q[me]["kl"]["value"] == 0.0
    assert q[me]["ppl_ratio"]["value"] == 1.0 and q[me]["loss"] == q[ref]["loss"]
    assert q[small]["agreement"]["value"] < 1.0 and q[small]["kl"]["value"] > 0
    lo, hi = q[small]["ppl_ratio"]["lo"], q[small]["ppl_ratio"]["hi"]
    assert lo <= q[small]["ppl_ratio"]["value"] <= hi
    for dom, rows in r["generations"].items():
        for row in rows:
            assert row["outputs"][me]["text"] == row["outputs"][ref]["text"]
        assert r["generation_summary"][dom][me]["same_as_reference"] == 1.0
    assert [row["id"] for row in r["generations"]["en"]] == ["e1", "e2"]
    assert r["cache"] == {"hits": 0, "misses": 5, "dir": str(tmp_path / "cache")}

    import reap.engine.core

    def refuse(*a, **k):
        raise AssertionError("an engine was opened although every result is cached")

    monkeypatch.setattr(reap.engine.core.Engine, "open", classmethod(refuse))
    again = _evaluate(models, prompts, tmp_path, plots=False)
    assert again["cache"]["hits"] == 5 and again["quality"] == r["quality"]
    assert again["generations"] == r["generations"]
    monkeypatch.undo()
    fewer = _evaluate(
        models, prompts, tmp_path, gen_tokens=3, plots=False
    )  # only generations recomputed
    assert fewer["cache"]["hits"] == 2 and fewer["cache"]["misses"] == 3
    assert all(
        len(o["metrics"]) and o["metrics"]["tokens"] <= 3
        for row in fewer["generations"]["en"]
        for o in row["outputs"].values()
    )


# -- CLI ----------------------------------------------------------------------------------------
def _run(*args, capsys):
    try:
        code = main(["eval", *args])
    except SystemExit as e:  # argparse: exit status 2
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_bad_input_is_one_line_exit_2(models, tmp_path, capsys):
    tiny, _ = models
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "domain": "en", "prompt": "x"}\n{"id": "b"}\n')
    other = tmp_path / "other-tokenizer"
    shutil.copytree(tiny, other)
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text() + "\n")
    base = [tiny, "--reference", tiny, "--out", str(tmp_path / "o"), "--quiet"]
    cases = [
        ([*base, "--corpus", "nosuch"], "unknown corpus"),
        ([*base, "--prompts", str(bad)], "bad.jsonl:2"),
        ([*base, "--max-docs", "0"], "--max-docs must be positive"),
        ([str(tmp_path / "missing"), "--reference", tiny, "--out", str(tmp_path / "o")], "missing"),
        ([*base, "--gen-domains", "xx"], "domain 'xx'"),
        ([str(other), "--reference", tiny, "--out", str(tmp_path / "o")], "tokenizer.json"),
    ]
    for args, msg in cases:
        code, _, err = _run(*args, capsys=capsys)
        assert code == 2, (args, err)
        assert msg in err and len(err.strip().splitlines()) == 1, err
    code, _, err = _run(tiny, "--out", str(tmp_path / "o"), capsys=capsys)
    assert code == 2 and "--reference" in err


def test_cli_exit_4_when_a_build_expert_fails_and_nothing_is_cached(models, tmp_path, capsys):
    tiny, _ = models
    d = tmp_path / "corrupt"
    shutil.copytree(tiny, d)
    ck = Checkpoint.open(d)
    fam = family(ck.config)
    expert_names = functools.partial(fam.expert_tensor_names, fam.Config.from_dict(ck.config))
    with open(ck.tensors[expert_names(1, 0)[0]].file, "r+b") as f:
        for e in range(fam.Config.from_dict(ck.config).num_experts):  # every expert of layer 1
            t = ck.tensors[expert_names(1, e)[1]]  # a scale tensor: NaN scales
            f.seek(t.start)
            f.write(b"\xff" * t.nbytes)
    out = tmp_path / "o"
    code, stdout, err = _run(
        f"bad={d}",
        "--reference",
        tiny,
        "--corpus",
        "en",
        "--out",
        str(out),
        "--max-docs",
        "1",
        "--max-tokens-per-doc",
        "12",
        "--gen-tokens",
        "0",
        "--bootstrap",
        "0",
        "--preset",
        "max",
        "--quiet",
        "--no-plots",
        capsys=capsys,
    )
    assert code == 4 and "bad:" in err and "not trustworthy" in err
    results = json.loads((out / "results.json").read_text())
    assert {layer for layer, _, _ in results["expert_failures"]["bad"]} == {1}
    assert not list((out / "cache").glob("*.json"))
    code, stdout, _ = _run(
        tiny,
        "--reference",
        tiny,
        "--corpus",
        "en",
        "--out",
        str(out),
        "--max-docs",
        "1",
        "--max-tokens-per-doc",
        "12",
        "--gen-tokens",
        "0",
        "--quiet",
        "--no-plots",
        capsys=capsys,
    )
    assert code == 0 and "report.md" in stdout and (out / "report.html").is_file()


def test_reference_and_build_share_one_budget(models):
    from reap.eval.builds import Engines, make_builds

    from reap.memstat import current_rss

    tiny, pruned = models
    ref, build = make_builds([tiny, pruned])
    # The budget counts this process's RSS, which depends on the tests that ran before it
    # (Ray's client, full-size layouts): give both engines the same 400 MB above it.
    total = current_rss() + 400 * 10**6
    opts = {
        "budget": str(total),
        "preset": None,
        "context": 64,
        "device": "cpu",
        "dtype": "auto",
        "plan_batch": 2,
        "gen_tokens": 4,
    }
    engines = Engines(ref, opts)
    r = engines.reference_engine()
    b = engines.build_engine(build)
    try:
        half = r.plan.baseline + (total - r.plan.baseline) // 2  # baseline: RSS when opened
        assert abs(r.plan.budget - half) < 20 * 10**6
        assert b.plan.budget == total - (r.plan.total - r.plan.baseline)
        assert (r.plan.total - r.plan.baseline) + b.plan.total <= total
    finally:
        b.close()
        engines.close()
