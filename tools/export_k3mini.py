"""Export a k3-mini training run (`tools.train_k3mini`) as reap's bundled default model:
the released K3 layout (`language_model.` prefix, routed experts as MXFP4 `weight_packed` +
`weight_scale`, everything else bf16 with the release's float32 exceptions), written atomically
with `reap.checkpoint.CheckpointWriter`, together with the tokenizer, the training log, a loss
curve PNG and the model card.

    python -m tools.export_k3mini --run /work/k3mini-run --out reap/models/k3mini

Held-out loss (eval splits, never trained on) is measured per domain three ways: the float32
training weights, float32 trunk with MXFP4 experts, and the exported checkpoint as read back
(bf16 trunk, MXFP4 experts); the card and `training_log.json` record all three.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
import time
from pathlib import Path

import torch

from reap.checkpoint import Checkpoint, CheckpointWriter
from reap.models.base import dict_weights
from reap.models.kimi_k3 import family as kimi_k3
from reap.quant import mxfp4
from tools import train_k3mini

_TORCH = {"BF16": torch.bfloat16, "F32": torch.float32, "U8": torch.uint8}
SMOKE = (4, 128)  # sequences x tokens per domain that tests/test_k3mini.py recomputes exactly


def released_tensors(cfgd: dict, params: dict) -> dict[str, torch.Tensor]:
    """Training parameters -> every tensor of the released layout (experts MXFP4-quantized,
    the rest cast to the layout's dtype), keyed by prefix-free name."""
    out = {}
    for s in kimi_k3.layout(cfgd):
        if s.expert is None:
            out[s.name] = params[s.name].detach().to(_TORCH[s.dtype]).contiguous()
            continue
        w, part = s.name.rsplit(".", 2)[-2:]  # "w1", "weight_packed"
        stacked = params[train_k3mini.expert_names(s.layer)[w]]  # [E, out, in]
        packed, scales = mxfp4.quantize(stacked[s.expert].detach())
        out[s.name] = packed if part == "weight_packed" else scales
    return out


def held_out_loss(cfgd: dict, get, experts, batches: dict) -> dict[str, float]:
    """Mean next-token loss (nats) per domain of `batches` ({domain: ids [N, T+1]})."""
    model = kimi_k3.Model(kimi_k3.Config.from_dict(cfgd))
    out = {}
    with torch.no_grad():
        for d, ids in batches.items():
            logits = model.forward(get, ids[:, :-1], experts=experts)  # [N, T, V]
            nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].reshape(-1))
            out[d] = round(float(nll), 4)
    return out


def eval_three_ways(cfgd, params, shipped: dict, tok, n_seq: int, seq: int) -> dict:
    """Held-out loss per domain: float experts, MXFP4 experts (float trunk), shipped files."""
    batches = train_k3mini.eval_batches(tok, seq, n_seq)
    weights = dict_weights(params)
    fp = held_out_loss(cfgd, weights, train_k3mini.expert_source(params, False), batches)
    q = held_out_loss(cfgd, weights, train_k3mini.expert_source(params, True), batches)
    ship = held_out_loss(cfgd, dict_weights(shipped), None, batches)
    return {
        "float_experts": fp,
        "mxfp4_experts": q,
        "shipped": ship,
        "sequences_per_domain": n_seq,
        "tokens_per_sequence": seq,
    }


def read_log(run: Path) -> list[dict]:
    """The run's log records, one per step (a resumed run's repeated steps: the last wins)."""
    by_step = {}
    for line in (run / "log.jsonl").read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            by_step[rec["step"]] = rec
    return [by_step[k] for k in sorted(by_step)]


