"""The engine's compiled decode step (`reap.engine.native` over `reap.quant.step_kernel`)
against the torch path it replaces (`Engine._step`, the reference), on tiny checkpoints saved by
transformers: Qwen3-MoE (per-head q/k norms, a dense layer, tied embeddings), OLMoE (q/k norms
over the whole projection) and Mixtral (no q/k norms, a sliding window shorter than the run),
stored in float32 and in bfloat16. Decode steps are teacher-forced with the same tokens on both
paths, with a multi-token chunk (torch) between them, so each path reads the other's KV cache."""

import json
from pathlib import Path

import family_runner as R
import pytest
import torch
from safetensors.torch import load_file, save_file

from reap.engine import Engine, native, native_token
from reap.engine.experts import ExpertCache
from reap.quant import step_kernel

pytestmark = pytest.mark.skipif(step_kernel.library() is None, reason="no C compiler")

QWEN = {
    "vocab_size": 320, "hidden_size": 72, "intermediate_size": 84, "moe_intermediate_size": 40,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_experts": 8, "num_experts_per_tok": 3, "norm_topk_prob": True, "mlp_only_layers": [1],
    "tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
}  # fmt: skip
OLMOE = {
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "num_experts": 8,
    "num_experts_per_tok": 2, "rope_theta": 1e4,
}  # fmt: skip
MIXTRAL = {
    "vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 6,
    "intermediate_size": 44,
    "num_experts_per_tok": 2, "sliding_window": 6, "rope_theta": 1e4,
}  # fmt: skip
PROMPT, STEPS, CHUNK, MORE = [3, 100, 7, 200, 55], [9, 1, 250, 17, 42, 8], [60, 61, 62], [5, 6]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import transformers as T

    root = tmp_path_factory.mktemp("native")
    out = {}
    for name, cls, cfg_cls, kw, extra in (
        ("qwen3_moe", T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig, QWEN,
         {"num_experts": 8, "rope_theta": 1e4}),
        ("olmoe", T.OlmoeForCausalLM, T.OlmoeConfig, OLMOE, None),
        ("mixtral", T.MixtralForCausalLM, T.MixtralConfig, MIXTRAL, None),
    ):  # fmt: skip
        path, _ = R.save_hf_tiny(cls, cfg_cls, kw, root / name, seed=7, config_extra=extra)
        out[name, "float32"] = path
        out[name, "bfloat16"] = _bf16_copy(path, root / f"{name}-bf16")
    return out


def _bf16_copy(path, out: Path) -> str:
    """The checkpoint with every tensor stored in bf16."""
    out.mkdir()
    for f in Path(path).iterdir():
        if f.suffix == ".safetensors":
            t = load_file(f)
            save_file(
                {k: v.bfloat16() for k, v in t.items()}, out / f.name, metadata={"format": "pt"}
            )
        elif f.name == "config.json":
            cfg = json.loads(f.read_text())
            (out / f.name).write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
        else:
            (out / f.name).write_bytes(f.read_bytes())
    return str(out)


