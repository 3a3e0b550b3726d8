"""Shared test runner for the model families (issue #8): tiny random models created and saved
offline by `transformers`, then checked against it from every stage.

    path, hf = save_hf_tiny(Qwen3MoeForCausalLM, Qwen3MoeConfig, KWARGS, tmp / "m", seed=0)
    check_logits(path, hf, PROMPT)          # our Model on Checkpoint.open weights == transformers
    check_mlx(path, PROMPT)                 # == mlx-lm on the same files (where it has the family)
    check_engine(path, hf, PROMPT)          # the streaming engine: logits and greedy tokens
    check_prune(path, tmp / "p", keep=5)    # prune -> same layout -> from_pretrained == engine
    check_calibration(path, hf, tmp / "c")  # calibration statistics == forward hooks on hf

Every check returns what it measured (worst differences, tokens) for the caller to report.
Everything runs in float32 on the CPU in seconds for hidden sizes of 64. Families that store
experts fused (X [E, ...] read through views `X[e]`, GPT-OSS) and sigmoid routers with a
selection bias (DeepSeek-V3, Kimi Linear: `probs_fn=sigmoid_probs`) go through the same checks;
`for_mlx` makes the copy mlx-lm reads where it differs (older rope keys, an untied head).
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import numpy as np
import torch

ATOL = 1e-4  # float32 logits of magnitude ~1-5: measured differences are ~1e-6
# the tiny Qwen3-MoE and calibration of tests/test_merge.py (also experiments/cerebras_merge_check)
MERGE_QWEN = {
    "vocab_size": 320, "hidden_size": 48, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}  # fmt: skip
MERGE_TOKENS, MERGE_SEQ = 256, 32


# -- building tiny models ----------------------------------------------------------------------
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every parameter so logits and routing have clear margins: matrices (and stacked
    3D expert tensors) ~ N(0, 1/fan_in), norm weights 1 + N(0, 0.1), other vectors N(0, 0.1);
    also the routers' selection bias (the `e_score_correction_bias` buffer of sigmoid routers,
    which transformers leaves at zero) ~ U(0, 0.1), so that selection and weights differ."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            r = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.dim() >= 2:
                p.copy_(r * p.shape[-1] ** -0.5)
            elif "norm" in name:
                p.copy_(1 + 0.1 * r)
            else:
                p.copy_(0.1 * r)
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.rand(b.shape, generator=gen, dtype=torch.float32))


def save_hf_tiny(
    model_cls,
    config_cls,
    kwargs: dict,
    path: str | os.PathLike,
    seed: int = 0,
    config_extra: dict | None = None,
    tokenizer: bool = True,
    max_shard_size: str | None = None,
):
    """Create `model_cls(config_cls(**kwargs))` in float32 with random weights (see `randomize`),
    save it with `save_pretrained` and return (path, the model in eval mode). `config_extra`
    keys are merged into the saved config.json (e.g. the older key names released checkpoints
    carry); `tokenizer` adds reap's byte-level tokenizer files (needs vocab_size >= 257);
    `max_shard_size` (e.g. "100KB") saves several shards and an index, as released models are."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).float().eval()
    randomize(model, seed)
    path = Path(path)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if config_extra:
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, **config_extra}, indent=2))
    if tokenizer:
        from reap.tokenizer import byte_tokenizer_files

        for name, text in byte_tokenizer_files().items():
            (path / name).write_text(text)
    return str(path), model


