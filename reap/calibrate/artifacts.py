"""Files calibration writes: per-layer partial results, the resume record, and the final
statistics (one `ExpertStats` per corpus plus their merge) and optional per-token expert ids.

Work files live in `OUT/.work/` and are written atomically (`reap.fileio`):
- `progress.json`: the run's identity (arguments, model and corpus fingerprints, code version),
  the last completed layer, the hidden-state spill manifest and the I/O counters so far;
- `rows.<layer>.safetensors`: one MoE layer's statistics for every corpus;
- `tokexp.<layer>.i16`: that layer's routed expert ids, int16 [N, K] (with --save-token-experts).
Final artifacts in `OUT/`: `<corpus>.safetensors` per mixture component, `all.safetensors`,
`token_experts.safetensors` (optional) and `run.json` (timings and peak RSS: the only output that
differs between an interrupted-and-resumed run and an uninterrupted one).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from reap.checkpoint import encode_header
from reap.errors import EXIT_EXPERT_LOAD, ReapError
from reap.fileio import atomic_path, write_atomic
from reap.stats import ExpertStats, ExpertSums, merge
from reap.stats.check import nonfinite

SPLIT = "calibration"  # the corpus split calibration samples
# what calibration keeps in OUT/.work (here, spill.py, distributed/job.py), which it deletes when
# starting afresh and when done: a .work holding anything else is not its own
_WORK_NAMES = re.compile(r"(progress|job)\.json|rows\.\d+\.safetensors|tokexp\.\d+\.i16|"
                         r"[^/]+\.bin|shards|scratch|[^/]+\.tmp(\.\d+)?")
# the code that determines calibration results: its source digest is the code version
RESULT_CODE = ("calibrate", "models", "checkpoint", "corpora", "quant/mxfp4.py", "stats",
               "tokenizer.py")


def write_json(path: str, obj: dict) -> str:
    """Write JSON atomically (temp file, then rename); returns the path."""
    write_atomic(path, json.dumps(obj, indent=1, sort_keys=True), fsync=True)
    return path


def read_json(path: str) -> dict | None:
    """The JSON object in `path`, or None if the file does not exist; ReapError (exit 2) when
    it is not a JSON object (corrupt, nested too deeply, or not an object)."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except FileNotFoundError:
        return None
    except (ValueError, RecursionError) as e:
        raise ReapError(f"{path}: not valid JSON ({str(e) or 'nested too deeply'}); delete it "
                        "to start over") from None
    if not isinstance(obj, dict):
        raise ReapError(f"{path}: not a JSON object; delete it to start over")
    return obj


def safe_name(corpus: str) -> str:
    """A file-name stem for a corpus name, path or hf: source."""
    stem = Path(corpus).stem if ("/" in corpus or "." in corpus) and ":" not in corpus else corpus
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", stem).strip("_") or "corpus"


# -- per-layer rows -----------------------------------------------------------------------------
def save_rows(work: str, layer: int, rows: list[ExpertSums]) -> str:
    """Save one layer's rows (one per corpus) atomically; returns the path. ReapError (exit 4)
    naming the layer and expert when a statistic is NaN or infinite: nothing is written."""
    from safetensors.torch import save_file

    for row in rows:
        bad = nonfinite(row.tensors())
        if bad:
            raise ReapError(f"layer {layer}, expert {bad[1][-1]}: statistic {bad[0]} is NaN or "
                            "infinite (the model's weights or activations are not finite); "
                            "statistics not written", exit_code=EXIT_EXPERT_LOAD)
    path = os.path.join(work, f"rows.{layer}.safetensors")
    tensors = {f"{c}.{k}": v.contiguous() for c, row in enumerate(rows)
               for k, v in row.tensors().items()}
    with atomic_path(path) as tmp:
        save_file(tensors, tmp)
    return path


def load_rows(work: str, layer: int, n_corpora: int) -> list[dict[str, torch.Tensor]]:
    """One layer's saved rows: a {field: tensor} dict per corpus."""
    from safetensors.torch import load_file

    flat = load_file(os.path.join(work, f"rows.{layer}.safetensors"))
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(n_corpora)]
    for key, t in flat.items():
        c, name = key.split(".", 1)
        out[int(c)][name] = t
    return out


