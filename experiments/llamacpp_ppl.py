"""Prefill as perplexity: reap's perplexity pass against `llama-perplexity` on the same token ids.

`llama-perplexity -f TEXT -c C -b 4C` tokenizes TEXT (BOS first when the GGUF asks for one),
cuts the ids into chunks of C, evaluates 4 chunks at a time from an empty cache (a chunk's first
id replaced by BOS when the vocabulary adds one) and scores the second half of each chunk:
positions C/2 .. C-2, each predicting the next id. Its "prompt eval time" is the decode time.

The same ids on reap's side: TEXT is the shipped `en` corpus's eval split in `reap eval`'s
document order, joined and cut to CHUNKS x C bytes (the byte-level tokenizer gives one id per
byte). llama.cpp's tokenization of TEXT (its Python bindings over the built library, vocabulary
only) is checked to equal reap's tokenizer's, then the chunks llama-perplexity reads are scored
by reap the way `reap eval` scores documents (`reap.eval.quality`): the engine prefills 4
chunks in lockstep, `Engine.step(..., all_positions=True)` in pieces of its plan's prefill
chunk, and the next-token log-probabilities in float64 (as `chunk_sums` does), here over the
positions llama-perplexity scores (the head runs on those positions only, `first=`, as
llama-perplexity asks for their logits only). One engine instead of `reap eval`'s reference +
build (which would read every token twice). Both warm up with a 2-token step before the pass (llama-perplexity
by default). Timed on both sides: the whole pass after loading (evaluation
and log-probabilities); tokens/s = ids fed / seconds.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

from experiments.llamacpp_models import bindings, run_python
from reap.cli import GOMP_SPINCOUNT

N_CTX, CHUNKS, PARALLEL = 512, 8, 4
TOKENIZE = """
import json, llama_cpp
llm = llama_cpp.Llama(model_path={gguf!r}, vocab_only=True, verbose=False)
text = open({text!r}, "rb").read()
print(json.dumps({{"ids": llm.tokenize(text, add_bos=True, special=False),
                  "bos": llm.token_bos(), "add_bos": llm._model.add_bos_token()}}))
"""
REAP_PPL = """
import json, sys, time, torch
from reap.engine import Engine
torch.set_num_threads({threads})
chunks, first = json.load(open({ids!r})), {first}
nll, count, seconds = 0.0, 0, 0.0
with Engine.open({path!r}, preset="max", context={ctx}, dtype={dtype!r}, batch={par}) as eng:
    piece = eng.plan.prefill_chunk
    eng.step([eng.new_sequence() for _ in range({par})], [c[:2] for c in chunks[:{par}]])  # warm-up
    for g in range(0, len(chunks), {par}):
        group = chunks[g : g + {par}]
        seqs = [eng.new_sequence() for _ in group]
        logits = [[] for _ in group]
        t0 = time.perf_counter()
        for a in range(0, len(group[0]) - 1, piece):
            out = eng.step(seqs, [c[a : min(a + piece, len(c) - 1)] for c in group],
                           all_positions=True, first=max(0, first - a))  # scored rows only
            for k, x in enumerate(out):
                logits[k].append(x)
        for k, c in enumerate(group):
            lg = torch.cat(logits[k]).double()  # [C - 1 - first, V]
            tg = torch.tensor(c[first + 1 :])  # [C - 1 - first]
            nll -= float(torch.log_softmax(lg, -1).gather(1, tg[:, None]).sum())
            count += len(tg)
        seconds += time.perf_counter() - t0
fed = sum(len(c) - 1 for c in chunks)
print(json.dumps({{"ppl": __import__("math").exp(nll / count), "scored": count,
                  "tokens": fed, "seconds": seconds, "tokens_per_s": fed / seconds}}))
"""


def corpus_text(path: Path, n_bytes: int) -> Path:
    """The `en` eval documents in `reap eval`'s order, joined by blank lines, cut to at least
    `n_bytes` bytes at a character boundary; written to `path` once."""
    if path.is_file():
        return path
    from reap.corpora import load_documents
    from reap.eval.quality import document_order

    docs = sorted(load_documents("en", "eval"), key=lambda d: document_order(d.corpus, d.id))
    text, size = [], 0
    for d in docs:
        text.append(d.text)
        size += len(d.text.encode()) + 2
        if size > n_bytes + 64:
            break
    data = "\n\n".join(text).encode()
    cut = n_bytes + 16
    while cut < len(data) and (data[cut] & 0xC0) == 0x80:  # not inside a UTF-8 sequence
        cut += 1
    path.write_bytes(data[:cut])
    return path


def llama_ids(pkg: Path, lib: Path, gguf: Path, text: Path) -> dict:
    """llama.cpp's tokenization of `text` as llama-perplexity does it (BOS per the GGUF)."""
    code = TOKENIZE.format(gguf=str(gguf), text=str(text))
    return json.loads(run_python(code, [pkg], {"LLAMA_CPP_LIB_PATH": str(lib)}))


