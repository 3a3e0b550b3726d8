"""Generation on the streaming engine: prefill once, then one token per step from the model's
caches; greedy or seeded sampling (temperature, top-p); stop strings; many sequences in lockstep.

    gens = generate(engine, ["Hello", [1, 2, 3]], max_tokens=32, temperature=0.7, seed=1)
    for token in stream(engine, [1, 2, 3], max_tokens=8): ...
    logits = teacher_forced_logits(engine, [[1, 2, 3, 4]])   # [[4, V]]

Sampling draws from a CPU `torch.Generator` seeded per sequence, by inverse CDF over the
probabilities sorted by (probability desc, token id asc) in float64, so a seed gives the same
tokens on any device and any budget. Greedy takes the lowest id among equal maxima.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch

from reap.engine.run_metrics import RunMetrics
from reap.errors import ReapError, is_int
from reap.memstat import peak_rss


@dataclass
class Request:
    """One sequence to generate: prompt token ids and its own sampling settings."""

    ids: list[int]
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # generate max_tokens even past the end-of-text token


OPTIONS = ("max_tokens", "temperature", "top_p", "seed", "stop")  # a request's, as Request's


class OptionError(ReapError):
    """A request option of the wrong type or out of range (exit 2); `param` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(f"'{param}' {message}")
        self.param = param


def request_options(d: Mapping, defaults: Mapping, limit: int) -> dict:
    """The OPTIONS of request `d` (a missing or null one from `defaults`), checked the one way
    for the engine, `reap run --prompts` lines and the server's bodies: max_tokens an integer in
    [1, limit], temperature a finite number >= 0, top_p in (0, 1], seed an integer in [0, 2^63)
    (a JSON 1.5 or true is refused, never truncated), stop a string or a list of strings (a
    tuple here); OptionError names the first bad one."""
    o = {k: defaults[k] if d.get(k) is None else d[k] for k in OPTIONS}
    t, p, stop = o["temperature"], o["top_p"], o["stop"]
    stop = [stop] if isinstance(stop, str) else stop
    for ok, param, message in (
        (is_int(o["max_tokens"]) and 1 <= o["max_tokens"] <= limit, "max_tokens",
         f"must be an integer in [1, {limit}]"),
        (_number(t) and 0 <= t < math.inf, "temperature", "must be a finite number >= 0"),
        (_number(p) and 0 < p <= 1, "top_p", "must be a number in (0, 1]"),
        (is_int(o["seed"]) and 0 <= o["seed"] < 2**63, "seed", "must be an integer in [0, 2^63)"),
        (isinstance(stop, list | tuple) and all(isinstance(x, str) for x in stop), "stop",
         "must be a string or a list of strings")):
        if not ok:
            raise OptionError(param, message)
    return {**o, "temperature": float(t), "top_p": float(p), "stop": tuple(stop)}


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


