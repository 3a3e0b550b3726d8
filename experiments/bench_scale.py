"""Capacity plan: what calibrating the real Kimi K3 costs on 1, 4 and 16 workers, in each
distributed mode, from a throughput measured here on a full-width K3 layer and the size model.

    python experiments/bench_scale.py                 # writes reports/scale.md and scale.json
    python experiments/bench_scale.py --device cuda   # the same measurement on a GPU

Measurement: one full-width K3 MoE layer (hidden 7168, KDA attention with 96 heads, 2 shared
experts, LatentMoE 7168->3584, routed experts of K3's exact shape in MXFP4, top-16) with 32
instead of 896 routed experts and a 4096-token vocabulary (neither changes the per-token work
of a layer), synthesized by `reap synth`'s machinery. `reap calibrate` runs it on two token counts
with one torch thread; the difference gives the compute seconds per token-layer, the rest the
fixed per-layer cost (reading the layer from the page cache and decoding its MXFP4 experts), per
byte. The projection then scales those to K3's 93 layers and 1.56 TB (`reap.sizes`), and adds
disk, network and spill traffic at the bandwidths stated in ASSUMPTIONS.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from reap.provenance import code_version

ROOT = Path(__file__).resolve().parents[1]
TOKENS = (512, 2048)  # the two measured calibration sizes (sequences of SEQ_LEN)
SEQ_LEN = 256
ASSUMPTIONS = {
    "disk_bytes_per_s": 3.2e9,  # NVMe O_DIRECT, the published one-machine figure (shared/k3.md)
    "network_bytes_per_s": 12.5e9,  # 100 Gb/s Ethernet per worker, full duplex
    "cores_per_worker": 1,  # the measured rate is one torch thread: divide by real cores
    "passes": 1,  # each worker's budget holds one MLP pass of its tokens (else experts re-read)
}
WORKERS, TARGETS = (1, 4, 16), (65_536, 1_048_576)
MACHINE_CORES = 124  # the published one-machine setup of shared/k3.md: 2x EPYC 7763, NVMe
MACHINE = ("one worker = the published one-machine setup of shared/k3.md (2x EPYC 7763, 124 "
           "cores, NVMe 3.2 GB/s), compute assumed to scale linearly over its cores (optimistic)")
NOTES = [
    "## Reading the tables", "",
    ("- Parts add up: `reap calibrate` reads a layer, then computes it (no overlap), so each wall "
    "time is an upper bound of what prefetching would give. decode = reading the bytes from the "
    "page cache and decoding MXFP4 experts (measured per byte), disk = the bytes at "
    "`disk_bytes_per_s` (token mode also pays its hidden-state spill there, read and write per "
    "layer; in RAM when the page cache holds it), network = one stage boundary's hidden states "
    "(layer mode; the boundaries run concurrently in the pipeline)."),
    ("- **Token-sharded**: compute divides by the workers, but every worker reads and decodes the "
    "whole 1.56 TB (bytes read = workers x 1.56 TB, from local copies or shared storage). On "
    "single cores compute dominates everything; on 124-core workers the fixed per-worker read "
    "and decode stop shrinking, so at 64 K tokens and 16 workers disk (1.56 TB at 3.2 GB/s) is "
    "the bottleneck and more workers no longer help; at 1 M tokens compute still dominates."),
    ("- **Layer-parallel**: the checkpoint is read and decoded once in total (each stage its "
    "share), so decode and disk shrink with the workers; the cost moves to memory (1.56 TB / "
    "workers resident per worker: 98 GB at 16) and to the network (hidden states of every token "
    "cross each boundary: (1 + snapshots) x 7168 x 4 bytes per token, about 0.14 TB per "
    "boundary at 1 M tokens), which stays small next to compute at 100 Gb/s. One worker would "
    "need the whole checkpoint in RAM: the 1-worker rows are the limit, not a setup."),
    ("- Which mode: token-sharded when workers have fast local disks and modest RAM (each needs "
    "only its `--budget`); layer-parallel when workers have RAM (or GPU memory) for 1.56 TB / "
    "workers and the checkpoint is far away (read once over the network instead of once per "
    "worker). Both produce the same statistics (tests/test_distributed.py)."),
    ("- GPU: not measured (no GPU lent to this task). The compute column divides by a GPU's "
    "speed-up over one core once `python experiments/bench_scale.py --device cuda` has measured "
    "it; host-to-device bandwidth then joins the decode column (`experiments/gpu_check.py`)."),
    ("- Published one-machine figures for comparison (shared/k3.md, inference, not calibration): "
    "the pure-C CPU engine on that 124-core machine decodes 5.6 s/token with >= 128 GB RAM and "
    "streams the trunk at 5.4-6.1 GB/s; calibration is prefill-like (every token through every "
    "layer, 2 x 104 B FLOP per token = 2.1e17 FLOP for 1 M tokens), which is why it is "
    "compute-bound here while decoding is bandwidth-bound."), ""]


def prefix_config() -> dict:
    """k3-full's widths, one MoE layer, 32 routed experts, a 4096-token vocabulary."""
    from reap.models import builtin_config

    cfg = builtin_config("k3-full", layers=1)
    cfg["text_config"].update(num_experts=32, first_k_dense_replace=0, vocab_size=4096)
    return cfg


