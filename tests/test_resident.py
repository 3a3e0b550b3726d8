"""`--resident-from`: the experts calibration statistics route most tokens to are pinned in the
expert cache. The tokens never change; the pinned set is the statistics' top by routed count
within the cache's slots; on the corpus the statistics came from it hits more often than LRU;
statistics of another model are refused. And the family's compiled-decode hooks are checked when
the engine opens (a wrong return type is a one-line error, not an AttributeError in decode)."""

import json
import random
import subprocess
import sys

import pytest

from reap.engine import Engine, core, memory
from reap.errors import ReapError
from reap.stats import ExpertStats

T_LEN, N_TOK = 32, 320
SLOTS = 24  # of 5 MoE layers x 16 experts: a cache far smaller than the model's experts


def _corpus(path) -> str:
    rng = random.Random(1)
    with open(path, "w") as f:
        for i in range(40):
            text = "\n".join(f"def f{rng.randrange(99)}(x):\n    return x * {rng.randrange(9)}"
                             for _ in range(rng.randrange(2, 5)))  # fmt: skip
            f.write(json.dumps({"id": f"code-{i}", "text": text}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A float32 k3-tiny, statistics of a code corpus on it, and that corpus's token ids."""
    from reap.calibrate.pipeline import calibrate
    from reap.corpora import calibration_sequences
    from reap.synth import synth
    from reap.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("resident")
    model = synth("k3-tiny", root / "model", seed=5, dtype="float32")
    spec = _corpus(root / "code.jsonl")
    calibrate(model=model, corpus=spec, tokens=N_TOK, seq_len=T_LEN, out=str(root / "stats"),
              progress=False)  # fmt: skip
    seqs = calibration_sequences(spec, load_tokenizer(model), N_TOK, T_LEN, 0)
    return {"root": root, "model": model, "stats": str(root / "stats"), "seqs": [s.ids for s in seqs]}


def _open(env, **kw) -> Engine:
    """The engine with the trunk pinned and SLOTS routed experts cached."""
    with Engine.open(env["model"], preset="ultra", baseline=0, available=1 << 40) as probe:
        mb = probe.plan_bytes
    budget = memory.preset_budget(mb, "workstation", 256, 1, 16) - int(0.05 * mb.experts_total)
    budget += SLOTS * max(mb.expert_bytes)
    eng = Engine.open(env["model"], budget=budget, baseline=0, available=1 << 40, context=256,
                      prefill_chunk=16, **kw)  # fmt: skip
    assert eng.experts.n_slots == SLOTS and not eng.plan.streamed
    return eng


def _decode_hits(eng: Engine, seqs) -> tuple[int, int]:
    """(hits, misses) of one-token steps over the corpus's tokens (teacher-forced decode)."""
    h0, m0 = eng.experts.hits, eng.experts.misses
    for ids in seqs:
        s = eng.new_sequence()
        for t in ids:
            eng.step([s], [[t]])
    return eng.experts.hits - h0, eng.experts.misses - m0


def test_resident_experts_do_not_change_the_tokens(env):
    prompt = env["seqs"][0][:12]
    with _open(env) as plain, _open(env, resident_from=env["stats"]) as pinned:
        assert pinned.experts.pinned  # something is pinned
        a = plain.generate([prompt], max_tokens=12)[0].ids
        b = pinned.generate([prompt], max_tokens=12)[0].ids
    assert a == b


def test_pinned_set_is_the_statistics_top_by_count(env):
    import glob

    stats = ExpertStats.load(glob.glob(env["stats"] + "/*.safetensors")[0])
    rows = [(-int(stats.count[i, e]), layer, e)
            for i, layer in enumerate(stats.layers) for e in range(stats.n_experts)
            if stats.count[i, e] > 0]  # fmt: skip
    room = min(int(core.RESIDENT_SHARE * SLOTS), SLOTS - stats.top_k)  # the rest: LFU's
    want = {(layer, e) for _, layer, e in sorted(rows)[:room]}
    with _open(env, resident_from=env["stats"]) as eng:
        assert set(eng.experts.pinned) == want
        assert want <= set(eng.experts.tensors)  # read at open


def test_resident_from_hits_more_than_lru_on_its_corpus(env):
    seqs = [s[:24] for s in env["seqs"][:3]]
    with _open(env) as lru:
        lru.experts.half_life = 1  # each use outweighs all earlier ones: least recently used
        h_lru, m_lru = _decode_hits(lru, seqs)
    with _open(env, resident_from=env["stats"]) as pinned:
        h_pin, m_pin = _decode_hits(pinned, seqs)
    assert h_lru + m_lru == h_pin + m_pin > 0
    assert h_pin > h_lru, (h_pin, h_lru)


def test_statistics_of_another_model_are_refused(env, tmp_path):
    other = ExpertStats.zeros([1, 2, 3, 4, 5], 32, 4)
    bad = other.save(tmp_path / "other.safetensors")
    with pytest.raises(ReapError, match="statistics of another model") as e:
        _open(env, resident_from=bad)
    assert e.value.exit_code == 2
    p = subprocess.run(
        [sys.executable, "-m", "reap.cli", "run", env["model"], "--prompt-ids", "1,2",
         "--max-tokens", "1", "--resident-from", bad], capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert p.returncode == 2
    assert p.stderr.strip().startswith("reap: error:") and "another model" in p.stderr
    assert "Traceback" not in p.stderr


def test_a_wrong_compiled_decode_hook_is_refused_at_open(env, monkeypatch):
    from reap.models.kimi_k3.family import Model

    monkeypatch.setattr(Model, "native_layer", lambda self, i: {"not": "a NativeLayer"})
    with pytest.raises(ReapError, match="native_layer") as e:
        Engine.open(env["model"], preset="ultra", baseline=0, available=1 << 40)
    assert e.value.exit_code == 1 and "\n" not in str(e.value)


def test_a_cgroups_reclaimable_page_cache_counts_as_available(tmp_path, monkeypatch):
    """A second run in the same capped cgroup is not refused for the page cache the first left
    charged to it (the bench's warm runs were: 'memory plan needs ... only ... allowed')."""
    from reap import memstat

    (tmp_path / "memory.limit_in_bytes").write_text(str(1 << 30))
    (tmp_path / "memory.usage_in_bytes").write_text(str(900 << 20))
    (tmp_path / "memory.stat").write_text(f"cache 1\ntotal_inactive_file {800 << 20}\n")
    files = [(str(tmp_path / "memory.limit_in_bytes"), str(tmp_path / "memory.usage_in_bytes"))]
    monkeypatch.setattr(memstat, "_cgroup_files", lambda: files)
    assert memstat._cgroup_headroom() == (1 << 30) - (900 << 20) + (800 << 20)
