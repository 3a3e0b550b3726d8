"""lm-eval-harness on the engine (reap.eval.harness): a tiny random Qwen3-MoE saved by
transformers, scored through model `reap` and through lm-eval's own `hf` model on the made-up
local tasks of tests/fixtures/lm_eval (same accuracy, log-likelihoods within float tolerance,
same generations); rolling windows, cut contexts and greedy flags against `hf` request by
request; `python -m reap.eval.harness` (lm-eval's CLI) end to end; `reap eval --tasks` writing
the scores with intervals into the report; one-line errors, also without lm-eval."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")
import family_runner as R
from lm_eval.api.instance import Instance

from reap.cli import main

FIXTURES = Path(__file__).parent / "fixtures" / "lm_eval"
TASKS = ["reap_tiny_mc", "reap_tiny_gen"]
REPO = Path(__file__).resolve().parents[1]
QWEN = {
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
    "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "mlp_only_layers": [1],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "eos_token_id": 256,
    "max_position_embeddings": 512,
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    path, _ = R.save_hf_tiny(Qwen3MoeForCausalLM, Qwen3MoeConfig, QWEN,
                             tmp_path_factory.mktemp("lm_eval") / "m", seed=1,
                             config_extra={"num_experts": 8, "rope_theta": 10000.0})
    return path


@pytest.fixture(autouse=True)
def in_fixtures(monkeypatch):
    monkeypatch.chdir(FIXTURES)  # the task YAMLs name their JSONL relative to it


def _evaluate(model: str, model_args: str, **kw):
    from reap.eval.harness import task_manager  # also registers model "reap"

    return lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=TASKS, device="cpu", log_samples=True,
        task_manager=task_manager(str(FIXTURES), tuple(TASKS)), bootstrap_iters=10,
        verbosity="ERROR", **kw)


def test_reap_model_scores_like_the_hf_model(tiny):
    ours = _evaluate("reap", f"pretrained={tiny},preset=max,max_length=256", batch_size=3)
    hf = _evaluate("hf", f"pretrained={tiny},dtype=float32")
    for task, metric in (("reap_tiny_mc", "acc,none"), ("reap_tiny_mc", "acc_norm,none"),
                         ("reap_tiny_gen", "exact_match,none")):
        assert ours["results"][task][metric] == hf["results"][task][metric]
    mc = list(zip(ours["samples"]["reap_tiny_mc"], hf["samples"]["reap_tiny_mc"]))
    assert len(mc) == 6
    for a, b in mc:
        for (ll_a, greedy_a), (ll_b, greedy_b) in zip(*(
                [r[0] for r in s["resps"]] for s in (a, b))):
            assert ll_a == pytest.approx(ll_b, rel=1e-5, abs=1e-4) and greedy_a == greedy_b
    gens = [(a["resps"][0][0], b["resps"][0][0])
            for a, b in zip(ours["samples"]["reap_tiny_gen"], hf["samples"]["reap_tiny_gen"])]
    assert [a for a, _ in gens] == [b for _, b in gens] and any(a for a, _ in gens)


def test_rolling_windows_cut_contexts_and_greedy_flags_match_hf(tiny):
    """max_length 24: documents span several rolling windows, long contexts are cut on the left,
    and a continuation that is the argmax token is flagged greedy by both."""
    from lm_eval.models.huggingface import HFLM

    from reap.eval.harness import ReapLM

    ours = ReapLM(pretrained=tiny, preset="max", max_length=24, batch_size=3)
    hf = HFLM(pretrained=tiny, dtype="float32", device="cpu", max_length=24, batch_size=3)
    texts = ["The quick brown fox jumps over the lazy dog, twice over.", "short", "a" * 70]
    rolling = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    for a, b in zip(ours.loglikelihood_rolling(rolling), hf.loglikelihood_rolling(rolling)):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-4)
    import torch

    ctx = ours.tok_encode(texts[0])  # 56 ids: cut to the last 24 with the continuation
    with torch.inference_mode():
        top = int(hf.model(torch.tensor([ctx[-24:]])).logits[0, -1].argmax())
    reqs = [(None, ctx, [top]), (None, ctx, [(top + 1) % 256, top]), (None, [256], ctx[:9])]
    a, b = ours._loglikelihood_tokens(reqs), hf._loglikelihood_tokens(reqs)
    assert [g for _, g in a] == [g for _, g in b] == [True, False, False]
    for (x, _), (y, _) in zip(a, b):
        assert x == pytest.approx(y, rel=1e-5, abs=1e-4)
    ours.engine.close()


def _env(tmp_path) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
            "HF_DATASETS_CACHE": str(tmp_path / "datasets")}


def test_python_m_harness_runs_lm_evals_cli(tiny, tmp_path):
    args = [sys.executable, "-m", "reap.eval.harness", "--model", "reap", "--tasks", *TASKS,
            "--include_path", ".", "--device", "cpu", "--limit", "3",
            "--output_path", str(tmp_path / "out")]
    ok = subprocess.run([*args, "--model_args", f"pretrained={tiny},preset=max"], cwd=FIXTURES,
                        env=_env(tmp_path), capture_output=True, text=True, timeout=300,
                        check=False)
    assert ok.returncode == 0, ok.stderr[-2000:]
    (found,) = (tmp_path / "out").rglob("results_*.json")
    res = json.loads(found.read_text())["results"]
    assert set(res) == set(TASKS) and 0 <= res["reap_tiny_mc"]["acc,none"] <= 1
    bad = subprocess.run([*args, "--model_args", f"pretrained={tiny},budjet=1GB"], cwd=FIXTURES,
                         env=_env(tmp_path), capture_output=True, text=True, timeout=300,
                         check=False)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1] == (
        "reap: error: model_args budjet: not an argument of model reap")


def _eval(tiny, out, *extra, capsys):
    code = main(["eval", tiny, "--reference", tiny, "--tasks", ",".join(TASKS), "--task-path",
                 str(FIXTURES), "--task-limit", "4", "--gen-tokens", "0", "--out", str(out),
                 "--preset", "max", "--bootstrap", "20", "--quiet", "--no-plots", *extra])
    return code, capsys.readouterr()


def test_reap_eval_tasks_puts_scores_with_intervals_in_the_report(tiny, tmp_path, capsys):
    code, _ = _eval(tiny, tmp_path, capsys=capsys)
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    hf = _evaluate("hf", f"pretrained={tiny},dtype=float32", limit=4)["results"]
    bench = results["benchmarks"]
    assert list(bench) == TASKS and results["columns"] == ["m", "m#2"]
    for col in results["columns"]:
        acc = bench["reap_tiny_mc"][col]["acc"]
        se = hf["reap_tiny_mc"]["acc_stderr,none"]
        assert bench["reap_tiny_mc"][col]["samples"] == 4
        assert acc["value"] == hf["reap_tiny_mc"]["acc,none"]
        assert acc["lo"] == pytest.approx(acc["value"] - 1.959964 * se)
        assert acc["hi"] == pytest.approx(acc["value"] + 1.959964 * se)
        assert bench["reap_tiny_gen"][col]["exact_match"]["value"] == 0.0
    report = (tmp_path / "report.md").read_text()
    assert "## Benchmarks (lm-eval)" in report
    v = bench["reap_tiny_mc"]["m"]["acc"]
    row = f"| reap_tiny_mc: acc | {v['value']:.4f} [{v['lo']:.4f}, {v['hi']:.4f}] |"
    assert row in report and "Benchmarks (lm-eval)</h2>" in (tmp_path / "report.html").read_text()
    code, out = _eval(tiny, tmp_path, capsys=capsys)
    assert code == 0 and "(2 cached, 0 computed results)" in out.out


@pytest.mark.parametrize("extra, message", [
    (["--tasks", "no_such_task"], ("unknown lm-eval task 'no_such_task' (`lm-eval ls tasks`; "
                                   "or give --task-path DIR with its YAML)")),
    (["--task-path", "/nonexistent"], "--task-path /nonexistent: not a directory"),
    (["--task-limit", "0"], "--task-limit must be positive, got 0"),
])
def test_reap_eval_task_errors_are_one_line(tiny, tmp_path, capsys, extra, message):
    code, io = _eval(tiny, tmp_path, *extra, capsys=capsys)
    assert code == 2 and io.err.strip() == f"reap: error: {message}"


def _module_level_imports(tree) -> list[str]:
    """Imports run when the module loads (also inside a module-level try or if)."""
    out, todo = [], list(tree.body)
    while todo:
        n = todo.pop()
        if isinstance(n, ast.Import | ast.ImportFrom):
            out += [n.module or ""] if isinstance(n, ast.ImportFrom) else [a.name for a in n.names]
        elif isinstance(n, ast.Try | ast.If):
            todo += n.body + n.orelse + [x for h in getattr(n, "handlers", []) for x in h.body]
    return out


def test_without_lm_eval_the_library_imports_and_tasks_fail_in_one_line(tiny, tmp_path, capsys,
                                                                         monkeypatch):
    for name in [n for n in sys.modules if n.split(".")[0] == "lm_eval"] + ["lm_eval"]:
        monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError
    monkeypatch.delitem(sys.modules, "reap.eval.harness", raising=False)
    code, io = _eval(tiny, tmp_path, capsys=capsys)
    assert code == 2 and io.err.strip().startswith(
        "reap: error: lm-eval is not installed: pip install 'reap[bench]'")
    assert len(io.err.strip().splitlines()) == 1
    loads = [p.relative_to(REPO) for p in sorted((REPO / "reap").rglob("*.py"))
             if any(m.split(".")[0] == "lm_eval"
                    for m in _module_level_imports(ast.parse(p.read_text())))]
    assert loads == [Path("reap/eval/harness.py")]  # the only module importing it on load