@dataclass
class Generation:
    """What one request produced. `ids` are the generated token ids (an end-of-text token
    included when it ended the sequence); `text` their decoding, cut before a stop string.
    finish_reason: "length" (max_tokens), "stop" (stop string) or "eos"."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"

    def as_dict(self) -> dict:
        return asdict(self)


def sample(
    logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None
) -> int:
    """Next token from logits [V]: argmax when temperature <= 0, else temperature + top-p."""
    if temperature <= 0:
        if logits.dtype == torch.float32 and logits.device.type == "cpu":
            # numpy's argmax picks as torch's (first of ties, NaN above all) at half the cost
            # with cold caches, as between decode tokens
            return int(logits.numpy().argmax())
        return int(torch.argmax(logits))
    z = logits.double() / temperature
    probs = torch.softmax(z, dim=-1)
    p, order = torch.sort(probs, descending=True, stable=True)  # ties: lower id first
    cum = torch.cumsum(p, 0)
    keep = int((cum - p < top_p).sum().clamp(min=1))  # smallest prefix with mass >= top_p
    u = torch.rand((), generator=gen, dtype=torch.float64) * cum[keep - 1]
    j = int(torch.searchsorted(cum[:keep], u, right=True).clamp(max=keep - 1))
    return int(order[j])


class StopMatcher:
    """Tracks the decoded text of one sequence and finds the first stop string in it."""

    def __init__(self, decode, stop: Sequence[str]):
        self.decode, self.stop = decode, [s for s in stop if s]
        self.longest = max((len(s) for s in self.stop), default=0)
        self.text = ""

    def feed(self, ids: list[int]) -> bool:
        """Update with all generated ids so far; True if a stop string now appears (the text is
        then cut just before it)."""
        if self.decode is None:
            return False
        old = len(self.text)
        self.text = self.decode(ids)
        if not self.stop:
            return False
        start = max(0, old - self.longest)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)[0]]
        return True


def _encode(engine, prompt) -> list[int]:
    if isinstance(prompt, str):
        if engine.tokenizer is None:
            raise ReapError(f"{engine.path}: no tokenizer.json, give prompt token ids instead")
        return engine.tokenizer.encode(prompt)
    return [int(t) for t in prompt]


def check_request(engine, r: Request) -> None:
    """Refuse (exit 2) a request beyond the engine's limits."""
    if not r.ids:
        raise ReapError("empty prompt")
    if len(r.ids) > engine.max_prompt:
        raise ReapError(
            f"prompt of {len(r.ids)} tokens exceeds the limit of {engine.max_prompt} (--max-prompt)"
        )
    if not 1 <= r.max_tokens <= engine.max_generation:
        raise ReapError(
            f"max tokens {r.max_tokens} outside [1, {engine.max_generation}] (--max-generation)"
        )
    if len(r.ids) + r.max_tokens > engine.context:
        raise ReapError(
            f"prompt ({len(r.ids)}) + max tokens ({r.max_tokens}) exceed the declared"
            f" context of {engine.context} (--context)"
        )
    request_options({k: getattr(r, k) for k in OPTIONS}, {}, engine.max_generation)


def _prefill(
    engine, seqs, requests, metrics: RunMetrics, all_positions: bool = False
) -> list[list[torch.Tensor]]:
    """Feed every prompt in chunks of the plan's prefill size; returns each sequence's logits per
    chunk: [V] at its last position, or [T_c, V] at every position with `all_positions` (teacher
    forcing, where no decode step follows the last chunk)."""
    chunk, pos = engine.plan.prefill_chunk, [0] * len(seqs)
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    t0, c0 = time.perf_counter(), engine.counters()
    while any(p < len(r.ids) for p, r in zip(pos, requests)):
        live = [k for k, r in enumerate(requests) if pos[k] < len(r.ids)]
        chunks = [requests[k].ids[pos[k] : pos[k] + chunk] for k in live]
        more = not all_positions or any(pos[k] + chunk < len(requests[k].ids) for k in live)
        outs = engine.step([seqs[k] for k in live], chunks, all_positions, more)
        for k, c, o in zip(live, chunks, outs):
            pos[k] += len(c)
            out[k].append(o)
    tokens = sum(len(r.ids) for r in requests)
    metrics.add("prefill", tokens, time.perf_counter() - t0, c0, engine.counters())
    return out