def _logits(path, dtype, monkeypatch, on=True, threads=1, preset="max", together=False,
            whole=None, budget=None, tables=None):
    """Logits [steps, V] of PROMPT, one-token STEPS, the CHUNK, one-token MORE (teacher
    forced); `together`: a second sequence (the same tokens) decodes in lockstep beside it.
    `whole`: a list that gets one item per step run as a whole-token call; `tables`: per
    compiled prefill MoE call, whether its expert table was the resident one. `budget`: bytes
    beyond the process (instead of `preset`)."""
    monkeypatch.setattr(native, "ENABLED", on)
    calls = []
    step, token = native.NativeDecoder.step, native_token.WholeToken.run
    monkeypatch.setattr(native.NativeDecoder, "step", lambda *a: calls.append(1) or step(*a))
    if whole is not None:
        monkeypatch.setattr(native_token.WholeToken, "run", lambda *a: whole.append(1) or token(*a))
    if tables is not None:
        routed = native.NativeDecoder.routed
        monkeypatch.setattr(native.NativeDecoder, "routed",
                            lambda self, *a: tables.append(self.token.ready()) or routed(self, *a))
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    size = {"budget": budget, "baseline": 0} if budget else {"preset": preset}
    try:
        with Engine.open(path, context=64, dtype=dtype, batch=2, **size) as eng:
            seqs = [eng.new_sequence() for _ in range(2 if together else 1)]
            out = []
            for chunk in (PROMPT, *[[t] for t in STEPS], CHUNK, *[[t] for t in MORE]):
                if len(chunk) == 1:  # one token: all sequences in one step
                    out.append(eng.step(seqs, [chunk] * len(seqs), all_positions=True)[0][-1])
                else:  # the torch path's prefill depends on the batch: each sequence alone
                    rows = [eng.step([s], [chunk], all_positions=True)[0][-1] for s in seqs]
                    out.append(rows[0])
    finally:
        torch.set_num_threads(saved)
    assert len(calls) == (len(STEPS) + len(MORE) if on else 0)  # the path really ran (or not)
    return torch.stack(out)


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "mixtral"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_decode_matches_the_torch_path(models, family, dtype, monkeypatch):
    """Decode steps and the prefill chunks' routed experts through the library. fp32: within
    2e-5 of the torch path (only reduction orders differ); bf16: every value rounded where
    torch rounds it, logits within 2 bf16 steps of the largest (one rounding of an
    intermediate landing the other way moves a logit by about that); the greedy token of
    every step the same."""
    path = models[family, dtype]
    ref = _logits(path, dtype, monkeypatch, on=False)
    got = _logits(path, dtype, monkeypatch, on=True)
    scale = ref.abs().max()
    tol = 2e-5 * scale if dtype == "float32" else 2 * 2.0**-7 * scale
    assert (got - ref).abs().max() <= tol
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_decode_is_thread_batch_and_budget_invariant(models, dtype, monkeypatch):
    """Bit for bit: 1 or 3 threads, alone or in a lockstep batch of two, all weights resident
    or streamed through the smallest preset (ring and expert evictions). Alone and resident,
    each token is one call through every layer (`reap_token_step`); in a batch or streamed,
    two calls per layer: the same arithmetic."""
    path = models["qwen3_moe", dtype]
    whole, layered = [], []
    one = _logits(path, dtype, monkeypatch, whole=whole)
    assert len(whole) == len(STEPS) + len(MORE)
    assert torch.equal(_logits(path, dtype, monkeypatch, threads=3), one)
    assert torch.equal(_logits(path, dtype, monkeypatch, together=True, whole=layered), one)
    assert torch.equal(_logits(path, dtype, monkeypatch, preset="ultra", whole=layered), one)
    assert not layered
    # prefill experts in the library, their pointers gathered from a cache still filling (its
    # room is a few experts short of the whole model's), or from the resident table
    with Engine.open(path, preset="max", context=64, dtype=dtype, batch=2, baseline=0) as eng:
        budget = eng.plan.total - 3 * max(eng.plan_bytes.expert_bytes)
    gathered, resident, split, runs = [], [], [], []
    experts = native.NativeDecoder._experts  # a decode step's resident experts run first
    monkeypatch.setattr(native.NativeDecoder, "_experts", lambda self, *a, **k:
                        split.append(k.get("nosum")) or experts(self, *a, **k))
    moe = native.NativeDecoder.moe_call  # a prefill's experts in runs as their reads are done
    monkeypatch.setattr(native.NativeDecoder, "moe_call", lambda self, *a:
                        runs.append(len(a) == 6 and a[5] is not None) or moe(self, *a))
    monkeypatch.setattr(ExpertCache, "ready", lambda self, layer, e: e % 3 != 0)  # runs of 3
    assert torch.equal(_logits(path, dtype, monkeypatch, budget=budget, tables=gathered), one)
    assert True in split and True in runs  # ... while the others were read: the same bits
    assert torch.equal(_logits(path, dtype, monkeypatch, tables=resident), one)
    assert False in gathered and resident and all(resident)