def with_config(path, out, **changes) -> str:
    """A copy of checkpoint `path` at `out` with config.json keys changed (None deletes one)."""
    import shutil

    shutil.copytree(path, out)
    cfg = json.loads((Path(out) / "config.json").read_text())
    for key, value in changes.items():  # keys the source sets to null stay
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (Path(out) / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(out)


def with_release_keys(config: dict) -> dict:
    """A tiny hand-written `config` (bare or with `text_config`) plus each key its family requires
    (`Config.REQUIRED`: every release carries it) that it lacks, at the value reap assumed before
    those keys became required (the field's default)."""
    import dataclasses

    from reap.models import family

    cls, text = family(config).Config, dict(config.get("text_config", config))
    fields = {f.name: f for f in dataclasses.fields(cls)}
    rope = fields["rope"].default if "rope" in fields else (None, None)  # gpt_oss keeps a pair
    for names in cls.REQUIRED:
        name = names if isinstance(names, str) else names[0]
        if any(n in text for n in ((names,) if isinstance(names, str) else names)):
            continue
        f = fields.get(name)
        if f is None:
            text[name] = rope[0] if name == "rope_theta" else rope[1]
        elif f.default is dataclasses.MISSING:
            text[name] = f.default_factory()
        else:
            text[name] = f.default
    return {**config, "text_config": text} if "text_config" in config else text


def load_hf(path: str | os.PathLike):
    """`AutoModelForCausalLM.from_pretrained(path)` in float32, eval mode."""
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def read_layout(ck, fam) -> dict[str, torch.Tensor]:
    """Every tensor of the family's layout read from open checkpoint `ck`, after checking that
    the layout covers the stored tensors exactly: each stored name once, or a fused tensor
    X [E, ...] through its views X[0] .. X[E-1] (one per expert), with the layout's shapes."""
    from reap.checkpoint.spec import split_view

    layout = {s.name: s for s in fam.layout(ck.config)}
    views: dict[str, list] = {}  # stored name -> the slice ids the layout names (None: whole)
    for name in layout:
        base, index = split_view(name)
        views.setdefault(base, []).append(index)
    assert set(views) == set(ck.tensors), sorted(set(views) ^ set(ck.tensors))[:5]
    for base, ids in views.items():
        whole = ids == [None]
        assert whole or sorted(ids) == list(range(ck.tensors[base].shape[0])), (base, ids)
    weights = {n: ck.read(n) for n in layout}
    for n, t in weights.items():
        assert tuple(t.shape) == layout[n].shape, (n, t.shape, layout[n].shape)
    return weights


def load_ours(path: str | os.PathLike):
    """(family module, Config, Model, weight getter) over every tensor of `path`, read through
    `Checkpoint.open` (the layout must cover each stored tensor exactly, see `read_layout`)."""
    from reap.checkpoint import Checkpoint
    from reap.models import family
    from reap.models.base import dict_weights

    with Checkpoint.open(path) as ck:
        fam = family(ck.config)
        cfg = fam.Config.from_dict(ck.config)
        weights = read_layout(ck, fam)
    return fam, cfg, fam.Model(cfg), dict_weights(weights)


# -- logits ------------------------------------------------------------------------------------
def greedy(step, ids: list[int], steps: int) -> tuple[list[np.ndarray], list[int]]:
    """Prefill `ids` then `steps` greedy decode steps through `step(ids [1, T]) -> logits [T, V]`
    (a model call that keeps its own cache): ([prefill [T, V], step 1 [1, V], ...], greedy
    tokens (steps + 1))."""
    logits = [step([ids])]
    tokens = [int(logits[-1][-1].argmax())]
    for _ in range(steps):
        logits.append(step([[tokens[-1]]]))
        tokens.append(int(logits[-1][-1].argmax()))
    return logits, tokens


def hf_greedy(hf, ids: list[int], steps: int) -> tuple[list[np.ndarray], list[int]]:
    """`greedy` through transformers and its KV cache."""
    cache = {}

    def step(x):
        with torch.no_grad():
            out = hf(input_ids=torch.tensor(x), use_cache=True, **cache)
        cache["cache"] = out.past_key_values
        return out.logits[0].numpy()

    return greedy(step, ids, steps)


def ours_greedy(path, ids: list[int], steps: int) -> tuple[list[np.ndarray], list[int]]:
    """`greedy` through our Model, its own caches and weights from `Checkpoint.open`."""
    _, _, model, get = load_ours(path)
    caches = model.new_caches()
    return greedy(lambda x: model.forward(get, torch.tensor(x), caches)[0].numpy(), ids, steps)


def _agree(got: tuple, ref: tuple, atol: float) -> float:
    """Two `greedy` runs: the same tokens and logits within `atol`; returns the worst
    absolute logit difference."""
    (logits, tokens), (ref_logits, ref_tokens) = got, ref
    assert [x.shape for x in logits] == [x.shape for x in ref_logits]
    worst = max(float(np.abs(x - y).max()) for x, y in zip(logits, ref_logits))
    assert worst < atol, worst
    assert tokens == ref_tokens, (tokens, ref_tokens)
    return worst


def check_logits(path, hf, ids: list[int], steps: int = 8, atol: float = ATOL) -> float:
    """Our prefill + `steps` incremental decode steps == transformers' (each side feeding its own
    greedy tokens, which must agree). Returns the worst absolute logit difference."""
    ref = hf_greedy(hf, ids, steps)
    assert np.abs(ref[0][0]).max() > 1  # the oracle's logits are not all near zero
    return _agree(ours_greedy(path, ids, steps), ref, atol)


def prefill_change(path, other, ids: list[int]) -> np.ndarray:
    """Per position, the largest change [T] of our prefill logits between checkpoints `path`
    and `other` (the same weights with a config feature switched): proves a feature matters."""
    a, b = ours_greedy(path, ids, 0)[0][0], ours_greedy(other, ids, 0)[0][0]  # [T, V] each
    return np.abs(a - b).max(-1)


def legacy_rope(config: dict) -> dict:
    """The older rope keys (`rope_theta`, `rope_scaling`; None for plain RoPE) that released
    configs carry and mlx-lm reads, from transformers 5's `rope_parameters`."""
    rope = dict(config["rope_parameters"])
    theta = rope.pop("rope_theta")
    return {"rope_theta": theta, "rope_scaling": None if rope["rope_type"] == "default" else rope}


def for_mlx(path, out, untie: bool = False, **changes) -> str:
    """A copy of checkpoint `path` at `out` as mlx-lm reads it: config.json with `changes` and
    the legacy rope keys; with `untie`, the tied head stored as `lm_head.weight` (a copy of the
    embedding) in an extra shard, for mlx-lm models that always have their own head."""
    from safetensors.torch import save_file

    from reap.checkpoint import Checkpoint

    cfg = {**json.loads((Path(path) / "config.json").read_text()), **changes}
    out = with_config(path, out, **{**legacy_rope(cfg), **changes})
    if untie:
        with Checkpoint.open(path) as ck:
            head = ck.read("model.embed_tokens.weight").clone()
        save_file({"lm_head.weight": head}, str(Path(out) / "model-head.safetensors"))
    return str(out)


def check_mlx(path, ids: list[int], steps: int = 8, atol: float = ATOL, mlx_path=None) -> float:
    """Our prefill + decode on `path` == mlx-lm's implementation loading the same files, or
    `mlx_path` (a copy as mlx-lm reads it, see `for_mlx`) where they must differ."""
    import pytest

    mx = pytest.importorskip("mlx.core")
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    ref_model, _ = load_model(Path(mlx_path or path))
    cache = make_prompt_cache(ref_model)
    ref = greedy(lambda x: np.array(ref_model(mx.array(x), cache=cache))[0], ids, steps)
    return _agree(ours_greedy(path, ids, steps), ref, atol)


def check_engine(path, hf, ids: list[int], steps: int = 8, atol: float = ATOL) -> list[int]:
    """The streaming engine at its smallest preset (layers streamed through a ring, experts read
    on demand) and at its largest with prefill in chunks of 4 tokens: teacher-forced logits ==
    transformers', greedy tokens == transformers' greedy in both. Returns the greedy tokens."""
    from reap.engine import Engine

    ref, ref_tokens = hf_greedy(hf, ids, steps)
    runs = []
    for preset, chunk in (("ultra", None), ("max", 4)):  # 4: prefill continues from the cache
        with Engine.open(
            path, preset=preset, context=64, dtype="float32", prefill_chunk=chunk
        ) as eng:
            assert preset != "ultra" or not eng.plan.pinned  # every layer through the ring
            got = eng.logits([ids])[0].numpy()
            assert float(np.abs(got - ref[0]).max()) < atol
            runs.append(eng.generate([ids], max_tokens=steps + 1)[0].ids)
            eos = eng.tokenizer.eos_id if eng.tokenizer else None
    n = len(runs[0])  # generation ends early if the end-of-text token comes up
    assert runs[0] == runs[1] == ref_tokens[:n], (runs, ref_tokens)
    assert n == steps + 1 or runs[0][-1] == eos
    return runs[0]


# -- pruning -----------------------------------------------------------------------------------
def prune_random(path, out, keep: int, seed: int = 0):
    """A random plan keeping `keep` experts per layer -> `reap.prune` to `out`, whose file bytes
    must be within 0.5% of the plan's size prediction. Returns the plan."""
    from reap.checkpoint import Checkpoint
    from reap.prune.plan import make_plan
    from reap.prune.write import prune

    with Checkpoint.open(path) as ck:
        plan = make_plan(
            config=ck.config, model=ck.fingerprint(), criterion="random", keep=keep, seed=seed
        )
    r = prune(model=str(path), plan=plan, out=str(out))
    assert abs(r.file_bytes / plan.predicted_bytes - 1) < 5e-3, (r.file_bytes, plan.predicted_bytes)
    return plan


def check_prune(path, out, keep: int, seed: int = 0, atol: float = ATOL) -> str:
    """`prune_random` then `check_pruned`. Returns the pruned path."""
    check_pruned(path, out, prune_random(path, out, keep, seed), seed, atol)
    return str(out)


def check_pruned(src, out, plan, seed: int = 0, atol: float = ATOL) -> None:
    """Pruned checkpoint `out` of `src` under `plan`: `check_pruned_layout`, and
    `from_pretrained` on it gives the logits of our engine on it (12 random tokens)."""
    from reap.engine import Engine

    check_pruned_layout(src, out, plan)
    ids = [random.Random(seed).randrange(1, 200) for _ in range(12)]
    with torch.no_grad():
        ref = load_hf(out)(input_ids=torch.tensor([ids])).logits[0].numpy()
    with Engine.open(out, preset="ultra", context=64, dtype="float32") as eng:
        got = eng.logits([ids])[0].numpy()
    worst = float(np.abs(got - ref).max())
    assert worst < atol, worst


def check_pruned_layout(src, out, plan) -> None:
    """`out` has the source's layout for the kept counts (the layout names of `src` with expert
    ids below the layer's count, covering the stored tensors exactly: per-expert tensors or
    fused X [n_kept, ...]); router rows are the source's kept rows; kept expert j of a layer is
    byte for byte (same dtype) the source's expert keep[j]; everything else is unchanged."""
    from reap.checkpoint import Checkpoint
    from reap.models import family

    with Checkpoint.open(src) as a, Checkpoint.open(out) as b:
        fam = family(a.config)
        cfg = fam.Config.from_dict(a.config)
        old, new = read_layout(a, fam), read_layout(b, family(b.config))
        want = {n for n in old if (k := fam.expert_key(n)) is None or k[1] < plan.counts[k[0]]}
        assert set(new) == want, sorted(set(new) ^ want)[:5]
        expect = {}  # name -> the source tensor it must equal, where not the same name
        for layer in plan.layers:
            rows = torch.tensor(plan.keep[layer])
            for name, axis in fam.router_tensors(cfg, layer).items():
                expect[name] = old[name].index_select(axis, rows)
            for j, e in enumerate(plan.keep[layer]):
                kept = fam.expert_tensor_names(cfg, layer, j), fam.expert_tensor_names(cfg, layer, e)
                expect.update({n: old[o] for n, o in zip(*kept)})
        for name in want:
            assert _same_bytes(new[name], expect.get(name, old[name])), name


def _same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (FP8 and MXFP4 codes have no float equality)."""
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    return torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


# -- calibration -------------------------------------------------------------------------------
def write_corpora(root: str | os.PathLike) -> str:
    """Two small local jsonl corpora (latin text and code); returns the mixture spec."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    spec = []
    for kind in ("prose", "code"):
        rng = random.Random(kind)
        with open(root / f"{kind}.jsonl", "w") as f:
            for i in range(400):
                if kind == "prose":
                    words = [
                        "".join(rng.choice("aeioulmnrst") for _ in range(5)) for _ in range(12)
                    ]
                    text = " ".join(words)
                else:
                    text = f"def f{rng.randrange(99)}(x):\n    return x * {rng.randrange(99)}\n"
                f.write(json.dumps({"id": f"{kind}-{i}", "text": text}) + "\n")
        spec.append(str(root / f"{kind}.jsonl"))
    return "+".join(spec)


def softmax_probs(router_out) -> torch.Tensor:
    """Router probabilities [N, E] from a transformers router's output (logits first)."""
    logits = router_out[0] if isinstance(router_out, tuple) else router_out
    return torch.softmax(logits.float().reshape(-1, logits.shape[-1]), -1)


def sigmoid_probs(router_out) -> torch.Tensor:
    """Router probabilities [N, E] of a sigmoid router (DeepSeek-V3, Kimi Linear): its output
    is (logits, top-k weights, top-k ids)."""
    logits = router_out[0]
    return torch.sigmoid(logits.float().reshape(-1, logits.shape[-1]))


def moe_modules(hf) -> list[tuple[int, torch.nn.Module, torch.nn.Module]]:
    """(layer, router module, experts module) of every MoE block of a transformers model: a
    module with an `experts` child and a `gate` or `router` child."""
    out = []
    for name, m in hf.named_modules():
        router = getattr(m, "gate", None) or getattr(m, "router", None)
        if isinstance(getattr(m, "experts", None), torch.nn.Module) and router is not None:
            out.append((int(re.search(r"layers\.(\d+)", name)[1]), router, m.experts))
    return out


def expert_output(experts: torch.nn.Module, x: torch.Tensor, e: int) -> torch.Tensor:
    """Expert e's raw output on x [M, D]: the experts module with every token routed only to e,
    with weight 1."""
    ids = torch.full((x.shape[0], 1), e, dtype=torch.long)
    return experts(x, ids, torch.ones(x.shape[0], 1, dtype=x.dtype))


def hooked_stats(hf, ids: torch.Tensor, probs_fn=softmax_probs, expert_fn=expert_output) -> dict:
    """Brute-force REAP statistics of one transformers forward over ids [S, T]: hooks capture
    each MoE block's router output and the (hidden, ids, weights) its experts module receives;
    each routed expert's output is recomputed by calling the experts module on its tokens.
    Returns {layer: {field: [E] float64}} for count, gate_sum, reap_sum, ean_sum, max_act,
    prob_mass."""
    seen: dict[int, dict] = {}
    handles = []
    for layer, router, experts in moe_modules(hf):
        rec = seen.setdefault(layer, {"experts": experts})

        def on_router(mod, args, out, rec=rec):
            rec["probs"] = probs_fn(out)

        def on_experts(mod, args, kwargs, rec=rec):
            rec["x"], rec["ids"], rec["w"] = (list(args) + list(kwargs.values()))[:3]

        handles.append(router.register_forward_hook(on_router))
        handles.append(experts.register_forward_pre_hook(on_experts, with_kwargs=True))
    try:
        with torch.no_grad():
            hf(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        return {layer: _layer_stats(rec, expert_fn) for layer, rec in sorted(seen.items())}


def _layer_stats(rec: dict, expert_fn) -> dict:
    x, ids, w, probs = rec["x"], rec["ids"], rec["w"].double(), rec["probs"]
    E = probs.shape[-1]
    s = {k: torch.zeros(E, dtype=torch.float64) for k in ("gate_sum", "reap_sum", "ean_sum")}
    s["count"] = torch.bincount(ids.reshape(-1), minlength=E).double()
    s["max_act"] = torch.zeros(E, dtype=torch.float64)
    s["prob_mass"] = probs.double().sum(0)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)  # [M] each
        out = expert_fn(rec["experts"], x[tok], e).double()  # [M, D]
        norm, weight = out.norm(dim=-1), w[tok, slot]
        s["gate_sum"][e] = weight.sum()
        s["reap_sum"][e] = (weight * norm).sum()
        s["ean_sum"][e] = norm.sum()
        s["max_act"][e] = out.abs().max()
    return s


def check_calibration(
    path, hf, out, tokens: int = 256, seq_len: int = 32, probs_fn=softmax_probs, expert_fn=None,
    rtol: float = 2e-4, corpus: str | None = None, **calibrate_args,
) -> dict:  # fmt: skip
    """`reap.calibrate` on `path` (`corpus`, by default two local corpora; `calibrate_args` such
    as max_pass_seqs go to it) == `hooked_stats` on the transformers model over the same sequences, for every MoE
    layer: counts exactly, the sums within `rtol` (atol 1e-4). Returns the brute-force
    statistics; the statistics file is `out`/stats/all.safetensors."""
    from reap.calibrate.pipeline import calibrate
    from reap.corpora import calibration_sequences
    from reap.stats import ExpertStats
    from reap.tokenizer import load_tokenizer

    spec = corpus or write_corpora(Path(out) / "corpora")
    res = calibrate(
        model=str(path), corpus=spec, tokens=tokens, seq_len=seq_len, out=str(Path(out) / "stats"),
        **{"batch": 4, "progress": False, **calibrate_args},
    )  # fmt: skip
    assert Path(res.files["all"]) == Path(out) / "stats" / "all.safetensors"
    seqs = calibration_sequences(spec, load_tokenizer(path), tokens, seq_len, 0)
    ids = torch.tensor([s.ids for s in seqs])  # [S, T]
    want = hooked_stats(hf, ids, probs_fn, expert_fn or expert_output)
    st = ExpertStats.load(res.files["all"])
    assert st.layers == sorted(want) and st.tokens == tokens
    for li, layer in enumerate(st.layers):
        for name, ref in want[layer].items():
            got = getattr(st, name)[li].double()
            exact = name == "count"
            torch.testing.assert_close(
                got, ref, rtol=0 if exact else rtol, atol=0 if exact else 1e-4,
                msg=f"layer {layer} {name}",
            )  # fmt: skip
    return want