def chunks_of(tok: dict) -> list[list[int]]:
    """The chunks llama-perplexity evaluates: C ids each, the first replaced by BOS when the
    vocabulary adds one."""
    ids = tok["ids"]
    out = [ids[i * N_CTX : (i + 1) * N_CTX] for i in range(min(CHUNKS, len(ids) // N_CTX))]
    if tok["add_bos"]:
        out = [[tok["bos"], *c[1:]] for c in out]
    return out


def same_tokens(ckpt: Path, text: Path, tok: dict) -> bool:
    """Whether reap's tokenizer encodes `text` to llama.cpp's ids (its BOS aside)."""
    from reap.tokenizer import load_tokenizer

    ours = load_tokenizer(str(ckpt)).encode(text.read_text())
    theirs = tok["ids"][1:] if tok["add_bos"] else tok["ids"]
    return ours == theirs


def reap_ppl(root: Path, ckpt: Path, dtype: str, threads: int, ids: Path) -> dict:
    """reap's perplexity pass over the chunks in `ids` (JSON), in a fresh process."""
    code = REAP_PPL.format(threads=threads, ids=str(ids), first=N_CTX // 2, path=str(ckpt),
                           ctx=N_CTX + 8, dtype=dtype, par=PARALLEL)  # fmt: skip
    # OpenMP's spin as `reap eval` sets it (reap.cli: the engine commands)
    env = {"OMP_NUM_THREADS": str(threads), "GOMP_SPINCOUNT": GOMP_SPINCOUNT}
    return json.loads(run_python(code, [root], env).strip().splitlines()[-1])


def _stamp(log: str, pattern: str) -> float | None:
    """Seconds since start of the log line matching `pattern` (llama.cpp's log prefix
    minutes.seconds.milliseconds.microseconds)."""
    m = re.search(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) I .*" + pattern, log, re.MULTILINE)
    if not m:
        return None
    mins, sec, ms, us = map(int, m.groups())
    return 60 * mins + sec + ms / 1e3 + us / 1e6


def llama_ppl(tree: Path, gguf: Path, text: Path, threads: int, f32_cache: bool) -> dict:
    """`llama-perplexity` over `text`: its final estimate, and tokens/s of the whole pass
    (from its "calculating perplexity" line to its "Final estimate" line: the decodes and the
    log-probabilities; its own perf counters count only the last batch)."""
    exe = str(tree / "build" / "bin" / "llama-perplexity")
    cmd = [exe, "-m", str(gguf), "-f", str(text), "-c", str(N_CTX), "-b", str(PARALLEL * N_CTX),
           "--chunks", str(CHUNKS), "-t", str(threads), "-tb", str(threads)]  # fmt: skip
    if f32_cache:
        cmd += ["-ctk", "f32", "-ctv", "f32"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
    log = p.stdout + p.stderr
    final = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    chunks = re.search(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)", log)
    t0, t1 = _stamp(log, "calculating perplexity"), _stamp(log, "Final estimate")
    if p.returncode != 0 or not final or not chunks or t0 is None or t1 is None:
        raise SystemExit(f"llama-perplexity failed ({p.returncode}): {log.strip()[-800:]}")
    n = int(chunks.group(1)) * int(chunks.group(2))
    return {"ppl": float(final.group(1)), "tokens": n, "seconds": t1 - t0,
            "tokens_per_s": n / (t1 - t0)}  # fmt: skip


def prepare(work: Path, tools: Path, tree: Path, model) -> dict:
    """Text, llama.cpp's ids, the tokenizer check and the chunk file for `model`."""
    text = corpus_text(work / "ppl-en.txt", CHUNKS * N_CTX)
    tok = llama_ids(bindings(tools), tree / "build" / "bin", model.ggufs["float32"], text)
    chunks = chunks_of(tok)
    ids = work / f"ppl-{model.name}-ids.json"
    ids.write_text(json.dumps(chunks))
    same = same_tokens(model.ckpts["float32"], text, tok)
    print(f"{model.name}: llama.cpp's tokenization equals reap's: {same}; "
          f"{len(chunks)} chunks of {N_CTX}, add_bos {tok['add_bos']}", flush=True)  # fmt: skip
    return {"text": text, "ids": ids, "same_tokens": same, "add_bos": bool(tok["add_bos"]),
            "chunks": len(chunks)}  # fmt: skip


def summarize(dtype: str, threads: int, runs: list[dict]) -> dict:
    """Median tokens/s of each side over `runs`, their perplexities (equal across runs)."""
    import statistics

    row = {"dtype": dtype, "threads": threads, "runs": runs}
    for who in ("reap", "llama.cpp"):
        row[who] = {"ppl": runs[0][who]["ppl"],
                    "tokens_per_s": statistics.median(r[who]["tokens_per_s"] for r in runs)}  # fmt: skip
    row["ratio"] = row["reap"]["tokens_per_s"] / row["llama.cpp"]["tokens_per_s"]
    row["ppl_rel_diff"] = abs(math.log(row["reap"]["ppl"] / row["llama.cpp"]["ppl"]))
    return row
