"""Decode steps through the compiled step kernels (`reap.quant.step_kernel`): when every
sequence of a step advances by one token on the CPU, and the family describes each layer as a
`models.shared.blocks.NativeLayer` with dense bf16/fp32 weights, a layer costs two library calls
per sequence and the head one, instead of some fifty torch ops and Python calls; a sequence
decoding alone with every weight resident takes one call for the whole token (`native_token`).

The engine's stores, expert cache (a failed expert contributes nothing), KV caches and timings
serve as they are. The torch path (`Engine._step`) is the reference, up to the order of a few
reductions. Set `ENABLED = False` (or REAP_NO_NATIVE=1) to run every step through torch.
"""

from __future__ import annotations

import ctypes
import time

import torch

from reap.engine.native_token import WholeToken
from reap.models.shared import blocks
from reap.quant import ckernel, step_kernel

ENABLED = True  # False: every step through the torch path (the reference), for the tests
OVERLAP = True  # False: a decode step's experts wait for every read, then run in one call
_A, _M = step_kernel.ATTN, step_kernel.MOE


class NativeDecoder:
    """The compiled decode path of one engine (see module docstring): `usable(chunks)`, `step`;
    `native_token` and `native_prefill` build on its argument blocks (`layer_args`, `bind`)."""

    def __init__(self, engine):
        self.eng = engine
        self.lib = None
        self.specs, self.head_names = _hooks(engine.model, len(engine.binding.units) - 1)
        if engine.device != "cpu" or engine.dtype not in _ROUNDS:
            return
        if (self.head_names is None or None in self.specs or not self._dtypes_ok()
                or any(s.top_k > step_kernel.MAX_TOP_K for s in self.specs)):  # fmt: skip
            return
        self.lib = step_kernel.library()
        self.rnd = _ROUNDS[engine.dtype]
        self._static: list = [None] * len(self.specs)  # (units dict, int64 args) per layer
        self._scratch = torch.empty(0)
        self.floats = (ctypes.c_double * 2)()
        k = max(1, *(s.top_k for s in self.specs))
        self._x2 = torch.empty(engine.reader.info(self.head_names[0]).shape[0])  # MLP input [D]
        self._ids = torch.empty(k, dtype=torch.int64)  # a token's routing, ascending ids
        self._wts = torch.empty(k, dtype=torch.float32)
        self.mlp_args = (ctypes.c_int64 * len(_M))()
        self._ptrs = [(ctypes.c_int64 * k)() for _ in range(3)]  # gate, up, down pointers
        self._w = (ctypes.c_float * k)()
        self._skip = (ctypes.c_uint8 * k)()  # per routed slot: 0 run now, 1 done, 2 absent
        self.token = WholeToken(self)  # the one-call token, once every expert is resident
        self.n_experts = sum(engine.reader.info(s.prefix + s.router).shape[0]
                             for s in self.specs if s.router is not None)  # fmt: skip

    def usable(self, chunks: list[list[int]]) -> bool:
        return ENABLED and self.lib is not None and all(len(c) == 1 for c in chunks)

    def whole(self, seqs: list) -> bool:
        """Whether a usable step of `seqs` is one whole-token call (`reap.engine.native_token`)."""
        return len(seqs) == 1 and self.token.ready()

    def covers_products(self, chunks: list[list[int]]) -> bool:
        """Whether every weight product of a many-token step of `chunks` runs in the kernels
        (every expert resident, and the bf16 tiles take at most BF16_ROWS tokens): torch is
        then left only small ops (`ckernel.torch_serial`)."""
        return self.serves(chunks, step_kernel.BF16_ROWS) and self.token.ready()

    def serves(self, chunks: list[list[int]], bf16_rows: int) -> bool:
        """Whether the path is on and, with bf16 weights, the chunks hold at most `bf16_rows`."""
        n = sum(len(c) for c in chunks)
        return ENABLED and self.lib is not None and (not self.wbf16 or n <= bf16_rows)

    # -- eligibility ----------------------------------------------------------------------------
    def _names(self):
        """Every stored tensor the native path reads (trunk weights, experts, head)."""
        eng = self.eng
        for i, s in enumerate(self.specs):
            yield from (s.prefix + n for n in (*s.attn, *s.norms, *(s.qk_norms or ())))
            if s.router is None:
                yield from (s.prefix + n for n in s.mlp)
                continue
            yield s.prefix + s.router
            for e in range(eng.reader.info(s.prefix + s.router).shape[0]):
                yield from eng.fam.expert_tensor_names(eng.cfg, i, e)
        yield from self.head_names[:2]

    def _dtypes_ok(self) -> bool:
        """One stored dtype everywhere: bf16 (with bf16 or fp32 compute) or fp32 with fp32."""
        tensors = self.eng.reader.tensors
        codes = {tensors[n].dtype for n in self._names() if n in tensors}
        if len(codes) != 1 or codes - {"BF16", "F32"}:
            return False
        self.wbf16 = codes == {"BF16"}
        return self.wbf16 or self.eng.dtype == torch.float32

    # -- the step -------------------------------------------------------------------------------
    def step(self, seqs, chunks, all_positions: bool, more: bool, first: int) -> list[torch.Tensor]:
        """`Engine.step` for one token per sequence (see `usable`)."""
        eng = self.eng
        self.lib.reap_pool_size(ckernel.threads())
        self.lib.reap_pool_spin(ckernel.SPINS)  # many small jobs follow each other
        if self.whole(seqs):
            out = [self.token.run(seqs[0], chunks[0][0])]
        else:
            hs = [st.hidden.reshape(-1).float().contiguous() for st in eng.embed(chunks)]  # [D]
            out = self._layers(seqs, hs, more)
        for s in seqs:
            s.length += 1
        return [o[None][first:] for o in out] if all_positions else out

    def _layers(self, seqs, hs, more: bool) -> list[torch.Tensor]:
        """Layer by layer, two calls per layer and sequence, then the head of each."""
        eng = self.eng
        for i, spec in enumerate(self.specs):
            t0 = time.perf_counter()
            units = eng.trunk.get(i)
            args = self.layer_args(i, spec, units)
            for h, s in zip(hs, seqs):
                self._attention(spec, args, h, s.caches[i])
                self._mlp(i, spec, args, units, h)
            eng.experts.release()
            eng.unit_seconds[i] += time.perf_counter() - t0
        t0 = time.perf_counter()
        out = [self._head(eng.trunk.get(len(self.specs), wrap=more), h) for h in hs]
        eng.unit_seconds[-1] += time.perf_counter() - t0
        return out

    def layer_args(self, i: int, spec, units: dict):
        """The layer's int64 argument block, its weight pointers refreshed when the unit's
        tensors are not the ones seen last (a streamed unit comes in a new dict each time)."""
        self.token.held = None  # the caller points the blocks elsewhere: the next token binds
        held = self._static[i]
        if held is not None and held[0] is units:
            return held[1]
        a = held[1] if held is not None else (ctypes.c_int64 * len(_A))()
        p = spec.prefix
        ptr = {k: units[p + n].data_ptr() for k, n in zip(("wq", "wk", "wv", "wo"), spec.attn)}
        ptr.update(in_norm=units[p + spec.norms[0]].data_ptr(),
                   post_norm=units[p + spec.norms[1]].data_ptr())  # fmt: skip
        if spec.qk_norms:
            ptr.update(q_norm=units[p + spec.qk_norms[0]].data_ptr(),
                       k_norm=units[p + spec.qk_norms[1]].data_ptr())  # fmt: skip
        router = units[p + spec.router] if spec.router else None
        step_kernel.put(
            a, _A, **ptr, router=router.data_ptr() if router is not None else 0,
            e=router.shape[0] if router is not None else 0, d=units[p + spec.norms[0]].shape[0],
            heads=spec.heads, kv_heads=spec.kv_heads, dh=spec.dk, window=spec.window or 0,
            rot=2 * spec.rotary.inv_freq.shape[0], k=spec.top_k, renorm=int(spec.renormalize),
            qk=0 if not spec.qk_norms else 1 if spec.qk_per_head else 2,
            wbf16=int(self.wbf16), rnd=int(self.rnd),
        )  # fmt: skip
        self._static[i] = (units, a)
        return a

    # -- the routed experts of many tokens (prefill chunks) --------------------------------------
    def moe(self, i: int, units: dict, x: torch.Tensor) -> torch.Tensor | None:
        """Layer i's routed experts for the tokens x [1, N, D] -> [N, D] in x's dtype, in one
        library call (see `routed`; the router runs in torch as the family runs it). None where
        this path does not serve the layer (dense MLP, path off, in bf16 more than PAIR_ROWS
        tokens an expert): the family's `mlp_block` then runs."""
        spec = self.specs[i] if self.lib is not None and ENABLED else None
        if spec is None or spec.router is None:
            return None
        flat = x.reshape(-1, x.shape[-1])  # [N, D]
        router = units[spec.prefix + spec.router].to(self.eng.dtype)
        logits = blocks.linear(flat, router)
        ids, weights, _ = blocks.softmax_topk(logits, spec.top_k, spec.renormalize)  # [N, K]
        y = self.routed(i, spec, flat, ids, weights, router.shape[0])
        return None if y is None else y.to(x.dtype)

    def routed(self, i: int, spec, flat, ids, weights, E: int) -> torch.Tensor | None:
        """Layer i's routed experts of the tokens flat [N, D] routed to ids, weights [N, K]
        (E experts) -> [N, D] fp32, in calls over ascending runs of experts, each adding to the
        sums (the same bits as one call): a run is the next expert (waiting for its read) and
        those after it already read, so the products overlap the later reads; one expert a call
        when the used experts are more than the cache holds at once. None in bf16 above
        PAIR_ROWS tokens an expert (see `moe`)."""
        used = sorted(set(ids.reshape(-1).tolist()))
        if self.rnd and ids.numel() > step_kernel.PAIR_ROWS * len(used):
            return None  # torch's bf16 matmul (dot-product instructions) is faster here
        if self.token.ready():  # the whole-token path's tables (the call reads the used rows)
            self.eng.experts.count_hits(len(used))
            return self.moe_call(flat, ids, weights, *self.token.expert_table(i))
        cache, y, k = self.eng.experts, None, 0
        cache.prefetch(i, used)  # as the torch path's MoE: reads start at once
        one = len(used) <= cache.n_slots
        while k < len(used):
            n = 1
            while one and k + n < len(used) and cache.ready(i, used[k + n]):
                n += 1
            table, F = torch.zeros(E, 3, dtype=torch.int64), 0  # [E, 3] gate/up/down pointers
            held = [(e, self.eng.stored_expert(i, e)) for e in used[k : k + n]]  # until the call
            for e, t in held:
                if t is not None:  # failed to load: contributes nothing (recorded, exit 4)
                    table[e] = torch.tensor([t[m].data_ptr() for m in spec.mlp])
                    F = t[spec.mlp[0]].shape[0]
            y, k = self.moe_call(flat, ids, weights, table, F, y), k + n
        return y

    def moe_call(self, flat, ids, weights, table, F: int, y=None) -> torch.Tensor:
        """The library's routed experts of flat [N, D] (pointers in table [E, 3]) -> [N, D]
        fp32; with `y`, the sums continue from y's values, written in place."""
        (N, D), (K, E) = flat.shape, (ids.shape[1], table.shape[0])
        add, y = y is not None, torch.zeros(N, D, dtype=torch.float32) if y is None else y
        if not table.any():
            return y
        sizes = (ctypes.c_int64 * 2)()
        self.lib.reap_moe_prefill_scratch(N, K, E, F, D, sizes)
        ints, floats = self._moe_scratch(sizes[0], sizes[1])
        xf, ids, w = flat.float().contiguous(), ids.contiguous(), weights.float().contiguous()
        args = step_kernel.pack(
            step_kernel.PREFILL, x=xf.data_ptr(), y=y.data_ptr(), ids=ids.data_ptr(),
            weights=w.data_ptr(), table=table.data_ptr(), n=N, k=K, e=E, f=F, d=D,
            wbf16=int(self.wbf16), rnd=int(self.rnd), floats=floats.data_ptr(),
            ints=ints.data_ptr(), add=int(add),
        )  # fmt: skip
        with ckernel.spinning(self.lib):
            self.lib.reap_moe_prefill(args)
        return y

    def _moe_scratch(self, ints: int, floats: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The many-token expert call's working buffers, kept between calls (tens of MB at a
        few hundred tokens: fresh ones cost the kernel's page zeroing every layer)."""
        held = getattr(self, "_moe_bufs", None)
        if held is None or held[0].numel() < ints or held[1].numel() < floats:
            held = self._moe_bufs = (torch.empty(ints, dtype=torch.int64), torch.empty(floats))
        return held

    def scratch_of(self, floats: int) -> torch.Tensor:
        """The working buffer of one library call, grown to `floats` when needed."""
        if self._scratch.numel() < floats:
            self._scratch = torch.empty(floats, dtype=torch.float32)
        return self._scratch

    def _attention(self, spec, a, h: torch.Tensor, cache) -> None:
        """The attention half for one sequence: h updated in place, the MLP input in _x2, the
        routing in _ids/_wts; the cache advanced by the position written."""
        a[_A["scratch"]] = self.scratch_of(self.bind(spec, a, h, cache)[0]).data_ptr()
        self.floats[0], self.floats[1] = spec.eps, spec.dk**-0.5
        self.lib.reap_attn_step(a, self.floats)
        cache.advance(1)

    def bind(self, spec, a, h: torch.Tensor, cache, outs: tuple = ()) -> tuple[int, int, tuple]:
        """Point the layer's block at one sequence's h [D] (or [T, D]), its cache's room, the
        rope table and the outputs (MLP input, routing ids, weights: the one-token buffers
        unless `outs`). Returns the scratch floats a one-token attention half needs at any
        position the buffers hold, those positions and the buffers (kept while bound)."""
        T = h.shape[0] if h.dim() == 2 else 1
        D, H, Hkv, Dh = a[_A["d"]], spec.heads, spec.kv_heads, spec.dk
        kc, vc = cache.room((1, Hkv, T, Dh), (1, Hkv, T, Dh), self.eng.dtype)
        pos = cache.length
        cos, sin = spec.rotary.table(pos + T)
        x2, ids, weights = outs or (self._x2, self._ids, self._wts)
        ts = {"h": h, "x2": x2, "cos": cos, "sin": sin, "kc": kc, "vc": vc, "ids": ids,
              "weights": weights}  # fmt: skip
        step_kernel.put(a, _A, **{k: t.data_ptr() for k, t in ts.items()}, cap=kc.shape[2], pos=pos)
        room = min(kc.shape[2], cos.shape[0])
        need = 2 * D + 2 * H * Dh + 2 * Hkv * Dh + max(H * room, 2 * a[_A["e"]]) + 64
        return need, room, (kc, vc, cos, sin)

    def _mlp(self, i: int, spec, a, units: dict, h: torch.Tensor) -> None:
        """The MLP half for one sequence: h += the routed experts' weighted sum (or the dense
        MLP's output). With OVERLAP, the resident experts are computed first, then each other
        one as soon as its read is done, while the later ones are still read (the sum runs once,
        over every expert in routing order: the same bits as one call)."""
        if spec.router is None:
            ts, ws = [tuple(units[spec.prefix + n] for n in spec.mlp)], [1.0]
            return self._experts(h, ts, ws, [0], set())
        ids, ws, cache = self._ids[: spec.top_k].tolist(), self._wts[: spec.top_k].tolist(), \
            self.eng.experts  # fmt: skip
        cache.prefetch(i, ids)
        here = [k for k, e in enumerate(ids) if (i, e) in cache.tensors]
        phases = [ph for ph in [here, *([k] for k in range(len(ids)) if k not in here)] if ph]
        if not OVERLAP or len(phases) == 1:
            phases = [list(range(len(ids)))]
        ts, done = [None] * len(ids), set()
        for p, phase in enumerate(phases):  # the get order is fixed: so are the cache's counts
            for k in phase:
                t = self.eng.stored_expert(i, ids[k])  # waits for this one's read only
                ts[k] = tuple(t[n] for n in spec.mlp) if t is not None else ()  # () failed (exit 4)
            self._experts(h, ts, ws, phase, done, nosum=p < len(phases) - 1)
            done.update(phase)

    def _experts(self, h, ts, ws, run, done: set, nosum=False) -> None:
        """One library call: experts ts[k] (gate, up, down; () = absent) for k in `run` into
        their scratch rows, those in `done` computed by an earlier call; then (unless nosum)
        h += the weighted sum over every present expert in order."""
        K, F, D = len(ts), next(t for t in ts if t)[0].shape[0] if any(ts) else 0, h.shape[0]
        skip = self._skip
        for k, t in enumerate(ts):
            skip[k] = 2 if not t else 0 if k in run else 1 if k in done else 2
            if k in run and t:
                self._ptrs[0][k], self._ptrs[1][k], self._ptrs[2][k] = (x.data_ptr() for x in t)
            self._w[k] = ws[k]
        if not F:
            return
        self.point_mlp(h, self.scratch_of(K * (F + D)))
        ptrs = {k: ctypes.addressof(p) for k, p in zip(("gate", "up", "down"), self._ptrs)}
        ptrs.update(weights=ctypes.addressof(self._w), skip=ctypes.addressof(skip))
        self.lib.reap_moe_step(step_kernel.put(self.mlp_args, _M, k=K, f=F, nosum=int(nosum),
                                               **ptrs))  # fmt: skip
        step_kernel.put(self.mlp_args, _M, skip=0, nosum=0)  # the whole-token call shares it

    def point_mlp(self, h: torch.Tensor, scratch: torch.Tensor) -> None:
        """The MLP argument block's fields for one sequence: its input (_x2), the residual h,
        the scratch, the width and rounding (the experts and their count are set per call)."""
        step_kernel.put(self.mlp_args, _M, x2=self._x2.data_ptr(), h=h.data_ptr(), d=h.shape[0],
                        scratch=scratch.data_ptr(), wbf16=int(self.wbf16), rnd=int(self.rnd))

    def _head(self, units: dict, h: torch.Tensor) -> torch.Tensor:
        """Final norm and head of one sequence -> logits [V] fp32 (bf16 values with bf16
        compute, as the torch path's)."""
        norm, head, eps = self.head_names
        w, (V, D) = units[head], units[head].shape
        logits, x = torch.empty(V, dtype=torch.float32), self.scratch_of(D)
        self.lib.reap_head_step(h.data_ptr(), units[norm].data_ptr(), w.data_ptr(), V, D,
                                int(self.wbf16), int(self.rnd), eps, x.data_ptr(),
                                logits.data_ptr())  # fmt: skip
        return logits


_ROUNDS = {torch.float32: False, torch.bfloat16: True}  # compute dtype -> round to bf16


def _hooks(model, n_layers: int) -> tuple[list, tuple | None]:
    """The family's compiled-decode hooks (`LayerModel.native_layer`, `native_head`), checked
    once at open: a wrong return type is a family bug, reported as one line (exit 1)."""
    from reap.errors import EXIT_FAILURE, ReapError

    specs, head = [model.native_layer(i) for i in range(n_layers)], model.native_head()
    bad = [f"native_layer({i}) returned {type(s).__name__}, not a NativeLayer or None"
           for i, s in enumerate(specs) if not isinstance(s, (blocks.NativeLayer, type(None)))]
    types = [type(v) for v in head or ()]
    if head is not None and not (isinstance(head, tuple) and types[:2] == [str, str]
                                 and len(types) == 3 and types[2] in (int, float)):  # fmt: skip
        bad.append(f"native_head() returned {head!r:.60}, not (norm, head, eps) or None")
    if bad:
        raise ReapError(f"model family {type(model).__module__}: {bad[0]}", EXIT_FAILURE)
    return specs, head