def test_whole_token_bindings_follow_turns_lockstep_steps_and_growth(models, monkeypatch):
    """A whole-token call keeps its sequence's binding to the next token
    (`WholeToken._position`): two sequences taking turns token by token, lockstep steps of both
    and a chunk of one between (which point the blocks elsewhere), past the caches' and rope
    tables' growth at 256 positions, give each sequence the logits it gets decoding alone, bit
    for bit."""
    path = models["qwen3_moe", "bfloat16"]
    steps = {"a": [[(7 * i + 3) % 300 + 1] for i in range(270)],
             "b": [[(11 * i) % 300] for i in range(30)]}  # fmt: skip
    steps["b"][12] = CHUNK  # b's chunk between a's tokens

    def alone(chunks):
        with Engine.open(path, preset="max", context=300, dtype="bfloat16") as eng:
            s = eng.new_sequence()
            return torch.stack([eng.step([s], [c])[0] for c in chunks])

    whole = []
    token = native_token.WholeToken.run
    monkeypatch.setattr(native_token.WholeToken, "run", lambda *a: whole.append(1) or token(*a))
    got = {"a": [], "b": []}
    with Engine.open(path, preset="max", context=300, dtype="bfloat16", batch=2) as eng:
        seqs = {k: eng.new_sequence() for k in steps}
        for i in range(len(steps["a"])):
            turn = ["a", "b"] if i < len(steps["b"]) else ["a"]
            if i % 7 == 3 and len(turn) == 2:  # lockstep
                outs = eng.step([seqs[k] for k in turn], [steps[k][i] for k in turn])
            else:
                outs = [eng.step([seqs[k]], [steps[k][i]])[0] for k in turn]
            for k, o in zip(turn, outs):
                got[k].append(o)
    assert len(whole) == len(steps["a"]) + len(steps["b"]) - 1 - 2 * len(range(3, 30, 7))
    for k, chunks in steps.items():
        assert torch.equal(torch.stack(got[k]), alone(chunks)), k


@pytest.mark.parametrize("stored,dtype", [("float32",) * 2, ("bfloat16",) * 2,
                                          ("bfloat16", "float32")])  # fmt: skip
