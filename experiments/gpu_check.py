"""GPU check: prove the `--device cuda` paths of calibrate, run and eval against CPU results, and
measure them. One prepared script to run whenever a GPU machine is lent:

    python experiments/gpu_check.py                   # DEVICE = cuda; writes reports/gpu_check.*
    python experiments/gpu_check.py --device cpu      # self-check of this script (no GPU needed)

Without CUDA (and --device cuda) it prints why and exits 0 having checked nothing. Steps, each
the same work on the CPU and on DEVICE in float32 on one synthesized k3-tiny checkpoint:

1. calibrate: routing counts and co-activations equal, float statistics within rtol 1e-4;
2. run: greedy tokens of a few prompts through the streaming engine identical;
3. eval: teacher-forced next-token logits (what `reap eval` scores) within atol 1e-3;
4. throughput: calibration tokens/s and engine decode tokens/s on DEVICE (a wider model,
   `--widths`), and host->device copy bandwidth from page-locked and from pageable memory.
Exit 1 if any comparison fails; the JSON records every number and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def fib(n):", "The history of", "你好，", "for i in range("]


def check_calibrate(model: str, spec: str, work: Path, device: str) -> dict:
    """Statistics on the CPU and on `device`: counts exact, floats within rtol 1e-4."""
    from reap.calibrate.pipeline import calibrate
    from reap.stats import ExpertStats

    runs = {}
    for dev in ("cpu", device):
        out = work / f"cal-{dev.replace(':', '')}-{len(runs)}"
        t0 = time.perf_counter()
        res = calibrate(model=model, corpus=spec, tokens=2048, seq_len=64, out=str(out),
                        device=dev, dtype="float32", progress=False)
        runs[dev if not runs else "device"] = (res, time.perf_counter() - t0)
    a = ExpertStats.load(runs["cpu"][0].files["all"])
    b = ExpertStats.load(runs["device"][0].files["all"])
    worst, exact = 0.0, True
    for name, x in a.tensors().items():
        y = getattr(b, name)
        if x.is_floating_point():
            scale = float(x.abs().max().clamp(min=1e-12))
            worst = max(worst, float((x.double() - y.double()).abs().max()) / scale)
        else:
            exact = exact and torch.equal(x, y)
    return {"ok": exact and worst <= 1e-4, "counts_equal": exact, "max_rel_diff": worst,
            "tokens": runs["device"][0].tokens,
            "device_tokens_per_s": runs["device"][0].tokens / runs["device"][1],
            "cpu_tokens_per_s": runs["cpu"][0].tokens / runs["cpu"][1]}


def _engine(model: str, device: str):
    from reap.engine import Engine

    return Engine.open(model, preset="max", context=256, device=device, dtype="float32",
                       batch=len(PROMPTS))


def check_run_and_eval(model: str, device: str, gen_tokens: int = 24) -> dict:
    """Greedy tokens identical and teacher-forced logits within 1e-3, CPU vs `device`."""
    from reap.engine.generate import generate, teacher_forced_logits

    out = {}
    for dev in ("cpu", device):
        eng = _engine(model, dev)
        try:
            gens, metrics = generate(eng, PROMPTS, max_tokens=gen_tokens)
            ids = [eng.tokenizer.encode(p) + g.ids for p, g in zip(PROMPTS, gens)]
            logits, _ = teacher_forced_logits(eng, ids)
        finally:
            eng.close()
        out["cpu" if not out else "device"] = ([g.ids for g in gens], logits,
                                               metrics.decode.tokens_per_s)
    (ta, la, _), (tb, lb, tps) = out["cpu"], out["device"]
    diff = max(float((x - y.cpu()).abs().max()) for x, y in zip(la, lb))
    return {"ok": ta == tb and diff <= 1e-3, "greedy_tokens_equal": ta == tb,
            "logits_max_abs_diff": diff, "device_decode_tokens_per_s": tps}


def host_to_device(device: str, mb: int = 256, reps: int = 5) -> dict:
    """Copy bandwidth (bytes/s) host -> device from page-locked and from pageable memory."""
    if not device.startswith("cuda"):
        return {"skipped": "not a CUDA device"}
    out = {}
    for pinned in (True, False):
        src = torch.empty(mb << 20, dtype=torch.uint8, pin_memory=pinned)
        dst = torch.empty_like(src, device=device)
        dst.copy_(src, non_blocking=pinned)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src, non_blocking=pinned)
        torch.cuda.synchronize()
        out["pinned_bytes_per_s" if pinned else "pageable_bytes_per_s"] = \
            reps * src.numel() / (time.perf_counter() - t0)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="device to prove against the CPU (cuda)")
    p.add_argument("--out", default=str(ROOT / "reports" / "gpu_check.json"))
    p.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    a = p.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device on {platform.node()} (torch {torch.__version__}); "
              "nothing checked. Run it on a GPU machine, or with --device cpu as a self-check.")
        return 0
    from reap.provenance import code_version
    from reap.synth import synth

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(a.work or tmp)
        model = synth("k3-tiny", work / "k3-tiny", seed=3, dtype="float32", overwrite=True)
        spec = "zh+code"  # the shipped corpora
        result = {"command": "python experiments/gpu_check.py " + " ".join(argv or sys.argv[1:]),
                  "device": a.device, "torch": torch.__version__,
                  "code_version": code_version(),
                  "gpu": torch.cuda.get_device_name(0) if a.device.startswith("cuda") else None,
                  "calibrate": check_calibrate(model, spec, work, a.device),
                  "run_eval": check_run_and_eval(model, a.device),
                  "host_to_device": host_to_device(a.device)}
    result["ok"] = result["calibrate"]["ok"] and result["run_eval"]["ok"]
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