def write_stats(out: str, work: str, *, names: list[str], layers: list[int], n_experts: int,
                top_k: int, tokens: list[int], metas: list[dict], run_meta: dict) -> dict[str, str]:
    """Assemble the saved rows into one statistics file per corpus and their merge.

    Returns {corpus name: path} plus {"all": path}. seq_count, when recorded, is [S_c, L, E].
    """
    per_layer = [load_rows(work, layer, len(names)) for layer in layers]
    parts, files = [], {}
    for c, name in enumerate(names):
        fields = {k: torch.stack([rows[c][k] for rows in per_layer]) for k in per_layer[0][c]}
        if "seq_count" in fields:
            fields["seq_count"] = fields["seq_count"].transpose(0, 1).contiguous()  # [S_c, L, E]
        st = ExpertStats(list(layers), n_experts, top_k, tokens[c], meta=metas[c], **fields)
        files[name] = st.save(os.path.join(out, f"{safe_name(name)}.safetensors"))
        parts.append(st)
    files["all"] = merge(parts, meta=run_meta).save(os.path.join(out, "all.safetensors"))
    return files


# -- per-token expert ids -----------------------------------------------------------------------
class TokenExperts:
    """Routed expert ids of every token per MoE layer, int16, spilled one file per layer."""

    def __init__(self, work: str, n_tokens: int, top_k: int):
        self.work, self.n_tokens, self.top_k = work, n_tokens, top_k
        self._fds: dict[int, int] = {}

    def path(self, layer: int) -> str:
        return os.path.join(self.work, f"tokexp.{layer}.i16")

    def write(self, layer: int, first_token: int, ids: torch.Tensor) -> None:
        """Store ids [n, K] of tokens first_token.. of layer `layer`."""
        fd = self._fds.get(layer)
        if fd is None:
            fd = self._fds[layer] = os.open(self.path(layer), os.O_RDWR | os.O_CREAT | os.O_TRUNC,
                                            0o644)
            os.ftruncate(fd, self.n_tokens * self.top_k * 2)
        data = ids.to("cpu", torch.int16).contiguous().numpy()
        os.pwrite(fd, memoryview(data).cast("B"), first_token * self.top_k * 2)

    def commit(self, layer: int) -> None:
        """Make a layer's file durable and close it."""
        fd = self._fds.pop(layer, None)
        if fd is not None:
            os.fsync(fd)
            os.close(fd)

    def assemble(self, path: str, layers: list[int], seq_corpus: list[int], meta: dict) -> str:
        """Write `ids` [L, N, K] int16 and `seq_corpus` [S] int64 (sequence s owns tokens
        s*T..(s+1)*T-1) as one safetensors file, streaming layer by layer; returns the path."""
        L, N, K = len(layers), self.n_tokens, self.top_k
        sc = torch.tensor(seq_corpus, dtype=torch.int64).numpy().tobytes()
        header = encode_header(
            [("ids", "I16", (L, N, K), L * N * K * 2),
             ("seq_corpus", "I64", (len(seq_corpus),), len(sc))],
            {"reap": json.dumps(meta, sort_keys=True)},
        )
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            f.write(header)
            for layer in layers:
                with open(self.path(layer), "rb") as src:
                    while chunk := src.read(1 << 24):
                        f.write(chunk)
            f.write(sc)
        return path


def stats_metas(identity: dict, seq_len: int, names: list[str], counts: list[int],
                counters: dict) -> tuple[list[dict], dict]:
    """Per-corpus metadata and the run's (all.safetensors) of a calibration with `identity`
    (arguments, fingerprints, code version) over `counts` sequences of `seq_len` tokens per corpus
    of `names`, as a local run and the Ray runs record them. counters: bytes_read,
    checkpoint_bytes, expert_reads_max, expert_reads, passes."""
    from reap.corpora import corpus_fingerprint

    T, c, spec = seq_len, counters, identity["arguments"]["corpus"]
    common = {**identity, "split": SPLIT, "seq_len": T, "bytes_read": c["bytes_read"],
              "checkpoint_bytes": c["checkpoint_bytes"],
              "read_ratio": c["bytes_read"] / c["checkpoint_bytes"],
              "expert_reads_max": c["expert_reads_max"], "expert_reads": c["expert_reads"],
              "passes": c["passes"], "spec": spec}
    per = [{**common, "corpus": n, "corpus_sha256": corpus_fingerprint(n, SPLIT),
            "spec_sha256": identity["corpus_sha256"], "sequences": k, "tokens": k * T}
           for n, k in zip(names, counts)]
    return per, {**common, "corpus": spec, "tokens": sum(counts) * T}


def check_work(out: str) -> None:
    """Refuse an OUT/.work that calibration did not make: it deletes its own when done."""
    work = os.path.join(out, ".work")
    if not os.path.lexists(work):
        return
    names = os.listdir(work) if os.path.isdir(work) and not os.path.islink(work) else [".work"]
    foreign = [n for n in names if not _WORK_NAMES.fullmatch(n)]
    if foreign:
        raise ReapError(f"--out {out}: {work} holds {foreign[0]}, which calibration did not "
                        "write and would delete; choose another --out")
