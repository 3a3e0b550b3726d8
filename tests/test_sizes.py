"""Size model: the published Kimi K3 figures from the config alone, and byte predictions that
match what is written."""

import json
import subprocess
import sys

import pytest

from reap.errors import ReapError
from reap.sizes import SizeModel, info, parse_size


@pytest.fixture(scope="module")
def k3_full():
    return info("k3-full")


def rel(a, b):
    return abs(a - b) / b


def test_k3_full_reproduces_published_figures(k3_full):
    """../shared/k3.md starred figures, within 0.5 %."""
    assert rel(k3_full["total_params"], 2780.0e9) < 0.005
    assert rel(k3_full["routed_params"], 2722.7e9) < 0.005
    assert k3_full["bytes_per_routed_expert"] == 17_547_264
    assert k3_full["params_per_routed_expert"] == 33_030_144
    assert rel(k3_full["routed_bytes"], 1.447e12) < 0.005
    assert rel(k3_full["checkpoint_bytes"], 1.56e12) < 0.005
    assert rel(k3_full["active_params"], 104e9) < 0.01
    assert k3_full["tensors"] == 497_220
    comps = k3_full["components"]
    assert rel(comps["shared_experts"]["params"], 12.2e9) < 0.005
    assert rel(comps["latent_proj"]["params"], 4.7e9) < 0.01
    assert rel(comps["embed_head"]["params"], 2.35e9) < 0.005


def test_target_size_350gb_keeps_about_146_experts():
    from reap.models import builtin_config

    m = SizeModel.from_config(builtin_config("k3-full"))
    keep = m.max_uniform_keep(parse_size("350GB"))
    assert 140 <= keep <= 150
    assert m.predict_bytes(keep) <= 350e9 < m.predict_bytes(keep + 1)


def test_predict_bytes_is_linear_in_kept_experts():
    from reap.models import builtin_config

    m = SizeModel.from_config(builtin_config("k3-tiny"))
    full, none = m.predict_bytes(), m.predict_bytes(0)
    per_layer = sum(m.expert_bytes.values()) + sum(m.header_bytes_expert.values())
    assert full - none == per_layer * m.n_experts


def test_parse_size_units():
    assert parse_size("350GB") == 350 * 10**9
    assert parse_size("8GiB") == 8 * 2**30
    assert parse_size("1.5 TB") == 1.5e12
    with pytest.raises(ReapError):
        parse_size("lots")


def test_info_cli_json_and_bad_config():
    out = subprocess.run([sys.executable, "-m", "reap.cli", "info", "k3-tiny", "--json"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["n_experts"] > 0
    bad = subprocess.run([sys.executable, "-m", "reap.cli", "info", "k3-nope"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_predicted_bytes_match_a_written_checkpoint(tmp_path):
    """Tensor data exactly, headers estimated: the whole file set within 0.1 %."""
    from reap.synth import synth

    out = tmp_path / "tiny"
    synth(config="k3-tiny", out=str(out), seed=0)
    got = info(str(out))
    assert got["tensors_on_disk"] == got["tensors"]
    assert abs(got["checkpoint_bytes"] - got["bytes_on_disk"]) <= 0.001 * got["bytes_on_disk"]
