"""Streaming engine: memory plan, reads, ring, expert cache, MXFP4 fast decode, generation and
`reap run` exit codes, each against an independent reference (the in-memory model forward, a
brute-force LFU, `reap.quant.mxfp4`'s decoders, a naive sampler), on a k3-tiny from `reap synth`."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from references import mxfp4_dequantize_reference

from reap.checkpoint import BufferReader, Checkpoint
from reap.cli import main
from reap.engine import Engine, memory
from reap.engine.experts import ExpertCache
from reap.engine.generate import StopMatcher, generate, sample
from reap.engine.store import TrunkStore
from reap.errors import ReapError
from reap.memstat import available_memory
from reap.models import family
from reap.models.base import dict_weights
from reap.quant import dense_kernel
from reap.quant.mxfp4_decode import decode_mxfp4
from reap.units import parse_bytes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from reap.synth import synth

    return synth("k3-tiny", tmp_path_factory.mktemp("engine") / "tiny", seed=3, dtype="float32")


@pytest.fixture(scope="module")
def ref(tiny):
    """The in-memory reference: every tensor in a dict, the family's own forward."""
    ck = Checkpoint.open(tiny)
    weights = {n: ck.read(n) for n in ck.tensors}
    fam = family(ck.config)
    return fam.Model(fam.Config.from_dict(ck.config)), dict_weights(weights)


def ref_greedy(ref, prompt: list[int], n: int) -> list[int]:
    model, get = ref
    caches = model.new_caches()
    with torch.inference_mode():
        logits = model.forward(get, torch.tensor([prompt]), caches)[0, -1]
        out = []
        for _ in range(n):
            out.append(int(torch.argmax(logits)))
            logits = model.forward(get, torch.tensor([[out[-1]]]), caches)[0, -1]
    return out