def measure(work: Path, device: str) -> dict:
    """Calibrate the prefix on TOKENS; fit seconds = fixed + per_token * tokens."""
    import torch

    from reap.calibrate.pipeline import calibrate
    from reap.synth import synth

    torch.set_num_threads(1)
    model = work / "k3-prefix"
    if not (model / "config.json").exists():
        synth(prefix_config(), model, seed=0, dtype="bfloat16", overwrite=True)
    runs = []
    for n in TOKENS:
        out = work / f"cal-{device}-{n}-{time.time_ns()}"
        res = calibrate(model=str(model), corpus="zh+code", tokens=n, seq_len=SEQ_LEN,
                        out=str(out), budget=12_000_000_000, device=device, progress=False)
        layer_s = res.timing.get("attention", 0.0) + res.timing.get("moe", 0.0)
        runs.append({"tokens": res.tokens, "layer_seconds": layer_s, "seconds": res.seconds,
                     "bytes_read": res.bytes_read, "peak_rss": res.peak_rss})
    (a, b) = runs
    per_token = (b["layer_seconds"] - a["layer_seconds"]) / (b["tokens"] - a["tokens"])
    fixed = max(a["layer_seconds"] - per_token * a["tokens"], 0.0)
    return {"device": device, "runs": runs, "seconds_per_token_layer": per_token,
            "tokens_per_s_per_layer": 1 / per_token, "fixed_seconds": fixed,
            "fixed_seconds_per_byte": fixed / a["bytes_read"], "bytes_read": a["bytes_read"],
            "load_average": os.getloadavg()[0], "code_version": code_version()}


def k3_facts() -> dict:
    """Layers, bytes and state width of the full model from the size model."""
    from reap.models import builtin_config, family
    from reap.sizes import SizeModel

    cfg = builtin_config("k3-full")
    size = SizeModel.from_config(cfg)
    fam = family(cfg)
    widths = fam.calibration_widths(fam.Config.from_dict(cfg), len(size.moe_layers) + 1)
    experts = sum(size.expert_bytes.values()) * size.n_experts
    return {"layers": len(size.moe_layers) + 1, "checkpoint_bytes": size.fixed_bytes + experts,
            "hidden": widths.hidden, "snapshots": widths.snapshots}


def project(m: dict, k3: dict, tokens: int, workers: int, mode: str, a: dict) -> dict:
    """Wall time (seconds, by part) and bytes moved for one (tokens, workers, mode). Parts add
    up because calibration does not overlap reading with compute."""
    L, ckpt, cores, D = k3["layers"], k3["checkpoint_bytes"], a["cores_per_worker"], k3["hidden"]
    compute = tokens * L * m["seconds_per_token_layer"] / cores  # one worker doing it all
    decode = ckpt * m["fixed_seconds_per_byte"] * a["passes"] / cores  # per full read
    snaps = k3["snapshots"] / 2  # AttnRes snapshots held, on average over the layers
    state = (1 + snaps) * D * 4  # fp32 hidden + snapshots per token: what crosses a boundary
    if mode == "tokens":  # each worker streams the whole checkpoint and spills its own states
        spill = tokens / workers * L * (3 + snaps) * D * 4  # read state, write hidden and x
        parts = {"compute": compute / workers, "decode": decode,
                 "disk": (ckpt * a["passes"] + spill) / a["disk_bytes_per_s"], "network": 0.0}
        read, net, ram = workers * ckpt * a["passes"], 0.0, None
    else:  # stage j keeps its L/W layers resident; states cross W-1 boundaries, pipelined
        shards = 4 * workers  # the default shard count of layer-parallel mode
        parts = {"compute": compute / workers * (1 + (workers - 1) / shards),
                 "decode": decode / workers, "disk": ckpt / workers / a["disk_bytes_per_s"],
                 "network": tokens * state / a["network_bytes_per_s"] if workers > 1 else 0.0}
        read, net, ram = ckpt, (workers - 1) * tokens * state, ckpt / workers
    return {"mode": mode, "tokens": tokens, "workers": workers, "wall_s": sum(parts.values()),
            "parts": parts, "bottleneck": max(parts, key=parts.get), "bytes_read": read,
            "network_bytes": net, "resident_bytes_per_worker": ram}


def _load(m: dict) -> str:
    v = m.get("load_average")
    return "not recorded by this run" if v is None else f"{v:.1f} at the end of the run"


