"""The capped-memory bench's arithmetic and report (experiments/bench_streaming.py,
streaming_report.py) and bench_llamacpp's invalid-cell rule, on made-up runs: a cell whose machine
load exceeded its threads is marked invalid and left out of every summary."""

from experiments import bench_streaming as bs
from experiments import llamacpp_report as lr
from experiments import streaming_report as sr


def _run(decode, cpu, ids=(1, 2, 3), **kw):
    return {"prefill": 10.0, "decode": decode, "decode_read_per_token": 4e8, "rss": 1e9,
            "machine_cpu": cpu, "cgroup_peak": 2e9, "ids": list(ids), "reap_read_per_token": 2e8,
            "hit_rate": 0.5, **kw}  # fmt: skip


def _rep(reap_cpu, llama_cpu):
    return {"reap": {"cold": _run(4.0, reap_cpu), "warm": _run(5.0, 1.0)},
            "llama.cpp": {"cold": _run(1.0, llama_cpu), "warm": _run(1.0, 1.0, ids=(1, 2, 9))},
            "direct_gbps": 2.0}  # fmt: skip


def test_cells_with_contention_are_invalid_and_left_out_of_the_summary():
    rows = bs.summarize([_rep(1.1, 1.2), _rep(1.0, 2.5), _rep(1.0, 1.0)], threads=1)
    cold, warm = rows
    assert not cold["valid"] and warm["valid"]  # one cold llama.cpp run had 2.5 cores busy
    assert warm["decode_ratio"] == 5.0 and warm["agree_first"] == 2
    assert warm["floor_s"] == 2e8 / 2e9 and abs(warm["floor_ratio"] - 2.0) < 1e-9
    res = {"models": {"m": {"params": "p", "caps": [
        {**r, "dtype": "bfloat16", "cap_fraction": 0.5, "cap": 1e9, "ckpt_bytes": 2e9}
        for r in rows]}}}  # fmt: skip
    text = "\n".join(sr.summary(res))
    assert "| warm |" in text and "| cold |" not in text and "1 of 2 cells invalid" in text
    assert "**invalid**" in "\n".join(sr.caps_table(res["models"]["m"]["caps"]))
    pol = {"decode": 2.0, "hit_rate": 0.7, "reap_read_per_token": 1e8, "open_s": 1.0, "ids": [1]}
    res["models"]["m"]["resident"] = {"dtype": "bfloat16", "stats": "s", "rows": [
        {"corpus": "code", "stats_from": True, "cap_fraction": 0.5, "valid": True,
         "same_tokens": True, **{p: pol for p in ("resident-from", "lfu", "lru", "none")}}]}
    meta = {"draft": True, "command": "c", "minutes": 1.0, "code_version": "v", "cpu": "x",
            "cores": 2, "cgroup": "v1", "threads": 1, "reps": 1, "decode": 8, "load_slack": 0.3,
            "budget_fraction": 0.9, "reap_reads": "O_DIRECT",
            "probes": [{"load": 1.0, "psi_some_avg10": 5.0}] * 2}  # fmt: skip
    md = sr.report({**meta, **res})
    assert "DRAFT" in md and "| code | yes | 50% |" in md and "several threads" in md


def test_bench_llamacpp_summary_leaves_out_loaded_cells():
    def row(load, ratio):
        return {"dtype": "float32", "threads": 1, "prompt": 32, "hit": 1.0,
                "runs": [{"load": ["0.9", load]}], "prefill": {"ratio": ratio},
                "decode": {"ratio": ratio}}  # fmt: skip

    res = {"models": {"1b": {"speed": [row("1.1", 1.5), row("3.0", 20.0)]}}}
    text = "\n".join(lr.summary(res))
    assert "1.50" in text and "20.00" not in text and "1 of 2" in text