# -- memory plan -------------------------------------------------------------------------------
def _mb(units=(100, 80, 80, 80, 50), experts=1000) -> memory.ModelBytes:
    n = len(units)
    return memory.ModelBytes(
        [f"u{i}" for i in range(n)],
        list(units),
        [0] + [10] * (n - 2) + [0],
        [0] + [experts // 10] * (n - 2) + [0],
        2,
        0,
        8,
        10,
        20,
        3,
        7,
        5,
        1,
    )


def test_plan_gives_the_trunk_priority_then_the_expert_cache():
    mb = _mb()
    state, scratch = memory.fixed_costs(mb, 16, 1, 4)
    assert state == 7 + 16 * 3 and scratch == memory.OVERHEAD + 10 + 40 + 4 * 5 + 4 * 16 * 1
    low = memory.minimum_budget(mb, 16, 1, 4)
    assert low == state + scratch + 2 * 100
    last = None
    for extra in range(0, 900, 7):
        plan = memory.plan_memory(mb, low + extra, 16, 1, 4)
        assert plan.total <= low + extra
        if plan.expert_cache > 0 and len(plan.pinned) < len(mb.units):
            # cache only gets what cannot pin another unit (or the ring for the rest)
            assert plan.expert_cache < max(mb.units[i] for i in plan.streamed) + plan.ring_bytes
        if last is not None:
            assert plan.pinned_bytes + plan.expert_cache >= last
        last = plan.pinned_bytes + plan.expert_cache
    full = memory.plan_memory(mb, 10**9, 16, 1, 4)
    assert len(full.pinned) == 5 and full.ring_slots == 0 and full.expert_cache == 3 * 100 * 10
    with pytest.raises(ReapError, match="short by"):
        memory.plan_memory(mb, low - 1, 16, 1, 4)


def test_presets_are_ordered_and_scaled_to_the_model():
    mb = _mb()
    budgets = [memory.preset_budget(mb, p, 16, 1, 4) for p in memory.PRESETS]
    assert budgets == sorted(budgets)
    assert budgets[0] == memory.minimum_budget(mb, 16, 1, 4)
    top = memory.plan_memory(mb, budgets[-1], 16, 1, 4)
    assert len(top.pinned) == 5 and top.expert_cache == mb.experts_total
    with pytest.raises(ReapError, match="unknown preset"):
        memory.preset_budget(mb, "huge", 16)


def test_the_embedding_table_is_pinned_last_and_only_whole():
    mb = dataclasses.replace(_mb(), embed_table=40)
    top = memory.preset_budget(mb, "max", 16, 1, 4)
    assert top == memory.preset_budget(_mb(), "max", 16, 1, 4) + 40
    plan = memory.plan_memory(mb, top, 16, 1, 4)
    assert plan.embed_table == 40 and plan.expert_cache == mb.experts_total
    assert plan.total == top and "embedding table" in plan.describe()
    short = memory.plan_memory(mb, top - 1, 16, 1, 4)  # all experts, not the whole table
    assert short.embed_table == 0 and short.expert_cache == mb.experts_total
    assert "read by rows" in short.describe()
    below = memory.plan_memory(mb, top - 60, 16, 1, 4)  # room for the table, not every expert
    assert below.embed_table == 0 and below.expert_cache == mb.experts_total - 20


def test_refusal_names_the_shortfall_and_parse_bytes():
    plan = memory.plan_memory(_mb(), 10**9, 16, 1, 4, baseline=100)
    need = plan.total - plan.baseline
    memory.check_available(plan, available=-(-need * 100 // 95))  # exactly at 95 %: accepted
    with pytest.raises(ReapError, match=r"short by .*lower --budget") as e:
        memory.check_available(plan, available=need * 100 // 95 - 2)
    assert e.value.exit_code == 2
    assert parse_bytes("8GB") == 8 * 10**9
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5g") == 1_500_000_000
    with pytest.raises(ReapError, match="cannot parse"):
        parse_bytes("lots")
    avail, source = available_memory()
    assert avail > 0 and source


# -- kernels, reader, ring, cache ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fast_mxfp4_decode_is_bit_identical_to_the_codec(dtype):
    from reap.quant import mxfp4, mxfp4_decode

    g = torch.Generator().manual_seed(1)
    lo, hi = (118, 136) if dtype == torch.float16 else (0, 256)  # fp16 overflows outside
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for shape in ((3, 5, 48), (700, 2048)):  # the second spans several chunks and threads
        packed = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        scales = torch.randint(
            lo, hi, (*shape[:-1], shape[-1] // 16), generator=g, dtype=torch.uint8
        )
        slow = mxfp4.dequantize(packed, scales, dtype).view(bits)
        fast = decode_mxfp4(packed, scales, dtype)  # C kernel when a compiler is available
        assert fast.dtype == dtype and torch.equal(fast.view(bits), slow)
        if dtype in mxfp4_decode._WORD:  # and the pure-torch fallback
            words = mxfp4_decode._decode_torch(packed, scales, mxfp4_decode._table(dtype))
            assert torch.equal(words.view(dtype).reshape(slow.shape).view(bits), slow)
    p2, s2 = packed[:2, :64], scales[:2, :4]  # two rows, against the per-element decoder
    exact = mxfp4_dequantize_reference(p2, s2)
    f = decode_mxfp4(p2, s2, dtype).double()
    assert torch.equal(f.isnan(), exact.isnan()) and torch.equal(f[~f.isnan()], exact[~f.isnan()])


def test_reader_coalesces_an_expert_into_one_read_and_matches_checkpoint(tiny):
    ck = Checkpoint.open(tiny)
    fam = family(ck.config)
    expert_names = functools.partial(fam.expert_tensor_names, fam.Config.from_dict(ck.config))
    names = expert_names(2, 5)
    for direct in (False, True):
        r = BufferReader(ck, direct=direct)
        got = r.read(names, "experts")
        assert r.io.reads == 1 and r.io.bytes["experts"] >= sum(ck.tensors[n].nbytes for n in names)
        for n in names:
            assert torch.equal(got[n], ck.read(n))
        rows = r.read_rows("model.embed_tokens.weight", [7, 3, 7])
        assert torch.equal(rows, ck.read("model.embed_tokens.weight")[[7, 3, 7]])
        r.close()


def test_ring_streams_every_unit_with_prefetch_and_pinned_units_stay(tiny):
    ck = Checkpoint.open(tiny)
    fam = family(ck.config)
    from reap.engine.binding import bind

    b = bind(ck.tensors, fam, ck.config, tiny)
    r = BufferReader(ck)
    trunk = TrunkStore(r, b.units, pinned=[1, 4], slots=2)
    pinned_bytes = r.io.bytes["trunk"]
    streamed = sum(ck.tensors[n].nbytes for i in trunk.streamed for n in b.units[i])
    for _ in range(2):  # two full passes, wrapping around
        for i in range(len(b.units)):
            got = trunk.get(i)
            assert sorted(got) == sorted(b.units[i])
            for n in b.units[i][:3]:
                assert torch.equal(got[n], ck.read(n))
    trunk.drain()
    # each pass reads the streamed units once (the wrap-around prefetch of pass 3 included)
    assert r.io.bytes["trunk"] - pinned_bytes >= 2 * streamed
    assert (
        r.io.bytes["trunk"] - pinned_bytes
        <= 2 * streamed
        + 2 * max(sum(ck.tensors[n].nbytes for n in b.units[i]) for i in trunk.streamed)
        + 4096
    )
    trunk.close()


class NaiveLFU:
    """Brute-force reference of ExpertCache's policy: every use adds 2^(t/half_life) to the
    expert's count; a miss takes a free slot, else evicts the oldest staged expert not used in
    the current layer, else the lowest (count, key) admitted one. Once no slot is free, an
    expert (new or staged) is (re)staged as the newest instead of admitted if the lowest
    admitted count is at least one use's weight a half-life ago and not below this expert's
    count before this use."""

    def __init__(self, slots, half_life):
        self.slots, self.half_life, self.t = slots, half_life, 0
        self.seen, self.admitted, self.staged, self.in_use = {}, set(), [], set()

    @property
    def resident(self):
        return self.admitted | set(self.staged)

    def access(self, key):
        self.t += 1
        self.in_use.add(key)
        hit = key in self.resident
        if not hit and len(self.resident) >= self.slots:
            staged = [k for k in self.staged if k not in self.in_use]
            admitted = [(self.seen[k], k) for k in self.admitted if k not in self.in_use]
            if staged:
                self.staged.remove(staged[0])
            elif admitted:
                self.admitted.discard(min(admitted)[1])
            else:
                return hit  # read into a transient buffer, not counted
        w, before = 2.0 ** (self.t / self.half_life), self.seen.get(key, 0.0)
        self.seen[key] = before + w
        if key not in self.admitted:
            self.staged = [k for k in self.staged if k != key]
            full = len(self.resident | {key}) >= self.slots
            low = min((self.seen[k] for k in self.admitted), default=float("-inf"))
            if full and low >= w / 2 and before <= low:
                self.staged.append(key)
            else:
                self.admitted.add(key)
        return hit


def test_expert_cache_matches_a_brute_force_lfu_with_aging(tiny):
    ck = Checkpoint.open(tiny)
    fam = family(ck.config)
    expert_names = functools.partial(fam.expert_tensor_names, fam.Config.from_dict(ck.config))
    r = BufferReader(ck)
    one = sum(ck.tensors[n].nbytes for n in expert_names(1, 0))
    cache = ExpertCache(r, 6 * one, expert_names, half_life=16)
    naive = NaiveLFU(6, 16)
    g = torch.Generator().manual_seed(0)
    popular = torch.tensor([0, 1, 2, 3] * 3 + list(range(16)))
    staged = 0
    for step in range(300):
        layer = 1 + step % 3
        for e in sorted(set(popular[torch.randint(0, len(popular), (3,), generator=g)].tolist())):
            hits = cache.hits
            t = cache.get(layer, e)
            assert (cache.hits > hits) == naive.access((layer, e))
            assert torch.equal(t["w2.weight_packed"], ck.read(expert_names(layer, e)[2]))
        cache.release()
        naive.in_use.clear()
        assert set(cache.tensors) == naive.resident and list(cache._staged) == naive.staged
        staged += bool(naive.staged)
    assert 0 < cache.hits < 900 and r.io.reads == cache.misses and staged > 0


def test_expert_cache_smaller_than_a_token_keeps_the_experts_it_admitted(tiny):
    """A cyclic scan of 12 experts a token through 8 slots: LRU (as LFU without admission)
    evicts each expert just before its next use and hits nothing; with admission the slots
    beside one layer's 4 misses keep their experts, which hit on every token."""
    ck = Checkpoint.open(tiny)
    fam = family(ck.config)
    expert_names = functools.partial(fam.expert_tensor_names, fam.Config.from_dict(ck.config))
    one = sum(ck.tensors[n].nbytes for n in expert_names(1, 0))
    for half_life in (12, 1):  # one token's uses; LRU
        cache = ExpertCache(BufferReader(ck), 8 * one, expert_names, half_life=half_life)
        for token in range(20):
            hits = cache.hits
            for layer in (1, 2, 3):
                cache.prefetch(layer, range(4))
                [cache.get(layer, e) for e in range(4)]
                cache.release()
        assert cache.hits - hits == (8 - 4 if half_life == 12 else 0)  # the last token's


# -- the engine against the reference forward ---------------------------------------------------
def _forward(model, get, ids):
    """The in-memory forward's logits [T, V] with the kernels the engine's step uses (the
    few-row GEMV is opt-in), so engine and reference compute the same thing."""
    with dense_kernel.enabled():
        return model.forward(get, torch.tensor([ids]))[0]


def test_engine_logits_equal_the_in_memory_forward(tiny, ref):
    model, get = ref
    ids = [5, 17, 200, 31, 7, 7, 90, 1, 44]
    with Engine.open(tiny, preset="ultra", context=64) as eng:
        assert eng.plan.ring_slots == 2 and not eng.plan.pinned
        got = eng.logits([ids])[0]
        want = _forward(model, get, ids)
        assert torch.equal(got, want)
        batch = eng.logits([ids, ids[:4], [3, 2, 1, 0, 9]])  # lockstep, different lengths
        for seq, lg in zip([ids, ids[:4], [3, 2, 1, 0, 9]], batch):
            torch.testing.assert_close(
                lg, _forward(model, get, seq), rtol=1e-5, atol=1e-5
            )
    with Engine.open(tiny, preset="max", context=64, prefill_chunk=4) as eng:
        torch.testing.assert_close(eng.logits([ids])[0], want, rtol=1e-4, atol=1e-4)


def test_logits_from_a_first_position_are_those_rows_of_all_positions(tiny):
    """`first=`: the head runs on the chunk's positions from `first` on only; those rows are
    the all-positions rows (to rounding: K3's final block mix is a torch op over all rows);
    a one-token step honours it too; a negative first is bad input."""
    ids = [5, 17, 200, 31, 7, 7, 90, 1, 44]
    with Engine.open(tiny, preset="max", context=64, dtype="float32") as eng:
        s, t = eng.new_sequence(), eng.new_sequence()
        full = eng.step([s], [ids], all_positions=True)[0]
        part = eng.step([t], [ids], all_positions=True, first=6)[0]
        assert part.shape == (3, full.shape[1])
        tol = 1e-5 * float(full.abs().max())  # 1.4e-6 of 3.8 measured; another row: O(1)
        torch.testing.assert_close(part, full[6:], rtol=0, atol=tol)
        one = eng.step([s, t], [[3], [3]], all_positions=True, first=1)
        assert [o.shape[0] for o in one] == [0, 0]
        with pytest.raises(ReapError, match="first position"):
            eng.step([eng.new_sequence()], [ids], all_positions=True, first=-1)


def test_greedy_tokens_equal_reference_and_are_identical_across_budgets(tiny, ref):
    prompt = [72, 101, 108, 108, 111]
    want = ref_greedy(ref, prompt, 12)
    runs, plans = {}, set()
    for preset in ("ultra", "desktop", "server"):  # budgets scaled to the model
        with Engine.open(tiny, preset=preset, context=64) as eng:
            plans.add((len(eng.plan.pinned), eng.plan.ring_slots, eng.plan.expert_cache))
            greedy = eng.generate([prompt], max_tokens=12)[0]
            sampled = eng.generate([prompt], max_tokens=12, temperature=0.9, top_p=0.9, seed=7)[0]
            runs[preset] = (greedy.ids, greedy.text, sampled.ids, sampled.text)
            assert eng.metrics.decode.tokens == 2 * 11
    assert len(plans) == 3, plans
    assert runs["ultra"][0] == want
    assert runs["ultra"] == runs["desktop"] == runs["server"]


def test_lockstep_batch_matches_single_runs_and_reads_less_per_token(tiny):
    prompts = [[10, 20, 30], [40, 50, 60, 70, 80], [1, 2]]
    with Engine.open(tiny, preset="ultra", context=64, batch=3) as eng:
        singles, per_token = [], []
        for p in prompts:
            gens, metrics = generate(eng, [p], max_tokens=8)
            singles.append(gens[0].ids)
            m = metrics.decode
            per_token.append(m.total_bytes / m.tokens)
        batch, metrics = generate(eng, prompts, max_tokens=8)
        m = metrics.decode
        assert [g.ids for g in batch] == singles
        assert m.tokens == 3 * 7
        assert m.total_bytes / m.tokens < 0.5 * min(per_token)


def test_stream_yields_what_generate_returns_and_stop_strings_cut(tiny):
    with Engine.open(tiny, preset="max", context=64) as eng:
        full = eng.generate("Hello", max_tokens=10, temperature=1.0, seed=3)[0]
        assert list(eng.stream("Hello", max_tokens=10, temperature=1.0, seed=3)) == full.ids
        text = eng.tokenizer.decode(full.ids)
        assert full.text == text and full.finish_reason == "length"
        stop = text[3:5]
        cut = eng.generate("Hello", max_tokens=10, temperature=1.0, seed=3, stop=[stop])[0]
        assert cut.finish_reason == "stop" and cut.text == text[: text.find(stop)]
        assert len(cut.ids) < 10 and full.ids[: len(cut.ids)] == cut.ids
        with pytest.raises(ReapError, match="exceed the declared context"):
            eng.generate([1] * 60, max_tokens=10)
        with pytest.raises(ReapError, match="outside the vocabulary"):
            eng.generate([[10**6]], max_tokens=1)


def test_stop_matcher_finds_the_earliest_stop_across_tokens():
    m = StopMatcher(lambda ids: "".join(chr(i) for i in ids), ["cd", "xbc"])
    assert not m.feed([97, 98])
    assert m.feed([97, 98, 99, 100]) and m.text == "ab"


def test_sampling_follows_the_distribution_and_is_seeded():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 2.0])
    assert sample(logits, 0.0, 1.0, None) == 0  # greedy: lowest id among equal maxima
    nan, inf = float("nan"), float("inf")
    for row in ([1.0, nan, 3.0, nan], [inf, 1.0, inf], [-inf] * 3, [0.0, -0.0, 5.0, 5.0]):
        for dt in (torch.float32, torch.bfloat16, torch.float64):  # greedy: torch.argmax's pick
            x = torch.tensor(row, dtype=dt)
            assert sample(x, 0.0, 1.0, None) == int(torch.argmax(x)), (row, dt)
    g = torch.Generator().manual_seed(0)
    draws = torch.tensor([sample(logits, 0.7, 1.0, g) for _ in range(4000)])
    p = torch.softmax(logits.double() / 0.7, 0)
    freq = torch.bincount(draws, minlength=5).double() / 4000
    assert (freq - p).abs().max() < 0.03
    # top-p keeps the smallest prefix (by probability, then id) reaching the mass
    kept = {sample(logits, 1.0, 0.5, g) for _ in range(300)}
    assert kept == {0, 4}
    a = [sample(logits, 1.0, 0.9, torch.Generator().manual_seed(5)) for _ in range(3)]
    assert len(set(a)) == 1


def test_preset_max_reads_every_expert_at_open_and_then_only_hits(tiny):
    with Engine.open(tiny, preset="max", context=64) as eng:
        b = eng.binding
        assert len(eng.experts.tensors) == len(b.expert_layers) * b.n_experts
        read = eng.reader.io.bytes["experts"]
        eng.generate([[1, 2, 3]], max_tokens=4)
        assert eng.experts.misses == 0 and eng.experts.hits > 0
        assert eng.reader.io.bytes["experts"] == read
    prompt = [1, 2, 3, 200, 7]
    with Engine.open(tiny, preset="max", context=64) as eng:  # the embedding table too
        table = eng.reader.info(eng.binding.embed)
        assert eng.plan.embed_table == table.nbytes == eng.reader.io.bytes["embed"]
        pinned = eng.generate([prompt], max_tokens=6)[0].ids
        assert eng.reader.io.bytes["embed"] == table.nbytes  # no row read after open
    with Engine.open(tiny, preset="server", context=64) as eng:  # rows read per step
        assert eng.plan.embed_table == 0 and eng.generate([prompt], max_tokens=6)[0].ids == pinned
        assert eng.reader.io.bytes["embed"] == 10 * table.nbytes // table.shape[0]
    with Engine.open(tiny, preset="max", context=64, preload=False) as eng:
        assert not eng.experts.tensors
        eng.generate([[1, 2, 3]], max_tokens=4)
        assert eng.experts.misses > 0
    with Engine.open(tiny, preset="ultra", context=64) as eng:  # not all fit: read on use
        assert not eng.experts.tensors


# -- failures and exit codes --------------------------------------------------------------------
def test_failed_expert_reads_are_recorded_and_generation_finishes(tiny, tmp_path):
    d = tmp_path / "cut"
    shutil.copytree(tiny, d)
    ck = Checkpoint.open(d)
    fam = family(ck.config)
    expert_names = functools.partial(fam.expert_tensor_names, fam.Config.from_dict(ck.config))
    first = min(ck.tensors[n].start for n in expert_names(5, 0))
    with Engine.open(d, preset="max", context=64, preload=False) as eng:  # experts lazy
        shard = ck.tensors[expert_names(5, 0)[0]].file
        os.truncate(shard, first + 10)  # every expert stored after it becomes unreadable
        gen = eng.generate([[1, 2, 3]], max_tokens=3)[0]
        assert len(gen.ids) == 3 and eng.expert_failures
        assert {layer for layer, _, _ in eng.expert_failures} == {5}
        assert "short read" in eng.expert_failures[0][2]


def _run(*args, capsys=None) -> tuple[int, str, str]:
    try:
        code = main(["run", *args])
    except SystemExit as e:  # argparse rejects bad arguments with exit status 2
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_run_json_output_and_bad_arguments(tiny, capsys, tmp_path):
    code, out, err = _run(
        tiny,
        "--prompt-ids",
        "1,2,3",
        "--max-tokens",
        "4",
        "--json",
        "--preset",
        "desktop",
        capsys=capsys,
    )
    assert code == 0, err
    res = json.loads(out)
    assert len(res["generations"][0]["ids"]) == 4 and "memory plan" in err
    assert res["metrics"]["decode"]["tokens"] == 3
    assert _run(tiny, "--prompt", "hi", "--top-p", "0", capsys=capsys)[0] == 2
    assert _run(tiny, "--prompt-ids", "1,x", capsys=capsys)[0] == 2
    assert _run(tiny, capsys=capsys)[0] == 2  # no prompt
    code, _, err = _run(tiny, "--prompt", "hi", "--context", "4000000000", capsys=capsys)
    assert code == 2 and "short by" in err
    code, _, err = _run(tiny, "--prompt", "hi", "--budget", "1MB", capsys=capsys)
    assert code == 2 and "below" in err
    code, _, err = _run(tiny, "--prompt", "hi", "--device", "tpu", capsys=capsys)
    assert code == 2 and "device" in err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "ab"}\n{"ids": [1, 2], "max_tokens": 2, "seed": 4}\n')
    code, out, err = _run(tiny, "--prompts", str(prompts), "--json", "--quiet", capsys=capsys)
    assert code == 0, err
    assert [len(g["ids"]) for g in json.loads(out)["generations"]] == [64, 2]
    # --warmup: the same generation once before; only the second run is reported
    args = ("--prompt-ids", "1,2,3", "--max-tokens", "4", "--json", "--quiet")
    code, out, err = _run(tiny, *args, "--warmup", capsys=capsys)
    assert code == 0, err
    warm = json.loads(out)
    assert warm["generations"] == json.loads(_run(tiny, *args, capsys=capsys)[1])["generations"]
    assert warm["metrics"]["decode"]["tokens"] == 3 and warm["metrics"]["prefill"]["tokens"] == 3


def test_run_exit_1_on_a_missing_trunk_tensor(tiny, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "broken"
    shutil.copytree(tiny, d)
    tensors = load_file(d / "model.safetensors")
    del tensors["language_model.model.layers.2.post_attention_layernorm.weight"]
    os.remove(d / "model.safetensors.index.json")
    save_file(tensors, d / "model.safetensors")
    code, _, err = _run(str(d), "--prompt", "hi", capsys=capsys)
    assert code == 1 and "layers.2.post_attention_layernorm.weight is missing" in err


def test_run_exit_3_when_the_result_cannot_be_written(tiny, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, out, err = _run(
        tiny,
        "--prompt",
        "hi",
        "--max-tokens",
        "2",
        "--out",
        str(blocker / "out.json"),
        capsys=capsys,
    )
    # unusable as given (a file where a directory is needed): exit 2 before any work
    assert code == 2 and f"{blocker} is a file" in err and not out
    if os.path.isdir("/proc/self"):  # not writable: exit 3 after the work
        code, out, err = _run(tiny, "--prompt", "hi", "--max-tokens", "2",
                              "--out", "/proc/reap-test/out.json", capsys=capsys)
        assert code == 3 and "cannot write" in err and out  # printed, then not written
    ok = tmp_path / "ok.json"
    assert (
        _run(tiny, "--prompt", "hi", "--max-tokens", "2", "--out", str(ok), capsys=capsys)[0] == 0
    )
    assert json.loads(ok.read_text())["generations"][0]["finish_reason"] == "length"


def test_run_exit_4_when_an_expert_is_corrupt(tiny, tmp_path, capsys):
    d = tmp_path / "corrupt"
    shutil.copytree(tiny, d)
    ck = Checkpoint.open(d)
    fam = family(ck.config)
    expert_names = functools.partial(fam.expert_tensor_names, fam.Config.from_dict(ck.config))
    with open(ck.tensors[expert_names(1, 0)[0]].file, "r+b") as f:
        for e in range(fam.Config.from_dict(ck.config).num_experts):  # every expert of layer 1
            t = ck.tensors[expert_names(1, e)[1]]  # w1.weight_scale
            f.seek(t.start)
            f.write(b"\xff" * t.nbytes)
    code, out, err = _run(str(d), "--prompt-ids", "1,2", "--max-tokens", "2", capsys=capsys)
    assert code == 4 and "not trustworthy" in err and "layer 1" in err and out


def _sigint_default() -> None:
    """In the child before exec: Ctrl-C's default action, as under a terminal. A test run
    started as a background job inherits SIGINT ignored, and Python keeps an ignored SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _subprocess(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "reap.cli", "run", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_sigint_default,  # noqa: PLW1509 (one signal call between fork and exec)
    )


def test_run_subprocess_peak_rss_within_plan_and_exit_5_on_sigint(tiny):
    p = _subprocess(
        tiny,
        "--prompt-ids",
        "1,2,3",
        "--max-tokens",
        "6",
        "--json",
        "--preset",
        "ultra",
        "--threads",
        "1",
    )
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    res = json.loads(out)
    assert 0 < res["metrics"]["peak_rss"] <= res["plan"]["total"]
    # --ignore-eos: a random model may emit EOS at any step, and the run must still be going
    # when the signal lands, however slow or fast this machine is
    p = _subprocess(
        tiny, "--prompt-ids", "1,2,3", "--max-tokens", "4000", "--context", "4100", "--threads",
        "1", "--ignore-eos",
    )
    for line in p.stderr:  # wait until the plan is printed: the model is running
        if "streamed per token" in line:
            break
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 5, err
    assert "interrupted" in err and "Traceback" not in err


def test_default_model_is_synthesized_once_without_a_bundled_one(tmp_path, monkeypatch):
    import reap.defaults

    monkeypatch.setattr(reap.defaults, "BUNDLED", tmp_path / "no-bundled-model")
    monkeypatch.setenv("REAP_CACHE", str(tmp_path))
    path = reap.defaults.default_model()
    assert Path(path, "config.json").is_file() and reap.defaults.default_model() == path
    with Engine.open(None, preset="ultra", context=32) as eng:
        assert eng.path == path and len(eng.generate("a", max_tokens=2)[0].ids) == 2


def test_expert_prefetch_reads_in_background_and_serves_the_same_bytes(tiny):
    ck = Checkpoint.open(tiny)
    fam = family(ck.config)
    expert_names = functools.partial(fam.expert_tensor_names, fam.Config.from_dict(ck.config))
    r = BufferReader(ck)
    one = sum(ck.tensors[n].nbytes for n in expert_names(1, 0))
    cache = ExpertCache(r, 4 * one, expert_names)
    ids = [0, 3, 5, 9, 11]  # one more than fits: the fifth is read into a transient buffer
    cache.prefetch(2, ids)
    for e in ids:
        t = cache.get(2, e)
        for n, short in zip(expert_names(2, e), fam.EXPERT_TENSORS):
            assert torch.equal(t[short], ck.read(n))
    assert cache.misses == 5 and r.io.reads == 5
    cache.release()
    assert len(cache.tensors) == 4
    cache.prefetch(2, ids)  # resident ones are not read again
    assert sum(cache.get(2, e) is not None for e in ids) == 5 and r.io.reads == 6
    cache.close()


def test_decode_buffers_are_reused_only_when_nothing_refers_to_them():
    from reap.quant.mxfp4_decode import BufferPool

    g = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (64, 32), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 130, (64, 2), generator=g, dtype=torch.uint8)
    pool = BufferPool(1 << 20)
    a = decode_mxfp4(packed, scales, torch.bfloat16, pool)
    keep = a.T  # a live view: the buffer must not be handed out again
    b = decode_mxfp4(packed.flip(0), scales.flip(0), torch.bfloat16, pool)
    assert a.data_ptr() != b.data_ptr() and torch.equal(keep.T, decode_mxfp4(packed, scales))
    ptr_b = b.data_ptr()
    del a, keep, b
    c = decode_mxfp4(packed, scales, torch.bfloat16, pool)
    assert c.data_ptr() in {p.data_ptr() for p in pool.buffers} and len(pool.buffers) == 2
    assert ptr_b in {p.data_ptr() for p in pool.buffers}


def test_a_model_that_announces_its_routing_gets_prefetched_experts(tiny, ref, monkeypatch):
    """If the MoE block calls `experts.prefetch(layer, ids)` before dispatching (the hook the
    engine's ExpertSource offers), every miss is read in the background and the logits do not
    change. The hook is simulated by wrapping the shared dispatch."""
    from reap.models.shared import blocks

    model, get = ref
    ids = [5, 17, 200, 31, 7]
    want = _forward(model, get, ids)
    with Engine.open(tiny, preset="ultra", context=64) as eng:
        layer, calls = {}, []
        inner_mlp, inner_dispatch = eng.model.mlp_block, blocks.dispatch

        def mlp_block(i, *a, **k):
            layer["i"] = i
            return inner_mlp(i, *a, **k)

        def dispatch(xl, route_ids, *a, **k):
            calls.append(len(route_ids.unique()))
            eng._source.prefetch(layer["i"], route_ids.unique().tolist())
            assert eng.experts._pending  # reads are in flight before the first expert runs
            return inner_dispatch(xl, route_ids, *a, **k)

        monkeypatch.setattr(eng.model, "mlp_block", mlp_block)
        monkeypatch.setattr(blocks, "dispatch", dispatch)
        assert torch.equal(eng.logits([ids])[0], want)
        # no cache at this preset: every routed expert of every layer is one background read
        assert eng.experts._pool is not None and eng.experts.misses == sum(calls) > 0


def test_engine_greedy_tokens_equal_mlx_lm(tiny):
    """The oracle end to end: mlx-lm's own K3 implementation on the same float32 checkpoint."""
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    prompt = [72, 101, 108, 108, 111, 44, 32]
    model, _ = load_model(Path(tiny))
    steps = zip(generate_step(mx.array(prompt), model, max_tokens=10), range(10))
    want = [int(tok) for (tok, _), _ in steps]
    with Engine.open(tiny, preset="ultra", context=64) as eng:
        assert eng.generate([prompt], max_tokens=10)[0].ids == want