def _events(
    engine, requests: list[Request], metrics: RunMetrics
) -> Iterator[tuple[int, int, Generation]]:
    """Run requests in lockstep; yield (sequence index, token, its Generation) per new token."""
    for r in requests:
        check_request(engine, r)
    seqs = [engine.new_sequence() for _ in requests]
    gens = [Generation(list(r.ids)) for r in requests]
    rngs = [torch.Generator().manual_seed(r.seed) for r in requests]
    decode = engine.tokenizer.decode if engine.tokenizer is not None else None
    stops = [StopMatcher(decode, r.stop) for r in requests]
    eos = engine.tokenizer.eos_id if engine.tokenizer is not None else None
    logits = [o[-1] for o in _prefill(engine, seqs, requests, metrics)]
    live = list(range(len(requests)))
    t0, c0, n = time.perf_counter(), engine.counters(), 0
    try:
        while live:
            for k in live:
                r, g = requests[k], gens[k]
                tok = sample(logits[k], r.temperature, r.top_p, rngs[k])
                g.ids.append(tok)
                if tok == eos and not r.ignore_eos:
                    g.finish_reason = "eos"
                elif stops[k].feed(g.ids):
                    g.finish_reason = "stop"
                yield k, tok, g
            live = [
                k
                for k in live
                if gens[k].finish_reason == "length" and len(gens[k].ids) < requests[k].max_tokens
            ]
            if not live:
                break
            more = any(len(gens[k].ids) + 1 < requests[k].max_tokens for k in live)
            outs = engine.step(
                [seqs[k] for k in live], [[gens[k].ids[-1]] for k in live], more=more
            )
            n += len(live)
            for k, o in zip(live, outs):
                logits[k] = o
    finally:
        metrics.add("decode", n, time.perf_counter() - t0, c0, engine.counters())
        for k, g in enumerate(gens):
            if g.finish_reason != "stop":
                g.text = decode(g.ids) if decode is not None else ""
            else:
                g.text = stops[k].text
        _finish(engine, metrics, requests, gens)


def _finish(engine, metrics: RunMetrics, requests, gens) -> None:
    engine.trunk.drain()
    metrics.sequences += len(requests)
    metrics.generated_tokens += sum(len(g.ids) for g in gens)
    metrics.expert_failures = len(engine.expert_failures)
    metrics.peak_rss = peak_rss()
    engine.metrics.merge(metrics)


def requests_from(
    engine, prompts, max_tokens: int, temperature: float, top_p: float, seed: int, stop
) -> list[Request]:
    """Requests with shared settings for prompts given as text or token id lists."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    return [
        Request(_encode(engine, p), max_tokens, temperature, top_p, seed, stop) for p in prompts
    ]


def generate(
    engine,
    prompts,
    max_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop=(),
    requests: list[Request] | None = None,
) -> tuple[list[Generation], RunMetrics]:
    """Generate for every prompt (text or token ids) in lockstep; returns one Generation each
    and what the run measured (also added to `engine.metrics`). `requests` instead gives each
    sequence its own settings."""
    reqs = requests or requests_from(engine, prompts, max_tokens, temperature, top_p, seed, stop)
    gens: list[Generation] = [Generation(list(r.ids)) for r in reqs]
    metrics = RunMetrics()
    for k, _, g in _events(engine, reqs, metrics):
        gens[k] = g
    return gens, metrics


def stream(
    engine,
    prompt,
    max_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop=(),
) -> Iterator[int]:
    """Yield the generated token ids of one prompt as they are sampled (closing the iterator
    stops generation)."""
    reqs = requests_from(engine, prompt, max_tokens, temperature, top_p, seed, stop)
    if len(reqs) != 1:
        raise ReapError("stream() takes one prompt")
    for _, tok, _ in _events(engine, reqs, RunMetrics()):
        yield tok


def teacher_forced_logits(engine, sequences) -> tuple[list[torch.Tensor], RunMetrics]:
    """Next-token logits at every position of each sequence (teacher forcing, in lockstep,
    prefill chunks of the plan's size): float32 [T_s, V] per sequence, and the run's metrics."""
    reqs = requests_from(engine, sequences, 1, 0.0, 1.0, 0, ())
    for r in reqs:
        check_request(engine, Request(r.ids, 1))
    seqs, metrics = [engine.new_sequence() for _ in reqs], RunMetrics()
    out = _prefill(engine, seqs, reqs, metrics, all_positions=True)
    _finish(engine, metrics, reqs, [])
    return [torch.cat(o) for o in out], metrics