def loss_plot(log: list[dict], vocab: int, eval_what: str) -> bytes:
    """PNG: train loss per domain (per logging window) and held-out loss per domain (on
    `eval_what`, e.g. "8 x 256 tokens") vs tokens seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for i, d in enumerate(train_k3mini.DOMAINS):
        c = f"C{i}"
        pts = [(r["tokens"] / 1e6, r["train"][d]) for r in log if d in r.get("train", {})]
        axes[0].plot(*zip(*pts), color=c, lw=1, label=d)
        ev = [(r["tokens"] / 1e6, r["eval"][d]) for r in log if "eval" in r]
        if ev:
            axes[1].plot(*zip(*ev), "o-", color=c, label=d)
    qat = next((r["tokens"] / 1e6 for r in log if r.get("qat")), None)
    for ax, title in zip(
        axes, ("train (per 10-step window)", f"held-out eval split ({eval_what} per domain)")
    ):
        ax.axhline(math.log(vocab), color="gray", ls=":", label="uniform ln(V)")
        if qat is not None:
            ax.axvline(qat, color="k", ls="--", lw=0.8, label="MXFP4 QAT starts")
        ax.set_title(title)
        ax.set_xlabel("tokens seen (M)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("next-token loss (nats)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def export(args: argparse.Namespace) -> str:
    """Write the bundled model directory from the run's last checkpoint; returns its path."""
    from reap.tokenizer import load_tokenizer

    torch.set_num_threads(args.threads)
    run, t0 = Path(args.run), time.time()
    loaded = train_k3mini.load_ckpt(run)
    if loaded is None:
        raise SystemExit(f"{run}: no checkpoint to export")
    params, _, state = loaded
    cfgd, tok = state["config"], load_tokenizer(run)
    shipped = released_tensors(cfgd, params)
    evals = eval_three_ways(cfgd, params, shipped, tok, args.eval_seqs, args.seq)
    smoke = held_out_loss(
        cfgd, dict_weights(shipped), None, train_k3mini.eval_batches(tok, SMOKE[1], SMOKE[0])
    )
    log = read_log(run)
    summary = run_summary(cfgd, state, params, evals, smoke)
    files = {
        "tokenizer.json": (run / "tokenizer.json").read_text(),
        "tokenizer_config.json": (run / "tokenizer_config.json").read_text(),
        "training_log.json": json.dumps({"summary": summary, "log": log}, indent=1),
        "loss_curves.png": loss_plot(
            log,
            cfgd["text_config"]["vocab_size"],
            f"{state['args']['eval_seqs']} x {state['args']['seq']} tokens",
        ),
        "MODEL_CARD.md": model_card(summary, cfgd, args.note),
    }
    specs = kimi_k3.layout(cfgd)
    w = CheckpointWriter(args.out, specs, prefix="language_model.", overwrite=True)
    for s in specs:
        w.write(s.name, shipped[s.name])
    path = w.close(cfgd, files)
    check_readback(path, shipped)
    print(json.dumps({"out": path, "evals": evals, "seconds": round(time.time() - t0)}))
    return path


def check_readback(path: str, shipped: dict) -> None:
    """The written checkpoint holds exactly the tensors evaluated as `shipped`."""
    ck = Checkpoint.open(path)
    for name, t in shipped.items():
        if not torch.equal(ck.read(name), t):
            raise SystemExit(f"{path}: tensor {name} differs from what was evaluated")


def run_summary(cfgd: dict, state: dict, params: dict, evals: dict, smoke: dict) -> dict:
    """The facts the model card reports (also stored in training_log.json)."""
    from reap.corpora import corpus_fingerprint

    cfg = kimi_k3.Config.from_dict(cfgd)
    n_expert = sum(t.numel() for n, t in params.items() if ".experts." in n)
    n_all = sum(t.numel() for t in params.values())
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)]
    active = n_all - n_expert + n_expert * cfg.num_experts_per_token // cfg.num_experts
    active -= cfg.vocab_size * cfg.hidden_size  # the embedding is a lookup
    return {
        "params": n_all,
        "routed_expert_params": n_expert,
        "active_params_per_token": active,
        "moe_layers": moe,
        "steps": state["step"],
        "tokens": state["tokens"],
        "train_seconds": round(state["seconds"]),
        "args": state.get("args", {}),
        "domains": train_k3mini.DOMAINS,
        "train_corpora": {d: train_k3mini.leaves(d) for d in train_k3mini.DOMAINS},
        "train_fingerprints": {d: corpus_fingerprint(d, "train") for d in train_k3mini.DOMAINS},
        "eval": evals,
        "uniform_loss": round(math.log(cfg.vocab_size), 4),
        "smoke_eval": {"sequences": SMOKE[0], "tokens": SMOKE[1], "loss": smoke},
    }


def _loss_table(ev: dict, uniform: float) -> str:
    rows = [
        "| domain | float experts | MXFP4 experts | shipped (bf16 trunk + MXFP4) |",
        "|---|---|---|---|",
    ]
    for d in train_k3mini.DOMAINS:
        rows.append(
            f"| {d} | {ev['float_experts'][d]:.3f} | {ev['mxfp4_experts'][d]:.3f} | "
            f"{ev['shipped'][d]:.3f} |"
        )
    return "\n".join(rows) + f"\n\nUniform over the vocabulary: ln(V) = {uniform:.3f} nats."


def architecture(cfgd: dict) -> str:
    """The card's architecture bullets, from the config."""
    c = kimi_k3.Config.from_dict(cfgd)
    la = c.linear_attn_config
    lines = [
        (
            f"- {c.num_hidden_layers} layers, hidden {c.hidden_size}, vocab {c.vocab_size} "
            "(byte-level BPE trained on the same mix, `tokenizer.json`)."
        ),
        (
            f"- Attention: KDA (gated delta rule, {la['num_heads']} heads x {la['head_dim']}, "
            f"short conv {la['short_conv_kernel_size']}) at one-based layers {la['kda_layers']}; "
            f"gated NoPE MLA ({c.num_attention_heads} heads, kv_lora {c.kv_lora_rank}) at "
            f"{la['full_attn_layers']} (K3's rule: every 4th and the last). No positional encoding."
        ),
        (
            f"- Layer 0: dense SiTU GLU (intermediate {c.intermediate_size}). Layers "
            f"1-{c.num_hidden_layers - 1}: LatentMoE with {c.num_experts} routed experts, "
            f"top-{c.num_experts_per_token}, sigmoid router with `e_score_correction_bias`, experts "
            f"(intermediate {c.moe_intermediate_size}) in a {c.latent}-wide latent space (down/up "
            f"projections, RMSNorm), {c.num_shared_experts} shared experts; AttnRes block "
            f"snapshots every {c.attn_res_block_size} layers."
        ),
    ]
    return "\n".join(lines)