def _time(s: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            return f"{s / n:.1f} {unit}"
    return f"{s:.0f} s"


def _tb(b: float | None) -> str:
    return "-" if b is None else (f"{b / 1e12:.2f} TB" if b >= 1e11 else f"{b / 1e9:.1f} GB")


def _table(rows: list[dict], title: str) -> list[str]:
    lines = [f"## Projection: {title}", "",
             ("| tokens | mode | workers | wall time | compute | decode | disk | network | "
             "bottleneck | bytes read | network bytes | resident per worker |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["parts"]
        lines.append(f"| {r['tokens']:,} | {r['mode']} | {r['workers']} | "
                     f"**{_time(r['wall_s'])}** | {_time(p['compute'])} | {_time(p['decode'])} | "
                     f"{_time(p['disk'])} | {_time(p['network'])} | {r['bottleneck']} | "
                     f"{_tb(r['bytes_read'])} | {_tb(r['network_bytes'])} | "
                     f"{_tb(r['resident_bytes_per_worker'])} |")
    return lines + [""]


def report(m: dict, k3: dict, rows: list[dict], a: dict, command: str) -> str:
    """reports/scale.md."""
    lines = [
        "# Scale: calibrating Kimi K3 on Ray workers (measured layer rate, projected)", "",
        (f"Command: {command}. Machine: 2 shared cores, no GPU (none was lent to this task, so "
        "there are no GPU numbers here: run `python experiments/bench_scale.py --device cuda` and "
        "`python experiments/gpu_check.py` on one)."), "",
        "## Measured: one full-width K3 MoE layer, one torch thread, " + m["device"], "",
        (f"Load average {_load(m)} (other jobs share the 2 cores, so the rate is a lower bound "
        "for an idle core)."), "",
        "| tokens | layer seconds (attention + MoE) | checkpoint bytes read | peak RSS |",
        "|---|---|---|---|"]
    lines += [f"| {r['tokens']} | {r['layer_seconds']:.1f} | {_tb(r['bytes_read'])} | "
              f"{r['peak_rss'] / 1e9:.1f} GB |" for r in m["runs"]]
    lines += ["", (f"- compute: **{m['tokens_per_s_per_layer']:.1f} tokens/s per layer** "
              f"({m['seconds_per_token_layer'] * 1e3:.1f} ms per token-layer; K3 has "
              f"{k3['layers']} layers, so {m['tokens_per_s_per_layer'] / k3['layers']:.2f} "
              "whole-model tokens/s per core)"),
              (f"- fixed per-layer cost (read from page cache + MXFP4 decode): "
              f"{m['fixed_seconds']:.1f} s for {_tb(m['bytes_read'])} = "
              f"{m['fixed_seconds_per_byte'] * 1e9:.2f} s per GB"), "",
              "## Assumptions", ""]
    lines += [f"- `{k}` = {v}" for k, v in a.items() if k != "cores_per_worker"]
    lines += [(f"- K3 (size model): {k3['layers']} layers, checkpoint "
              f"{_tb(k3['checkpoint_bytes'])}, hidden {k3['hidden']}, "
              f"{k3['snapshots']} AttnRes snapshots at most."), ""]
    for cores, title in ((1, "one worker = one core at the measured rate"),
                         (MACHINE_CORES, MACHINE)):
        lines += _table([r for r in rows if r["cores"] == cores], title)
    lines += NOTES
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "reap-bench-scale"),
                   help="where the synthesized layer (1.9 GB) and runs go")
    p.add_argument("--out", default=str(ROOT / "reports" / "scale"))
    p.add_argument("--measured", default=None,
                   help="reuse the measurement of an earlier scale.json (new assumptions only)")
    a = p.parse_args(argv)
    os.makedirs(a.work, exist_ok=True)
    measured_by = None
    if a.measured:
        old = json.loads(Path(a.measured).read_text())
        m, measured_by = old["measured"], old.get("measured_by", old["command"])
    else:
        m = measure(Path(a.work), a.device)
    k3 = k3_facts()
    rows = [{**project(m, k3, n, w, mode, {**ASSUMPTIONS, "cores_per_worker": c}), "cores": c}
            for c in (1, MACHINE_CORES) for n in TARGETS for mode in ("tokens", "layers")
            for w in WORKERS]
    assumptions = ASSUMPTIONS
    command = ("python experiments/bench_scale.py " + " ".join(argv or sys.argv[1:])).strip()
    m_by = measured_by or command
    shown = f"`{m_by}` (measurement), then `{command}` (projection)" if measured_by else \
        f"`{command}`"
    Path(a.out + ".md").write_text(report(m, k3, rows, assumptions, shown))
    Path(a.out + ".json").write_text(json.dumps(
        {"command": command, "measured_by": m_by, "code_version": code_version(),
         "measured": m, "k3": k3,
         "assumptions": assumptions,
         "projection": rows}, indent=1) + "\n")
    print(Path(a.out + ".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
