"""Calibration on Ray (reap.distributed) against the single-process run: token-sharded and
layer-parallel statistics equal `reap.calibrate.pipeline.calibrate` (counts exactly, float64 sums
to rounding, float32 maxima to kernel rounding) on a k3-tiny and a transformers-saved Qwen3-MoE;
a worker SIGKILLed mid-shard is retried and resumes; an interrupted driver reruns only the
unfinished shards; every worker's measured peak RSS stays within --budget. One local Ray cluster
(2 CPUs, 127.0.0.1) for the whole module."""

import os
import signal
import sys

import family_runner as R
import pytest
import torch

from reap.stats import ExpertStats

ray = pytest.importorskip("ray")

T_LEN, N_TOK, BUDGET = 32, 320, 1_500_000_000  # 10 sequences of 32 tokens
QWEN = {
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
    "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "mlp_only_layers": [1],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}  # fmt: skip
# I/O counters: every token shard reads the whole checkpoint, a layer stage only its layers
IO = {"bytes_read", "read_ratio", "expert_reads", "expert_reads_max", "passes", "merged_from"}


@pytest.fixture(scope="module")
def cluster():
    """A local 2-CPU Ray cluster whose workers import this checkout (and tests/)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join([repo, os.path.join(repo, "tests")])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{name: (checkpoint, corpus spec, single-process result)} for k3-tiny and Qwen3-MoE."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from reap.synth import synth

    root = tmp_path_factory.mktemp("dist")
    spec = R.write_corpora(root / "corpora")
    k3 = str(synth("k3-tiny", root / "k3", seed=3, dtype="float32"))
    qwen, _ = R.save_hf_tiny(Qwen3MoeForCausalLM, Qwen3MoeConfig, QWEN, root / "qwen", seed=1)
    return {name: (path, spec, _single(path, spec, root / f"{name}-single"), root)
            for name, path in (("k3", k3), ("qwen", qwen))}


def _args(path, spec) -> dict:
    return {"model": path, "corpus": spec, "tokens": N_TOK, "seq_len": T_LEN, "batch": 3,
            "budget": BUDGET}


def _single(path, spec, out):
    from reap.calibrate.pipeline import calibrate

    return calibrate(out=str(out), progress=False, **_args(path, spec))


def _distributed(models, name, out, **kw):
    from reap.distributed.calibrate import calibrate_ray

    path, spec, _, root = models[name]
    return calibrate_ray(out=str(root / out), progress=False, **_args(path, spec), **kw)


# Per-token float32 values (routing weights, norms) are bit-identical across batch shapes for
# k3-tiny, so its float64 sums agree to float64 rounding; Qwen's float32 router and expert
# matmuls round differently for another number of tokens, so its sums agree to float32 rounding.
SUM_RTOL = {"k3": 1e-12, "qwen": 1e-6}


def _assert_same(got, want, rtol: float = 1e-12) -> None:
    """Every statistics file of a distributed run equals the single-process one: counts exactly,
    float64 sums to `rtol` (of the field's largest value)."""
    assert set(got.files) == set(want.files)
    for name, path in want.files.items():
        a, b = ExpertStats.load(path), ExpertStats.load(got.files[name])
        assert os.path.basename(got.files[name]) == os.path.basename(path)
        assert (b.layers, b.n_experts, b.top_k, b.tokens) == (a.layers, a.n_experts, a.top_k,
                                                              a.tokens)
        assert {k: v for k, v in b.meta.items() if k not in IO} == \
            {k: v for k, v in a.meta.items() if k not in IO}
        for field, x in a.tensors().items():
            y = getattr(b, field)
            if x.dtype == torch.float64:  # sums in another order
                atol = rtol * float(x.abs().max().clamp(min=1))
                torch.testing.assert_close(y, x, rtol=rtol, atol=atol, msg=field)
            elif x.is_floating_point():  # per-token maxima from differently batched kernels
                torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6, msg=field)
            else:
                assert torch.equal(y, x), field


def _within_budget(res) -> None:
    assert res.worker_peak_rss and all(0 < p <= BUDGET for p in res.worker_peak_rss.values()), \
        res.worker_peak_rss


@pytest.mark.parametrize("name", ["k3", "qwen"])
@pytest.mark.parametrize("mode", ["tokens", "layers"])
def test_distributed_statistics_equal_the_single_process_run(cluster, models, name, mode,
                                                             tmp_path):
    # k3 layer-parallel: the second stage's process is SIGKILLed after its first shard; Ray
    # restarts the actor and retries the call (token mode: test_a_killed_worker_...)
    stage = 3 if name == "k3" and mode == "layers" else -1
    hook = _kill_once(str(tmp_path / "killed"), shard=1, layer=stage)
    res = _distributed(models, name, f"{name}-{mode}", workers=2, mode=mode, shards=3,
                       hook=hook)
    assert (tmp_path / "killed").exists() == (stage > 0)
    assert res.shards_run == [1, 2, 3] and not os.path.exists(os.path.join(res.out, ".work"))
    _assert_same(res, models[name][2], SUM_RTOL[name])
    _within_budget(res)
    if mode == "layers":  # two stages, each reading only its layers: the checkpoint once
        assert len(res.worker_peak_rss) == 2
        assert res.bytes_read <= models[name][2].bytes_read


def _kill_once(marker: str, shard: int = 2, layer: int = 2):
    """Worker hook: SIGKILL the worker process once when it reaches (shard, layer): after that
    committed layer (token mode) or that stage's work on the shard (layer mode); the marker file
    records the killed pid."""
    def hook(k: int, at: int) -> None:
        if (k, at) == (shard, layer) and not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
    return hook


def test_a_killed_worker_is_retried_and_resumes_its_shard(cluster, models, tmp_path):
    import json

    marker = str(tmp_path / "killed")
    saved = []

    def on_done(k):
        path = os.path.join(res_dir, ".work", "shards", str(k), "shard.json")
        with open(path) as f:
            saved.append(json.load(f))

    res_dir = str(models["k3"][3] / "k3-killed")
    res = _distributed(models, "k3", "k3-killed", workers=2, shards=2, hook=_kill_once(marker),
                       on_done=on_done)
    with open(marker) as f:
        killed = int(f.read())
    shard2 = next(r for r in saved if r["shard"] == 2)
    assert shard2["pid"] != killed and shard2["resumed_after"] == 2  # retried, then resumed
    _assert_same(res, models["k3"][2])
    _within_budget(res)


def test_an_interrupted_driver_resumes_without_redoing_finished_shards(cluster, models):
    def stop(k):
        if k == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _distributed(models, "k3", "k3-resume", workers=1, shards=3, on_done=stop)
    work = models["k3"][3] / "k3-resume" / ".work"
    assert (work / "shards" / "1" / "shard.json").exists()
    assert not (work / "shards" / "2").exists()
    from reap.errors import ReapError

    with pytest.raises(ReapError, match="different arguments"):  # not this job's work
        _distributed(models, "k3", "k3-resume", workers=1, shards=3, seed=1)
    res = _distributed(models, "k3", "k3-resume", workers=1, shards=3)
    assert res.shards_run == [2, 3]
    _assert_same(res, models["k3"][2])


def test_cli_ray_writes_the_single_process_files_and_fails_in_one_line(cluster, models, capsys,
                                                                       monkeypatch):
    from reap.calibrate.runner import CalibrateResult
    from reap.cli import main

    path, spec, single, root = models["k3"]
    argv = ["calibrate", path, "--corpus", spec, "--tokens", str(N_TOK), "--seq-len",
            str(T_LEN), "--batch", "3", "--no-progress", "--budget", str(BUDGET)]
    assert main(argv + ["--out", str(root / "k3-cli"), "--ray", "--workers", "2"]) == 0
    printed = dict(line.split("\t") for line in capsys.readouterr().out.splitlines())
    _assert_same(CalibrateResult(str(root / "k3-cli"), printed, None, 0, [], 0, 0, 0, 0, None,
                                 0.0, 0), single)
    # a worker's bad input (budget below the worker's own baseline) is one line, exit 2
    assert main([*argv[:-1], "1MB", "--out", str(root / "k3-cli-small"), "--ray"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("reap: error:") and "\n" not in err and "too small" in err, err
    # --ray makes the shards itself: --shard with it is bad input
    assert main(argv + ["--out", str(root / "k3-cli-2"), "--ray", "--shard", "1/2"]) == 2
    assert "--shard and --ray" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ray", None)  # as if ray were not installed
    assert main(argv + ["--out", str(root / "k3-cli-3"), "--ray"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("reap: error:") and "\n" not in err and "[distributed]" in err, err


def test_eval_on_ray_gives_the_local_results_and_cache(cluster, models, tmp_path):
    """`reap eval --ray`: every (build x domain) task on the cluster; the same results.json
    numbers and the same cache files as the local run, and a rerun is served from that cache."""
    import json

    from reap.distributed.eval import ray_runner
    from reap.eval import evaluate
    from reap.prune.plan import make_plan
    from reap.prune.write import prune

    tiny = models["k3"][0]
    with open(os.path.join(tiny, "config.json")) as f:
        cfg = json.load(f)
    pruned = str(tmp_path / "pruned")
    prune(model=tiny, plan=make_plan(config=cfg, criterion="random", keep=8, seed=1), out=pruned)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "domain": d, "prompt": p}) + "\n"
                               for i, (d, p) in enumerate([("en", "Once upon"), ("code", "def f(")])))
    args = {"builds": [tiny, f"small={pruned}"], "reference": tiny, "corpora": ["en", "zh"],
            "max_docs": 2, "max_tokens_per_doc": 16, "prompts": str(prompts), "gen_tokens": 4,
            "bootstrap": 20, "progress": False, "preset": "max", "plots": False}
    local = evaluate(out=str(tmp_path / "local"), **args)
    dist = evaluate(out=str(tmp_path / "ray"), run_tasks=ray_runner(None, 2), **args)
    for key in ("quality", "generations", "generation_summary", "columns", "corpora", "prompts",
                "expert_failures"):
        assert dist[key] == local[key], key
    assert dist["quality"]["zh"] and dist["generations"]["code"]
    assert dist["cache"]["misses"] == local["cache"]["misses"] == 7  # 2 x 2 quality, 3 gens
    files = sorted(p.name for p in (tmp_path / "local" / "cache").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "ray" / "cache").iterdir())
    for name in files:
        a = json.loads((tmp_path / "local" / "cache" / name).read_text())
        b = json.loads((tmp_path / "ray" / "cache" / name).read_text())
        assert a == b, name
    from reap.cli import main  # the command line, rerun: every result from the cache

    assert main(["eval", tiny, f"small={pruned}", "--reference", tiny, "--corpus", "en,zh",
                 "--max-docs", "2", "--max-tokens-per-doc", "16", "--prompts", str(prompts),
                 "--gen-tokens", "4", "--bootstrap", "20", "--preset", "max", "--quiet",
                 "--no-plots", "--out", str(tmp_path / "ray"), "--ray", "--workers", "2"]) == 0
    again = json.loads((tmp_path / "ray" / "results.json").read_text())
    assert again["cache"]["hits"] == 7 and again["quality"] == local["quality"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: run the check itself")
def test_gpu_check_without_cuda_says_so_and_exits_cleanly(capsys):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from experiments.gpu_check import main

    assert main(["--device", "cuda", "--out", "/nonexistent/never-written.json"]) == 0
    assert "no CUDA device" in capsys.readouterr().out