def model_card(s: dict, cfgd: dict, note: str = "") -> str:
    """MODEL_CARD.md text from the run summary and config (plus a note on the run, if any)."""
    a, ev = s["args"], s["eval"]
    corpora = ", ".join(
        f"{d} ({'+'.join(p)}, weight {s['domains'][d]})" for d, p in s["train_corpora"].items()
    )
    return CARD.format(
        arch=architecture(cfgd),
        note=f"- {note}\n" if note else "",
        params=s["params"] / 1e6,
        experts=s["routed_expert_params"] / 1e6,
        active=s["active_params_per_token"] / 1e6,
        steps=s["steps"],
        tokens=s["tokens"] / 1e6,
        minutes=s["train_seconds"] / 60,
        batch=a.get("batch"),
        seq=a.get("seq"),
        lr=a.get("lr"),
        gamma=a.get("gamma"),
        qat=a.get("qat"),
        corpora=corpora,
        n_eval=ev["sequences_per_domain"],
        t_eval=ev["tokens_per_sequence"],
        table=_loss_table(ev, s["uniform_loss"]),
        run_args=" ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in a.items() if k not in ("run", "cmd")
        ),
    )


CARD = """# k3-mini: reap's bundled default model

A {params:.1f} M-parameter model of the exact Kimi K3 architecture, trained from scratch on CPU
on the train splits of reap's shipped corpora, so that calibration, analysis, pruning and the
engine have a default model with real language and domain structure (random weights have none).
It is a test instrument, not a useful language model.

## Architecture (`config.json`; read by `reap.models.kimi_k3.family` and by mlx-lm's `kimi_k3`)
{arch}
- Parameters: {params:.2f} M total, {experts:.2f} M in routed experts, about {active:.2f} M
  active per token (embedding lookup excluded).
- Stored like the release: `language_model.` prefix, routed experts as MXFP4 (`weight_packed`,
  `weight_scale`), everything else bf16 except the release's float32 tensors.

## Training
- Data: {corpora}; train splits only (`reap.corpora.load_documents(name, "train")`), random
  windows of {seq} tokens, every batch of {batch} sequences split over the parts by weight.
  The eval and calibration splits were never trained on.
- {steps} steps, {tokens:.2f} M tokens, {minutes:.0f} minutes of CPU wall time (shared machine).
- AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), peak learning rate {lr}, warmup then
  cosine to 10 %; gradient clipping 1.0; float32.
- Same forward code as the engine: `reap.models.kimi_k3.family.Model` through the weight getter, KDA
  in the chunked WY form, expert-major dispatch.
- Load balancing without an auxiliary loss: after every step each MoE layer's correction bias
  moves by +/-{gamma} toward uniform expert load.
- Quantization-aware finish: the last {qat:.0%} of steps ran the routed experts through MXFP4
  fake quantization (straight-through gradient); the export quantizes them with
  `reap.quant.mxfp4.quantize`.
{note}
## Held-out loss (nats/token, eval splits, {n_eval} sequences x {t_eval} tokens per domain)
{table}

![loss curves](loss_curves.png)

`training_log.json` holds the summary above and every logged step (train loss per domain,
held-out loss every few hundred steps, gradient norm, worst expert load over mean).

## Retrain
```
python -m tools.train_k3mini --run /tmp/k3mini-run {run_args}
python -m tools.export_k3mini --run /tmp/k3mini-run --out reap/models/k3mini
```
The run directory keeps the tokenizer, tokenized data, `log.jsonl` and an atomic checkpoint
(`ckpt/`: safetensors parameters and AdamW moments, JSON step state); rerunning the same
command resumes. Data order is a pure function of (seed, step).
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.export_k3mini", description=__doc__.splitlines()[0]
    )
    p.add_argument("--run", default="/work/k3mini-run", help="training run directory")
    p.add_argument("--out", default=str(Path(__file__).parents[1] / "reap/models/k3mini"))
    p.add_argument("--eval-seqs", type=int, default=32, help="held-out sequences per domain")
    p.add_argument("--seq", type=int, default=256, help="tokens per held-out sequence")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--note", default="", help="a line about this run for the model card")
    export(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