def test_whole_token_calls_embed_as_the_family(models, stored, dtype, monkeypatch):
    """The whole-token call casts the token's embedding row itself (`reap_token_step`), as
    the family's lookup and cast: bit for bit the logits of the family's embedding."""
    path = models["qwen3_moe", stored]
    whole = []
    want = _logits(path, dtype, monkeypatch, whole=whole)
    assert whole
    monkeypatch.setattr(native_token.WholeToken, "_lookup_table", lambda self: None)
    assert torch.equal(_logits(path, dtype, monkeypatch), want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_many_token_steps_leave_torch_one_thread_when_the_kernels_do_the_products(
    models, dtype, monkeypatch
):
    """At 3 threads a many-token step runs torch's own ops on one thread and the kernels on 3:
    through the compiled layers (`native_prefill`), and through the torch path when its weight
    products all run in the kernels (fp32, or bf16 up to BF16_ROWS tokens; every expert
    resident), which then gives the logits of torch on 3 threads bit for bit; a longer bf16
    chunk (torch's matmul takes its products) and a streamed preset keep torch's threads."""
    from reap.engine import core, native_prefill
    from reap.quant import ckernel

    path, seen = models["qwen3_moe", dtype], []

    def spy(fn):
        return lambda *a, **k: (
            seen.append((torch.get_num_threads(), ckernel.threads())) or fn(*a, **k)
        )

    monkeypatch.setattr(native_prefill, "step", spy(native_prefill.step))
    _logits(path, dtype, monkeypatch, threads=3)
    assert seen and set(seen) == {(1, 3)}
    seen.clear()
    monkeypatch.setattr(native_prefill, "usable", lambda *a: False)
    monkeypatch.setattr(core.Engine, "_step", spy(core.Engine._step))
    got = _logits(path, dtype, monkeypatch, threads=3)
    assert seen and set(seen) == {(1, 3)}
    monkeypatch.setattr(native.NativeDecoder, "covers_products", lambda *a: False)
    assert torch.equal(_logits(path, dtype, monkeypatch, threads=3), got)
    monkeypatch.undo()
    monkeypatch.setattr(step_kernel, "BF16_ROWS", n := 16)  # as on a CPU with bf16 dot products
    for preset, covered in (("max", [True, dtype == "float32"]), ("ultra", [False, False])):
        with Engine.open(path, preset=preset, context=64, dtype=dtype) as eng:
            eng.generate([[3, 4]], max_tokens=1)  # at max: every expert read, tables built
            assert [eng._native.covers_products([[7] * k]) for k in (n, n + 1)] == covered


LONG = [[(7 * i + 3) % 300 + 10 for i in range(40)], [(11 * i + 5) % 300 + 10 for i in range(33)]]
WINDOWS = [
    [(13 * i + 1) % 300 + 10 for i in range(20)],
    [(5 * i + 2) % 300 + 10 for i in range(17)],
]


def _prefill_logits(path, dtype, monkeypatch, on=True, threads=1, preset="max", together=True):
    """Logits of two sequences: a prompt (40 and 33 tokens, every position) then a window (20
    and 17 tokens, positions 4.. as a perplexity pass scores them), both sequences in one step
    or each alone; checks the compiled layers ran (or not)."""
    from reap.engine import native_prefill

    monkeypatch.setattr(native, "ENABLED", on)
    monkeypatch.setattr(step_kernel, "PAIR_ROWS", 1 << 40)  # the compiled layers on any CPU
    calls, step = [], native_prefill.step
    monkeypatch.setattr(native_prefill, "step", lambda *a: calls.append(1) or step(*a))
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with Engine.open(path, context=96, dtype=dtype, batch=2, preset=preset) as eng:
            seqs, out = [eng.new_sequence() for _ in range(2)], []
            for chunks, first in ((LONG, 0), (WINDOWS, 4)):
                if together:
                    out += eng.step(seqs, chunks, all_positions=True, first=first)
                else:
                    out += [eng.step([s], [c], all_positions=True, first=first)[0]
                            for s, c in zip(seqs, chunks)]  # fmt: skip
    finally:
        torch.set_num_threads(saved)
    assert len(calls) == (0 if not on else 2 if together else 4)
    return torch.cat(out)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_many_token_steps_through_the_compiled_layers(models, family, dtype, monkeypatch):
    """Prompts long enough for the half-lane tiles and torch's fused attention (Mixtral: past
    its 6-token window), then perplexity windows from position 4: every position's logits
    within 2e-5 of the largest of the torch path's (bf16: 4 bf16 steps; the decode test's 2
    over its 10 positions), the same greedy token (bf16: at 90 %
    of the 102 positions at least; a random model's near ties flip); and bit for
    bit the same at 1 or 3 threads, alone or two sequences in a step, with every weight
    resident (max) or streamed (ultra: experts one call each, none cached)."""
    path = models[family, dtype]
    ref = _prefill_logits(path, dtype, monkeypatch, on=False)
    got = _prefill_logits(path, dtype, monkeypatch)
    assert got.shape == ref.shape == (40 + 33 + 16 + 13, 320)
    scale = ref.abs().max()
    tol = 2e-5 * scale if dtype == "float32" else 4 * 2.0**-7 * scale  # 102 rows, not 10
    assert (got - ref).abs().max() <= tol
    same = (got.argmax(-1) == ref.argmax(-1)).float().mean()  # bf16: near ties can flip
    assert same == 1.0 if dtype == "float32" else same >= 0.9
    assert torch.equal(_prefill_logits(path, dtype, monkeypatch, threads=3), got)
    assert torch.equal(_prefill_logits(path, dtype, monkeypatch, together=False), got)
    assert torch.equal(_prefill_logits(path, dtype, monkeypatch, preset="ultra"), got)


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    """A Qwen3-MoE with 6 query heads per key/value head (a group of 4 and 2 more; head_dim 20
    leaves 8- and 16-column tails) and the same model with each key/value head repeated for
    its queries (groups of 1): (grouped, repeated) paths per dtype."""
    import transformers as T

    root = tmp_path_factory.mktemp("grouped")
    cfg = {**QWEN, "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 20}
    path, _ = R.save_hf_tiny(T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig, cfg, root / "g", seed=3,
                             config_extra={"num_experts": 8, "rope_theta": 1e4})  # fmt: skip
    rep = root / "r"
    rep.mkdir()
    for f in Path(path).iterdir():
        if f.suffix == ".safetensors":
            t = load_file(f)
            for k in [k for k in t if k.endswith(("k_proj.weight", "v_proj.weight"))]:
                t[k] = t[k].reshape(2, 20, -1).repeat_interleave(6, dim=0).reshape(12 * 20, -1)
            save_file(t, rep / f.name, metadata={"format": "pt"})
        elif f.name == "config.json":
            c = json.loads(f.read_text())
            (rep / f.name).write_text(json.dumps({**c, "num_key_value_heads": 12}))
        else:
            (rep / f.name).write_bytes(f.read_bytes())
    return {"float32": (path, str(rep)),
            "bfloat16": (_bf16_copy(path, root / "g16"), _bf16_copy(rep, root / "r16"))}  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_query_heads_sharing_a_cache_head_give_the_per_head_values(grouped, dtype, monkeypatch):
    """The attention kernels run the query heads of one key/value head together (4 queries
    against each key row, 4 heads' sums from each value row): decode steps and many-token
    steps give bit for bit the logits of the same model with every query head given its own
    copy of the keys and values (each head alone), at 1 and 3 threads."""
    path, rep = grouped[dtype]
    want = (_logits(rep, dtype, monkeypatch), _prefill_logits(rep, dtype, monkeypatch))
    assert torch.equal(_logits(path, dtype, monkeypatch), want[0])
    assert torch.equal(_logits(path, dtype, monkeypatch, threads=3), want[0])
    assert torch.equal(_prefill_logits(path, dtype, monkeypatch), want[1])
    assert torch.equal(_prefill_logits(path, dtype, monkeypatch, threads=3), want[1])


def _moe_case(dtype, seed: int):
    """A prefill MoE call's inputs: 37 tokens (tiles and edges; 72 and 40 columns leave tails),
    8 experts, top 3, and a NativeDecoder around the step library: (decoder, x, ids, weights,
    expert weights, [E, 3] pointer table, F)."""
    from reap.models.shared import blocks

    g = torch.Generator().manual_seed(seed)
    N, K, E, D, F = 37, 3, 8, 72, 40
    ws = [[(torch.randn(*sh, generator=g) / 6).to(dtype) for sh in ((F, D), (F, D), (D, F))]
          for _ in range(E)]  # fmt: skip
    x = torch.randn(N, D, generator=g).to(dtype)
    ids, weights, _ = blocks.softmax_topk(torch.randn(N, E, generator=g), K, True)
    nd = native.NativeDecoder.__new__(native.NativeDecoder)
    nd.lib, nd.wbf16 = step_kernel.library(), dtype == torch.bfloat16
    nd.rnd = nd.wbf16
    table = torch.tensor([[w.data_ptr() for w in ws[e]] for e in range(E)])
    return nd, x, ids, weights, ws, table, F


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_token_experts_match_dispatch_and_do_not_depend_on_the_batch(dtype):
    """`NativeDecoder.moe_call` (the routed experts of a prefill chunk in one call) against
    the torch path's expert-major dispatch over the op-by-op SwiGLU, on 37 tokens (tiles and
    edges; 72 and 40 columns leave tails) with one expert missing from the table (it must
    contribute nothing); each token's row equals the same token run alone and among four
    copies of the batch (about 14 and 55 tokens an expert: both kinds of AVX2 tile), bit for
    bit."""
    from reap.models.shared import blocks

    nd, x, ids, weights, ws, table, F = _moe_case(dtype, seed=4)
    table[5] = 0
    got = nd.moe_call(x, ids, weights, table, F)
    run = lambda e, xs: blocks.silu_glu_reference(xs, *ws[e]) * (e != 5)
    want, _ = blocks.dispatch_reference(x, ids, weights, run)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    for t in (0, 17, 36):
        alone = nd.moe_call(x[t : t + 1], ids[t : t + 1], weights[t : t + 1], table, F)
        assert torch.equal(alone[0], got[t])
    four = nd.moe_call(x.repeat(4, 1), ids.repeat(4, 1), weights.repeat(4, 1), table, F)
    assert torch.equal(four, got.repeat(4, 1))


def _widths(flags):
    """The step and dense libraries built with extra compiler `flags` (another vector width)."""
    from reap.quant import ckernel

    step, dense = step_kernel.library(flags), ckernel.library("dense", flags)
    if step is None or dense is None:
        pytest.skip(f"compiler refuses {flags}")
    return step, dense


def _use(monkeypatch, **libs):
    """Run the engine's kernels from these builds ({"step": lib, "dense": lib})."""
    from reap.quant import ckernel

    for name, lib in libs.items():
        monkeypatch.setitem(ckernel._LOADED, (name, (), ckernel._HERE), lib)


def _kernel_outputs(dtype):
    """What the compiled kernels give on fixed inputs: the prefill experts of 37 and 148
    tokens, many-row products (tiles of both AVX2 kinds: 20 and 40 rows; 1100 columns: whole
    and part column blocks, a tail), a few-row one, the fused SwiGLU of one token."""
    from reap.quant import dense_kernel

    nd, x, ids, weights, ws, table, F = _moe_case(dtype, seed=5)
    g = torch.Generator().manual_seed(6)
    w = (torch.randn(70, 1100, generator=g) / 30).to(dtype)
    xs = torch.randn(40, 1100, generator=g).to(dtype)
    four = [t.repeat(4, 1) for t in (x, ids, weights)]
    with dense_kernel.enabled():
        out = [nd.moe_call(x, ids, weights, table, F), nd.moe_call(*four, table, F),
               dense_kernel.dense_linear(xs, w), dense_kernel.dense_linear(xs[:20], w),
               dense_kernel.dense_linear(xs[:3], w)]  # fmt: skip
        assert dense_kernel.swiglu_usable(x[:1], *ws[0])
        out.append(dense_kernel.swiglu(x[:1], *ws[0]))
    return out


@pytest.mark.parametrize("flags", [("-mno-avx2",), ("-mno-avx512f",)])
def test_every_vector_width_gives_the_same_values(flags, models, monkeypatch):
    """The libraries built without AVX2 (the plain C loops any x86-64 CPU runs) or without
    AVX-512 (AVX2 where the CPU has it) give the native build's logits and kernel outputs bit
    for bit: one order of operations on every CPU."""
    step, dense = _widths(flags)
    assert step.reap_simd() == 0 if flags == ("-mno-avx2",) else step.reap_simd() < 512
    if step_kernel.bf16_dot():  # the native build's bf16 experts take the pair order
        _use(monkeypatch, step=_widths(("-mno-avx512bf16",))[0])
    for family, dtype in (("mixtral", "float32"), ("mixtral", "bfloat16"), ("qwen3_moe", "float32"),
                          ("qwen3_moe", "bfloat16")):  # fmt: skip  # qwen3: no window, 8+ keys
        path = models[family, dtype]
        want = _logits(path, dtype, monkeypatch)
        kernels = _kernel_outputs(getattr(torch, dtype))
        _use(monkeypatch, step=step, dense=dense)
        assert torch.equal(_logits(path, dtype, monkeypatch, threads=2), want)
        for got, ref in zip(_kernel_outputs(getattr(torch, dtype)), kernels, strict=True):
            assert torch.equal(got, ref)
        monkeypatch.undo()
        if step_kernel.bf16_dot():
            _use(monkeypatch, step=_widths(("-mno-avx512bf16",))[0])


def _pairs_reference(x, w):
    """x [T, n] @ w [R, n].T of bf16 values in the pair order (prefill_bf16dot.h), op by op in
    fp32 torch: per 32-column block each of 16 lanes adds the product of columns 2i + 1, then
    of 2i (bf16 products are exact in fp32, so an add is one rounding, as fmaf); the lanes
    summed pairwise (s[j] += s[j + w] for w = 8, 4, 2, 1), the tail added column by column."""
    xf, wf = x.float(), w.float()
    (T, n), R = xf.shape, wf.shape[0]
    acc, full = torch.zeros(T, R, 16), n // 32 * 32
    for c in range(0, full, 32):
        xb, wb = xf[:, c : c + 32].reshape(T, 1, 16, 2), wf[:, c : c + 32].reshape(1, R, 16, 2)
        acc = acc + xb[..., 1] * wb[..., 1]
        acc = acc + xb[..., 0] * wb[..., 0]
    for half in (8, 4, 2, 1):
        acc = acc[..., :half] + acc[..., half : 2 * half]
    v = acc[..., 0]
    for k in range(full, n):
        v = v + xf[:, k : k + 1] * wf[:, k].reshape(1, R)
    return v


@pytest.mark.parametrize("shape", [(13, 70, 1100), (1, 5, 64), (7, 9, 48), (6, 4, 2048)])
def test_bf16_dot_products_follow_the_pair_order(shape):
    """On a CPU with bf16 dot products the bf16 experts' many-token tiles (VDPBF16PS; every
    tile shape, the rows past the last tile, 32-column blocks and tails) give the pair order's
    values bit for bit, computed op by op in torch."""
    if not step_kernel.bf16_dot():
        pytest.skip("no bf16 dot products on this CPU (the tiles widen bf16 for fp32 FMAs)")
    T, R, n = shape
    g = torch.Generator().manual_seed(n)
    w = (torch.randn(R, n, generator=g) / 30).bfloat16()
    x = torch.randn(T, n, generator=g).bfloat16().float()
    y = torch.full((T, R), float("nan"))
    lib = step_kernel.library()
    assert lib.reap_linear_pairs(x.data_ptr(), w.data_ptr(), y.data_ptr(), T, R, n) == 1
    assert torch.equal(y, _pairs_reference(x, w))


def test_native_decode_declines_what_it_does_not_reproduce(models, tmp_path, monkeypatch):
    """Attention biases (no `native_layer`) and fp32 weights computed in bf16 (torch rounds
    each weight first) run the torch path; so do multi-token chunks and routers choosing more
    experts per token than the kernels hold."""
    biased = R.with_config(models["qwen3_moe", "float32"], tmp_path / "b", attention_bias=True)
    with Engine.open(models["qwen3_moe", "float32"], preset="max", context=16) as eng:
        assert eng._native.usable([[1]]) and not eng._native.usable([[1, 2]])
    with Engine.open(models["qwen3_moe", "float32"], preset="max", context=16,
                     dtype="bfloat16") as eng:  # fmt: skip
        assert not eng._native.usable([[1]])
    with Engine.open(models["qwen3_moe", "bfloat16"], preset="max", context=16,
                     dtype="float32") as eng:  # fmt: skip
        assert eng._native.usable([[1]])  # bf16 weights widen exactly
    monkeypatch.setattr(step_kernel, "MAX_TOP_K", 2)  # more routed experts than the C arrays
    with Engine.open(models["qwen3_moe", "float32"], preset="max", context=16) as eng:
        assert not eng._native.usable([[1]])
    assert _declines_bias(biased)


def _declines_bias(path) -> bool:
    """A config with attention biases but no bias tensors fails to bind: check the family's
    answer directly."""
    from reap.models.qwen3_moe import Config, Model

    cfg = Config.from_dict(json.loads((Path(path) / "config.json").read_text()))
    return Model(cfg).native_layer(0) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_row_products_use_the_tiles_and_do_not_depend_on_the_rows(dtype, monkeypatch):
    """Prefill projections (`blocks.linear` inside the engine): more rows than the few-row
    kernel takes run the step library's tiles (any number in fp32, up to BF16_ROWS in bf16;
    torch's bf16 matmul above), within rounding of torch's matmul, and each row's result is
    the same bit for bit alone, among a few rows (the few-row kernel) or among many (tiles)."""
    from reap.quant import dense_kernel

    g = torch.Generator().manual_seed(3)
    w = (torch.randn(70, 1100, generator=g) / 30).to(dtype)  # 70 rows: a 32-row block's tail
    if dtype == torch.bfloat16:  # as on a CPU with bf16 dot products (else: every size)
        monkeypatch.setattr(step_kernel, "BF16_ROWS", 16)
    many = 200 if dtype == torch.float32 else step_kernel.BF16_ROWS
    x = torch.randn(many, 1100, generator=g).to(dtype)
    with dense_kernel.enabled():
        assert dense_kernel.usable(x, w)
        if dtype == torch.bfloat16:
            assert not dense_kernel.usable(torch.zeros(many + 1, 1100, dtype=dtype), w)
        y = dense_kernel.dense_linear(x, w)
        few = dense_kernel.dense_linear(x[:5], w)
        one = dense_kernel.dense_linear(x[many - 3 : many - 2], w)
    ref = x.float() @ w.float().T
    tol = 1e-5 if dtype == torch.float32 else 2.0**-7
    assert (y.float() - ref).abs().max() <= tol * ref.abs().max()
    assert torch.equal(few, y[:5]) and torch.equal(one[0], y[many - 3])


def test_bf16_products_go_to_torch_above_a_few_rows_only_with_bf16_dot_products(monkeypatch):
    from reap.quant import ckernel

    monkeypatch.setattr(ckernel, "machine_tag", lambda: "x86_64 avx2 avx512_bf16 avx512f fma")
    assert step_kernel.bf16_dot()
    monkeypatch.setattr(ckernel, "machine_tag", lambda: "x86_64 avx avx2 f16c fma")
    assert not step_kernel.bf16_dot()
    monkeypatch.undo()
    assert step_kernel.BF16_ROWS == (16 if step_kernel.bf16_dot() else 1 << 40)


def test_the_pool_serves_callers_on_several_threads():
    """Products asked from several Python threads at once (the pool runs one job at a time;
    the others run on their own thread): every result equals the same product alone."""
    from concurrent.futures import ThreadPoolExecutor

    from reap.quant import dense_kernel

    g = torch.Generator().manual_seed(5)
    ws = [torch.randn(300, 256, generator=g) for _ in range(6)]
    x = torch.randn(40, 256, generator=g)
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with dense_kernel.enabled():
            alone = [dense_kernel.dense_linear(x, w) for w in ws]
            with ThreadPoolExecutor(6) as pool:
                for _ in range(20):
                    got = list(pool.map(lambda w: dense_kernel.dense_linear(x, w), ws))
                    assert all(torch.equal(a, b) for a, b in zip(got, alone))
    finally:
        torch.set_num_threads(saved)
