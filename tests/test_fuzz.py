"""Fast subset of the input fuzz harness (experiments/fuzz_inputs.py): corrupt inputs must give a
documented exit code with a one-line message, never an internal error, a hang, unbounded memory,
or exit 0 (each input here is invalid by construction, except the unchanged control).

All runs go through the public CLI in one batch driver process (reap imported once), with a hard
per-run timeout and a 4 GB address-space cap, so the whole file takes well under a minute. A case
that still fails on main is marked xfail(strict=True) with its finding: when it is fixed the mark
makes the test fail, and the mark is removed.
"""

import pytest

from experiments import fuzz_inputs

TIMEOUT_S = 20.0  # per run; a valid run takes well under 2 s here
# runs that hung before their fix keep a short limit, so that a regression costs seconds
HANG_TIMEOUT_S = {"index/fifo_shard/info": 8.0}

# (case/command) -> None when it holds on main, else the finding (the xfail reason). The keys
# are those of experiments/fuzz_inputs.py; the findings come from its report (reports/reliability.md).
CASES: dict[str, str | None] = {
    "control/unchanged/info": None,
    "control/unchanged/run": None,
    "control/unchanged/calibrate": None,
    "control/unchanged/prune": None,
    "control/unchanged/verify": None,
    "header/len_minus1/info": None,
    "header/len_minus1/run": None,
    "header/len_minus1/calibrate": None,
    "header/len_minus1/prune": None,
    "header/len_minus1/verify": None,
    "header/len_plus1/run": None,
    "header/truncated_1_byte/verify": None,
    "header/bad_json/info": None,
    "header/deeply_nested/info": None,
    "header/deeply_nested/run": None,
    "header/float_offsets_integral/run": None,
    "header/bool_offset/run": None,
    "header/bool_offset/verify": None,
    "header/bool_shape/calibrate": None,
    "header/negative_shape_same_numel/run": None,
    "header/overlapping_entries/verify": None,
    "header/gap_in_middle/run": None,
    "header/gap_at_end/verify": None,
    "header/dtype_unknown/run": None,
    "header/dtype_relabel_same_size/calibrate": None,
    "header/dtype_relabel_same_size/prune": None,
    "header/metadata_not_strings/run": None,
    "header/random_flip_0/info": None,
    "header/random_flip_1/calibrate": None,
    "index/missing_shard/verify": None,
    "index/wrong_shard/run": None,
    "index/wrong_shard/verify": None,
    "index/dotdot_path/run": None,
    "index/dotdot_path/verify": None,
    "index/absolute_path/verify": None,
    "index/swapped_shards/run": None,
    "index/swapped_shards/verify": None,
    "index/weight_map_value_int/info": None,
    "index/fifo_shard/info": None,
    "config/num_experts_per_token=missing/run": None,
    "config/num_experts_per_token=0/run": None,
    "config/num_experts_per_token=str_4/run": None,
    "config/num_experts=str_16/info": None,
    "config/num_hidden_layers=inf/info": None,
    "config/rms_norm_eps=nan/run": None,
    "config/rms_norm_eps=-1e-05/calibrate": None,
    "config/routed_scaling_factor=1e+308/run": None,
    "config/moe_layer_freq=0/info": None,
    "config/not_json/info": None,
    "config/deeply_nested/verify": None,
    "weights/nan_norm/run": None,
    "weights/nan_norm/calibrate": None,
    "weights/inf_router/run": None,
    "weights/e8m0_ff_expert_scale/run": None,
    "weights/e8m0_ff_expert_scale/calibrate": None,
    "weights/nan_final_norm/verify": None,
    "plan/keep_zero_one_layer/prune": None,
    "plan/keep_zero_all_layers/prune": None,
    "plan/top_k_changed/prune": None,
    "plan/float_ids/prune": None,
    "plan/bool_ids/prune": None,
    "plan/deeply_nested/prune": None,
    "plan/duplicate_ids/prune": None,
    "stats/meta_deeply_nested/plan": None,
    "stats/nan_reap_sum/plan": None,
    "stats/inf_max_act/plan": None,
    "stats/shape_mismatch/plan": None,
    "stats/top_k_changed/plan": None,
    "args/run_temperature_nan/run": None,
    "args/run_seed_2e70/run": None,
    "args/calibrate_budget_1KB/calibrate": None,
    "args/calibrate_out_is_file/calibrate": None,
    "args/calibrate_out_proc/calibrate": None,
    "args/plan_target_size_inf/plan": None,
    "args/plan_seed_2e70/plan": None,
    "args/prune_max_shard_negative/prune": None,
    "args/prune_out_is_file/prune": None,
    "args/prune_out_is_source_overwrite/prune": None,
    "args/prune_out_is_parent_of_source_overwrite/prune": None,
    "args/prune_out_inside_source/prune": None,
}


def _xfail(key: str, finding: str | None):
    if finding is None:
        return key
    return pytest.param(key, marks=pytest.mark.xfail(strict=True, reason=f"issue 18: {finding}"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    work = tmp_path_factory.mktemp("fuzz")
    _, records = fuzz_inputs.execute(fuzz_inputs.all_cases(seed=0, n_flips=3), work, seed=0,
                                     timeout=TIMEOUT_S, keys=set(CASES),
                                     timeouts=HANG_TIMEOUT_S)
    return {r["key"]: r for r in records}


@pytest.mark.parametrize("key", [_xfail(k, v) for k, v in CASES.items()])
def test_bad_input_is_refused_cleanly(results, key):
    rec = results[key]
    assert rec["verdict"] == "clean", f"{key}: {rec['verdict']} (exit {rec['rc']}): {rec['line']} {rec['note']}"
