"""`reap calibrate`: the command line of `reap.calibrate.pipeline.calibrate`.

    reap calibrate [MODEL] --corpus zh:3+code:1 --tokens 200000 --seq-len 512 --out stats/
"""

from __future__ import annotations

import argparse
import sys

from reap.errors import ReapError

MAX_SHARDS = 1 << 20  # more parts than any corpus has sequences
EPILOG_MEMORY = """memory: --budget bounds peak RSS: the interpreter and torch (measured at start),
one layer's weights (the largest; one routed expert at a time), one attention batch and one MLP
pass. Hidden states of all sequences live in a disk-backed spill under OUT/.work, never in RAM.
When the tokens of a pass do not all fit, the MLP runs in several passes and each expert is read
once per pass (the pass count is recorded). Interrupted runs resume with the same arguments."""


MERGE_STATS_HELP = (
    "also record what `reap plan --method hc-smoe|m-smoe` needs: the router-score Gram (E*E per "
    "layer) and every expert's output summed over about N sampled tokens, routed or not. Cost: "
    "E*N expert evaluations per MoE layer (an expert the pass did not route is read again) and "
    "L*E*(4*Dx+8*E+8) bytes per statistics file (Dx: expert width). Kimi K3 (92 layers, 896 "
    "experts, Dx 3584), N=1024: 0.92 M evaluations per layer (routing 57,000 tokens to top-16 "
    "costs as many), 1.8 GB per file. Default 0: off")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory (default: the bundled k3-mini, see "
                        "reap/models/k3mini/MODEL_CARD.md)")
    p.add_argument("--corpus", required=True,
                   help="corpus mixture, e.g. zh+code or zh:3+code:1 (see `reap corpora list`)")
    p.add_argument("--tokens", type=int, default=65536, help="calibration tokens (default 65536)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default 512)")
    p.add_argument("--out", required=True, help="output directory for the statistics")
    p.add_argument("--budget", default="4GB", help="peak RSS to stay within (default 4GB)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="compute dtype (default float32)")
    p.add_argument("--seed", type=int, default=0, help="corpus sampling seed")
    p.add_argument("--batch", type=int, default=None,
                   help="sequences per attention batch (default: from the budget)")
    p.add_argument("--save-token-experts", action="store_true",
                   help="also write every token's routed expert ids (int16 [L, N, K])")
    p.add_argument("--seq-counts", choices=["auto", "on", "off"], default="auto",
                   help="per-sequence counts [S, L, E] for bootstrap (auto: when <= 256 MB)")
    p.add_argument("--shard", default="1/1",
                   help="K/N: calibrate only the K-th of N parts of the sequences")
    p.add_argument("--merge-stats", type=int, default=0, metavar="N", help=MERGE_STATS_HELP)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.epilog = (p.epilog or "") + "\n\n" + EPILOG_MEMORY


def _shard(text: str) -> tuple[int, int]:
    try:
        k, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise ReapError(f"--shard must look like K/N, got {text!r}") from None
    if not 1 <= k <= n <= MAX_SHARDS:
        raise ReapError(f"--shard {text}: need 1 <= K <= N <= {MAX_SHARDS}")
    return k, n


def calibrate_kwargs(args: argparse.Namespace) -> dict:
    """`calibrate`'s keyword arguments but the shard (`reap calibrate --ray` passes them on to
    Ray's); bad input raises ReapError (exit 2) before any work."""
    from reap.calibrate.artifacts import check_work
    from reap.fileio import check_out_dir
    from reap.units import parse_bytes

    if args.batch is not None and args.batch < 1:
        raise ReapError(f"--batch must be at least 1, got {args.batch}")
    if args.merge_stats < 0:
        raise ReapError(f"--merge-stats must be >= 0, got {args.merge_stats}")
    if args.tokens < 1:
        raise ReapError(f"--tokens must be positive, got {args.tokens}")
    check_out_dir(args.out)
    check_work(args.out)
    return dict(model=args.model, corpus=args.corpus, tokens=args.tokens, seq_len=args.seq_len,
                out=args.out, budget=parse_bytes(args.budget), device=args.device,
                dtype=args.dtype, seed=args.seed, batch=args.batch,
                save_token_experts=args.save_token_experts, progress=not args.no_progress,
                **({"merge_stats": args.merge_stats} if args.merge_stats else {}),
                seq_counts={"auto": None, "on": True, "off": False}[args.seq_counts])


def run(args: argparse.Namespace) -> int:
    from reap.calibrate.pipeline import calibrate
    from reap.units import format_bytes

    res = calibrate(**calibrate_kwargs(args), shard=_shard(args.shard))
    print(f"calibrated {res.tokens} tokens over {len(res.layers)} MoE layers in "
          f"{res.seconds:.1f} s ({res.tokens / max(res.seconds, 1e-9):.0f} tokens/s), peak RSS "
          f"{format_bytes(res.peak_rss)}; read {format_bytes(res.bytes_read)} = "
          f"{res.read_ratio:.3f} x the checkpoint; each expert read at most "
          f"{res.expert_reads_max}x per pass ({res.passes} pass(es))"
          + (f"; resumed after layer {res.resumed_after}" if res.resumed_after is not None else ""),
          file=sys.stderr)
    for name, path in res.files.items():
        print(f"{name}\t{path}")
    if res.token_experts:
        print(f"token_experts\t{res.token_experts}")
    return 0
