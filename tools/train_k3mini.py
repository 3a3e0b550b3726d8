"""Train k3-mini, reap's bundled default model: a small Kimi K3 (KDA + gated NoPE MLA, LatentMoE
with sigmoid routing, shared experts, dense layer 0, AttnRes) trained on CPU on the train splits
of the shipped corpora, finished quantization-aware and exported with MXFP4 routed experts in the
released checkpoint layout.

The forward pass is the engine's own: `reap.models.kimi_k3.family.Model` driven through the weight
getter, with weights held as float32 tensors that autograd trains. Routed experts are stacked per
layer ([E, F, Dl] etc.) and handed to the model one expert at a time through an ExpertSource;
load balancing is aux-loss-free (the router's `e_score_correction_bias` is nudged after every step
by +/- gamma toward uniform load). The last `--qat` fraction of steps sees MXFP4 fake-quantized
experts (straight-through gradient).

    python -m tools.train_k3mini --run DIR           # starts, or resumes from DIR
    python -m tools.export_k3mini --run DIR --out reap/models/k3mini  # the shipped model

A run directory holds `tokenizer.json`, tokenized train data (`data/*.npy`), `ckpt/` (params,
AdamW state as safetensors, step state as JSON; replaced atomically every few minutes) and
`log.jsonl`. Only train splits are read for training; eval splits only measure held-out loss.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

from reap.models import builtin_config
from reap.models.base import dict_weights
from reap.models.kimi_k3 import family as kimi_k3
from reap.quant import mxfp4
from reap.tokenizer import EOS_TOKEN as EOS
from reap.tokenizer import byte_tokenizer_files

# domain -> sampling weight (mix corpora spread it equally over their parts)
DOMAINS = {"zh": 1.0, "en": 1.0, "eu": 1.5, "ja": 1.0, "code": 1.5}
SHAPE = {
    "vocab_size": 4096,
    "hidden_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 384,
    "attn_res_block_size": 2,
    "q_lora_rank": 64,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "num_experts": 64,
    "num_experts_per_token": 6,
    "num_shared_experts": 2,
    "moe_intermediate_size": 64,
    "routed_expert_hidden_size": 64,
}
KDA = {"num_heads": 4, "head_dim": 32}


# -- config ------------------------------------------------------------------------------------
def mini_config(vocab_size: int, eos_id: int) -> dict:
    """The k3-mini config.json dict: k3-tiny's K3 settings at k3-mini widths (MLA at one-based
    layers 4, 8, ... and the last, KDA elsewhere)."""
    cfgd = builtin_config("k3-tiny")
    text = cfgd["text_config"]
    text.update(SHAPE, vocab_size=vocab_size, bos_token_id=eos_id, eos_token_id=eos_id)
    n = SHAPE["num_hidden_layers"]
    mla = sorted(set(range(4, n + 1, 4)) | {n})
    text["linear_attn_config"].update(
        KDA, kda_layers=[j for j in range(1, n + 1) if j not in mla], full_attn_layers=mla
    )
    text["torch_dtype"] = "bfloat16"
    return cfgd


# -- tokenizer and data ------------------------------------------------------------------------
def leaves(domain: str) -> list[str]:
    """The shipped leaf corpora of a domain (a mix corpus's parts, else itself)."""
    from reap.corpora import corpus_info

    return list(corpus_info(domain).mix) or [domain]


def train_tokenizer(path: Path, vocab_size: int, budget: int = 3_000_000) -> None:
    """Byte-level BPE trained on up to `budget` UTF-8 bytes of train text per domain (split
    equally over its parts), saved as tokenizer.json + tokenizer_config.json in `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from reap.corpora import load_documents

    def texts():
        for d in DOMAINS:
            parts = leaves(d)
            for leaf in parts:
                left = budget // len(parts)
                for doc in load_documents(leaf, "train"):
                    if left <= 0:
                        break
                    left -= len(doc.text.encode())
                    yield doc.text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer)
    config = byte_tokenizer_files()["tokenizer_config.json"]  # same special tokens and settings
    _atomic_write(path / "tokenizer.json", tok.to_str().encode())
    _atomic_write(path / "tokenizer_config.json", config.encode())


def tokenize_train(run: Path, tok) -> dict[str, np.ndarray]:
    """Each leaf corpus's train split as one token stream (eos after every document), cached in
    `run/data/<leaf>.npy` (uint16)."""
    from reap.corpora import load_documents

    out = {}
    (run / "data").mkdir(exist_ok=True)
    for d in DOMAINS:
        for leaf in leaves(d):
            f = run / "data" / f"{leaf}.npy"
            if not f.is_file():
                docs = load_documents(leaf, "train")
                ids = [i for doc in docs for i in [*tok.encode(doc.text), tok.eos_id]]
                tmp = f.with_suffix(".tmp.npy")
                np.save(tmp, np.asarray(ids, dtype=np.uint16))
                os.replace(tmp, f)
            out[leaf] = np.load(f)
    return out


def batch_plan(batch: int) -> list[str]:
    """Leaf corpus of each row of a batch: domains by weight, parts equally (exact counts)."""
    from fractions import Fraction

    from reap.corpora import allocate

    slots = [
        (leaf, Fraction(str(w)) / len(leaves(d))) for d, w in DOMAINS.items() for leaf in leaves(d)
    ]
    counts = allocate(batch, [w for _, w in slots])
    return [leaf for (leaf, _), c in zip(slots, counts) for _ in range(c)]


def draw_batch(streams: dict[str, np.ndarray], plan: list[str], seq: int, seed: int, step: int):
    """Random windows of seq+1 tokens, row r from corpus plan[r]; a pure function of (seed,
    step) so a resumed run sees the same data. Returns ids [B, seq+1] int64."""
    g = np.random.default_rng([seed, step])
    rows = []
    for leaf in plan:
        s = streams[leaf]
        start = int(g.integers(0, len(s) - seq - 1))
        rows.append(s[start : start + seq + 1].astype(np.int64))
    return torch.from_numpy(np.stack(rows))


def eval_batches(tok, seq: int, n_seq: int) -> dict[str, torch.Tensor]:
    """Held-out eval sequences per domain: {domain: ids [n_seq, seq+1]} (eval split)."""
    from reap.corpora import sample_sequences

    return {
        d: torch.tensor(
            [s.ids for s in sample_sequences(d, "eval", tok, n_seq * (seq + 1), seq + 1, seed=0)]
        )
        for d in DOMAINS
    }


# -- parameters --------------------------------------------------------------------------------
def expert_names(layer: int) -> dict[str, str]:
    """Stacked routed-expert parameter names of a MoE layer (training-time only)."""
    return {w: f"model.layers.{layer}.block_sparse_moe.experts.{w}" for w in ("w1", "w2", "w3")}


def init_params(cfgd: dict, seed: int) -> dict[str, torch.Tensor]:
    """float32 training parameters: every non-expert tensor of the layout, plus each MoE
    layer's routed experts stacked as w1/w3 [E, F, Dl] and w2 [E, Dl, F]."""
    cfg = kimi_k3.Config.from_dict(cfgd)
    g = torch.Generator().manual_seed(seed)
    out_scale = 1 / math.sqrt(2 * cfg.num_hidden_layers)
    params = {}
    for s in kimi_k3.layout(cfgd):
        if s.expert is None:
            params[s.name] = _init_tensor(s.name, tuple(s.shape), cfg, g, out_scale)
    E, Fe, Dl = cfg.num_experts, cfg.moe_intermediate_size, cfg.latent
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe(i):
            n = expert_names(i)
            params[n["w1"]] = torch.randn(E, Fe, Dl, generator=g) / math.sqrt(Dl)
            params[n["w3"]] = torch.randn(E, Fe, Dl, generator=g) / math.sqrt(Dl)
            params[n["w2"]] = torch.randn(E, Dl, Fe, generator=g) * out_scale / math.sqrt(Fe)
    return params


def _init_tensor(name: str, shape: tuple, cfg, g, out_scale: float) -> torch.Tensor:
    leaf = name.rsplit(".", 2)
    last = leaf[-2] if leaf[-1] == "weight" else leaf[-1]
    if last == "A_log":  # decay rates exp(A) in [1, 16] for the real heads, zero padding
        a = torch.zeros(shape)
        a[: cfg.kda_heads] = torch.log(1 + 15 * torch.rand(cfg.kda_heads, generator=g))
        return a
    if last == "dt_bias":
        return -0.5 + 0.3 * torch.randn(shape, generator=g)
    if last.endswith(("correction_bias", "res_proj")):
        return torch.zeros(shape)  # AttnRes starts as a uniform mix
    if "norm" in last or last.endswith("layernorm"):
        return torch.ones(shape)
    if last.endswith("conv1d"):
        return torch.randn(shape, generator=g) / math.sqrt(shape[-1])
    if last == "embed_tokens":
        return torch.randn(shape, generator=g)
    std = 1 / math.sqrt(shape[-1])
    if last in ("o_proj", "down_proj", "routed_expert_up_proj"):
        std *= out_scale
    if last == "f_b_proj":  # keep the decay input small so dt_bias sets the decay range
        std *= 0.3
    return torch.randn(shape, generator=g) * std


def trainable(name: str) -> bool:
    return not name.endswith("e_score_correction_bias")


def decays(name: str, t: torch.Tensor) -> bool:
    """Weight decay on matrices only (not on norms, biases, decay parameters or conv taps)."""
    return t.dim() >= 2 and not name.endswith("conv1d.weight")


# -- the model step ----------------------------------------------------------------------------
class LoadCounter:
    """Observer counting, per MoE layer, how many tokens each expert received."""

    wants_norms = False

    def __init__(self, n_experts: int):
        self.n, self.counts = n_experts, {}

    def on_moe(self, record) -> None:
        c = torch.bincount(record.ids.reshape(-1), minlength=self.n)  # [E]
        self.counts[record.layer] = self.counts.get(record.layer, 0) + c


def expert_source(params: dict, qat: bool):
    """ExpertSource over the stacked expert parameters (MXFP4 fake-quantized when `qat`): each
    layer's stacks are (fake-quantized and) unbound once per forward, so the backward pass
    stacks the per-expert gradients in one go."""
    cache: dict[int, dict[str, tuple]] = {}

    def source(layer: int, expert: int) -> dict[str, torch.Tensor]:
        if layer not in cache:
            ws = {w: params[n] for w, n in expert_names(layer).items()}
            if qat:
                ws = {w: mxfp4.fake_quant(t) for w, t in ws.items()}
            cache[layer] = {w: t.unbind(0) for w, t in ws.items()}  # E x [F, Dl] etc.
        return {f"{w}.weight": t[expert] for w, t in cache[layer].items()}

    return source


def seq_losses(model, params: dict, ids: torch.Tensor, qat: bool, observer=None) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of each row: ids [B, T+1] -> [B]."""
    logits = model.forward(
        dict_weights(params), ids[:, :-1], experts=expert_source(params, qat), observer=observer
    )  # [B, T, V]
    nll = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), ids[:, 1:].reshape(-1), reduction="none"
    )
    return nll.view(ids.shape[0], -1).mean(1)


def balance(params: dict, counter: LoadCounter, gamma: float) -> float:
    """Nudge each MoE layer's correction bias by gamma toward uniform load; returns the worst
    max/mean load ratio of this step."""
    worst = 0.0
    for layer, c in counter.counts.items():
        c = c.float()
        bias = params[f"model.layers.{layer}.block_sparse_moe.gate.e_score_correction_bias"]
        bias += gamma * torch.sign(c.mean() - c)
        worst = max(worst, float(c.max() / c.mean()))
    return worst


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10 % of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, p))))


@torch.no_grad()
def evaluate(model, params: dict, batches: dict[str, torch.Tensor], qat: bool) -> dict:
    """Held-out loss per domain (nats/token)."""
    return {d: float(seq_losses(model, params, ids, qat).mean()) for d, ids in batches.items()}


# -- checkpoints -------------------------------------------------------------------------------
def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def save_ckpt(run: Path, params: dict, opt: torch.optim.Optimizer, state: dict) -> None:
    """params and AdamW moments as safetensors, the rest as JSON; the whole `ckpt/` directory
    is replaced atomically (written as ckpt.tmp/, then renamed)."""
    from safetensors.torch import save_file

    tmp, final = run / "ckpt.tmp", run / "ckpt"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({n: t.detach().contiguous() for n, t in params.items()}, tmp / "params.safetensors")
    moments, steps = {}, {}
    names = {id(t): n for n, t in params.items()}
    for p, st in opt.state.items():
        n = names[id(p)]
        moments[n + "::exp_avg"], moments[n + "::exp_avg_sq"] = st["exp_avg"], st["exp_avg_sq"]
        steps[n] = float(st["step"])
    save_file(moments, tmp / "adamw.safetensors")
    (tmp / "state.json").write_text(json.dumps({**state, "adamw_steps": steps}, indent=1))
    old = run / "ckpt.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def load_ckpt(run: Path) -> tuple[dict, dict, dict] | None:
    """(params, adamw moments, state) of the run's last checkpoint, or None."""
    from safetensors.torch import load_file

    ck = run / "ckpt"
    if not (ck / "state.json").is_file():
        return None
    state = json.loads((ck / "state.json").read_text())
    return load_file(ck / "params.safetensors"), load_file(ck / "adamw.safetensors"), state


def make_optimizer(params: dict, moments: dict | None, steps: dict | None, wd: float):
    """AdamW over the trainable tensors (decay on matrices), restoring saved moments."""
    groups = [
        {
            "params": [t for n, t in params.items() if trainable(n) and decays(n, t)],
            "weight_decay": wd,
        },
        {
            "params": [t for n, t in params.items() if trainable(n) and not decays(n, t)],
            "weight_decay": 0.0,
        },
    ]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    for n, t in params.items():
        if moments is not None and n + "::exp_avg" in moments:
            opt.state[t] = {
                "step": torch.tensor(steps[n]),
                "exp_avg": moments[n + "::exp_avg"],
                "exp_avg_sq": moments[n + "::exp_avg_sq"],
            }
    return opt


# -- training ----------------------------------------------------------------------------------
def setup(run: Path, vocab_size: int):
    """Tokenizer (trained once), config and tokenized train streams of a run directory."""
    from reap.tokenizer import load_tokenizer

    run.mkdir(parents=True, exist_ok=True)
    if not (run / "tokenizer.json").is_file():
        t0 = time.time()
        train_tokenizer(run, vocab_size)
        print(f"tokenizer trained in {time.time() - t0:.0f}s", flush=True)
    tok = load_tokenizer(run)
    cfgd = mini_config(tok.vocab_size, tok.eos_id)
    return tok, cfgd


def train(args: argparse.Namespace) -> int:
    """Train (or resume) until `args.steps` steps; checkpoints every `args.ckpt_minutes`."""
    torch.set_num_threads(args.threads)
    run = Path(args.run)
    tok, cfgd = setup(run, args.vocab)
    streams = tokenize_train(run, tok)
    print({k: len(v) for k, v in streams.items()}, flush=True)
    model = kimi_k3.Model(kimi_k3.Config.from_dict(cfgd))
    evals = eval_batches(tok, args.seq, args.eval_seqs)
    loaded = load_ckpt(run)
    if loaded is None:
        params, moments, state = (
            init_params(cfgd, args.seed),
            None,
            {"step": 0, "tokens": 0, "seconds": 0.0},
        )
    else:
        params, moments, state = loaded
        print(f"resuming at step {state['step']}", flush=True)
    for n, t in params.items():
        t.requires_grad_(trainable(n))
    opt = make_optimizer(params, moments, state.get("adamw_steps"), args.wd)
    state.update(config=cfgd, args=vars(args))
    _train_loop(run, model, params, opt, state, streams, evals, args)
    return 0


def _train_step(model, params, opt, ids, qat: bool, lr: float, args) -> tuple:
    """One AdamW step on ids [B, T+1], then the bias nudge; returns (per-row losses [B],
    gradient norm, worst max/mean expert load)."""
    for gr in opt.param_groups:
        gr["lr"] = lr
    counter = LoadCounter(model.cfg.num_experts)
    losses = seq_losses(model, params, ids, qat, counter)  # [B]
    opt.zero_grad(set_to_none=True)
    losses.mean().backward()
    trained = [t for t in params.values() if t.requires_grad]
    gnorm = float(torch.nn.utils.clip_grad_norm_(trained, args.clip))
    opt.step()
    with torch.no_grad():
        imbalance = balance(params, counter, args.gamma)
    return losses.detach(), gnorm, imbalance


def _train_loop(run, model, params, opt, state, streams, evals, args) -> None:
    stop = {"flag": False}
    for sig in (signal.SIGTERM, signal.SIGINT):  # finish the step, checkpoint, exit
        signal.signal(sig, lambda *_: stop.update(flag=True))
    plan = batch_plan(args.batch)
    domain_of = {leaf: d for d in DOMAINS for leaf in leaves(d)}
    qat_from = int(args.steps * (1 - args.qat))
    last_save, window = time.time(), []
    log = open(run / "log.jsonl", "a")  # noqa: SIM115
    while state["step"] < args.steps and not stop["flag"]:
        step, t0 = state["step"], time.time()
        qat, lr = step >= qat_from, lr_at(step, args.steps, args.lr, args.warmup)
        ids = draw_batch(streams, plan, args.seq, args.seed, step)
        losses, gnorm, imbalance = _train_step(model, params, opt, ids, qat, lr, args)
        dt = time.time() - t0
        state.update(
            step=step + 1,
            tokens=state["tokens"] + ids[:, 1:].numel(),
            seconds=state["seconds"] + dt,
        )
        per = {}
        for leaf, v in zip(plan, losses.tolist()):
            per.setdefault(domain_of[leaf], []).append(v)
        window.append(
            {
                "loss": float(losses.mean()),
                "gnorm": gnorm,
                "imbalance": imbalance,
                "dt": dt,
                **{d: sum(v) / len(v) for d, v in per.items()},
            }
        )
        last = state["step"] == args.steps
        if state["step"] % args.log_every == 0 or last:
            rec = _summarize(window, state, lr, qat, args)
            if state["step"] % args.eval_every == 0 or last:
                ev = evaluate(model, params, evals, qat)
                rec["eval"] = {d: round(v, 4) for d, v in ev.items()}
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(json.dumps(rec), flush=True)
            window = []
        if time.time() - last_save > args.ckpt_minutes * 60 or last:
            save_ckpt(run, params, opt, state)
            last_save = time.time()
    if stop["flag"]:
        save_ckpt(run, params, opt, state)
        print(f"stopped at step {state['step']}; checkpoint saved", flush=True)
    log.close()


def _summarize(window: list[dict], state: dict, lr: float, qat: bool, args) -> dict:
    keys = {k for w in window for k in w}
    mean = {k: sum(w[k] for w in window if k in w) / sum(k in w for w in window) for k in keys}
    tps = args.batch * args.seq * len(window) / sum(w["dt"] for w in window)
    rec = {
        "step": state["step"],
        "tokens": state["tokens"],
        "seconds": round(state["seconds"]),
        "lr": lr,
        "qat": qat,
        "tok_per_s": round(tps),
    }
    rec["train"] = {d: round(mean[d], 4) for d in DOMAINS if d in mean}
    rec.update({k: round(mean[k], 4) for k in ("loss", "gnorm", "imbalance")})
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.train_k3mini", description=__doc__.splitlines()[0]
    )
    p.add_argument("--run", default="/work/k3mini-run", help="run directory")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 on a busy machine)")
    p.add_argument("--vocab", type=int, default=SHAPE["vocab_size"], help="BPE vocabulary")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    p.add_argument("--eval-seqs", type=int, default=8, help="held-out sequences per domain")
    p.add_argument("--steps", type=int, default=1250)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--gamma", type=float, default=1e-2, help="bias balancing step")
    p.add_argument("--qat", type=float, default=0.15, help="final fraction of steps with QAT")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--ckpt-minutes", type=float, default=4.0)
    return train(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
