"""Decode steps through the compiled step kernels (`reap.quant.step_kernel`): when every
sequence of a step advances by one token, on the CPU, and the family describes each layer as a
`reap.models.blocks.NativeLayer` with dense bf16/fp32 weights, a layer costs two library calls
per sequence (attention half, then the MLP half with the routed experts' weights) and the head
one, instead of some fifty torch ops and Python calls; a sequence decoding alone with the trunk
pinned and every expert resident takes one call for the whole token (`reap_token_step`, the
same two halves per layer). Matrix-vector products are split over a persistent pool of the
engine's thread count.

Everything else is the engine's own: the trunk store and ring (`get`), the expert cache (reads,
prefetch, hit counts, failures: a failed expert contributes nothing, as the zeros the torch
path runs), the KV caches (written in place), the timings. The torch path (`Engine._step`) is
the reference: the same arithmetic up to the order of a few reductions (norm means, attention),
each value rounded to bf16 where torch rounds it (`tests/test_native_step.py` holds the two
together). Set `ENABLED = False` (or REAP_NO_NATIVE=1) to run every step through torch.
"""

from __future__ import annotations

import ctypes
import time

import torch

from reap.models import blocks
from reap.quant import ckernel, step_kernel

ENABLED = True  # False: every step through the torch path (the reference), for the tests
_A, _M, _T = step_kernel.ATTN, step_kernel.MOE, step_kernel.TOKEN


class NativeDecoder:
    """The compiled decode path of one engine (see module docstring); `usable(chunks)` says
    whether a step can take it, `step` runs it."""

    def __init__(self, engine):
        self.eng = engine
        self.lib = None
        model, n_layers = engine.model, len(engine.binding.units) - 1
        layer_of = getattr(model, "native_layer", None)
        if engine.device != "cpu" or layer_of is None or engine.dtype not in _ROUNDS:
            return
        self.specs = [layer_of(i) for i in range(n_layers)]
        self.head_names = model.native_head()
        if any(s is None or s.top_k > step_kernel.MAX_TOP_K for s in self.specs):
            return
        if not self._dtypes_ok():
            return
        self.lib = step_kernel.library()
        self.rnd = _ROUNDS[engine.dtype]
        self._static: list = [None] * n_layers  # (units dict, int64 args) per layer
        self._scratch = torch.empty(0)
        self._floats = (ctypes.c_double * 2)()
        k = max(1, *(s.top_k for s in self.specs))
        self._x2 = torch.empty(engine.reader.info(self.head_names[0]).shape[0])  # MLP input [D]
        self._ids = torch.empty(k, dtype=torch.int64)  # a token's routing, ascending ids
        self._wts = torch.empty(k, dtype=torch.float32)
        self._moe = (ctypes.c_int64 * len(_M))()
        self._ptrs = [(ctypes.c_int64 * k)() for _ in range(3)]  # gate, up, down pointers
        self._w = (ctypes.c_float * k)()
        self._tok = None  # reap_token_step's lasting arguments, once every expert is resident
        self._held = None  # the whole-token binding (`_position`)
        self._n_experts = sum(engine.reader.info(s.prefix + s.router).shape[0]
                              for s in self.specs if s.router is not None)  # fmt: skip

    def usable(self, chunks: list[list[int]]) -> bool:
        return ENABLED and self.lib is not None and all(len(c) == 1 for c in chunks)

    def whole(self, seqs: list) -> bool:
        """Whether a usable step of `seqs` runs as one `reap_token_step` call (one sequence,
        every weight resident)."""
        return len(seqs) == 1 and self._resident()

    def covers_products(self, chunks: list[list[int]]) -> bool:
        """Whether every weight product of a many-token step of `chunks` runs in the kernels:
        every expert resident (no layer's experts fall back to torch), fp32 weights (the tiles
        take any number of rows) or bf16 ones with at most BF16_ROWS tokens. torch is then left
        only small ops (`ckernel.torch_serial`)."""
        n = sum(len(c) for c in chunks)
        return (ENABLED and self.lib is not None and self._resident()
                and (not self.wbf16 or n <= step_kernel.BF16_ROWS))  # fmt: skip

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
    def step(self, seqs, chunks, all_positions: bool, more: bool) -> list[torch.Tensor]:
        """`Engine.step` for one token per sequence (see `usable`)."""
        eng = self.eng
        self.lib.reap_pool_size(ckernel.threads())
        self.lib.reap_pool_spin(ckernel.SPINS)  # many small jobs follow each other
        if self.whole(seqs):
            out = [self._token(seqs[0], chunks[0][0])]
        else:
            hs = [st.hidden.reshape(-1).float().contiguous() for st in eng._embed(chunks)]  # [D]
            out = self._layers(seqs, hs, more)
        for s in seqs:
            s.length += 1
        return [o[None] for o in out] if all_positions else out

    def _layers(self, seqs, hs, more: bool) -> list[torch.Tensor]:
        """Layer by layer, two calls per layer and sequence, then the head of each."""
        eng = self.eng
        for i, spec in enumerate(self.specs):
            t0 = time.perf_counter()
            units = eng.trunk.get(i)
            args = self._layer_args(i, spec, units)
            for h, s in zip(hs, seqs):
                self._attention(spec, args, h, s.caches[i])
                self._mlp(i, spec, args, units, h)
            eng.experts.release()
            eng.unit_seconds[i] += time.perf_counter() - t0
        t0 = time.perf_counter()
        out = [self._head(eng.trunk.get(len(self.specs), wrap=more), h) for h in hs]
        eng.unit_seconds[-1] += time.perf_counter() - t0
        return out

    def _layer_args(self, i: int, spec, units: dict):
        """The layer's int64 argument block, its weight pointers refreshed when the unit's
        tensors are not the ones seen last (a streamed unit comes in a new dict each time)."""
        self._held = None  # the caller points the blocks elsewhere: `_token` binds anew
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
        library call (expert-major, row blocks over the thread pool); the router runs in
        torch as the family runs it. None where this path does not serve the layer (dense
        MLP, path off; in bf16, more than step_kernel.PAIR_ROWS tokens per expert on
        average): the family's `mlp_block` then runs."""
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
        (E experts) -> [N, D] fp32: one library call, or one per expert (ascending, each adding
        to the sums: the same bits) when the used experts are more than the cache holds at
        once. None in bf16 above PAIR_ROWS tokens an expert (see `moe`)."""
        used = sorted(set(ids.reshape(-1).tolist()))
        if self.rnd and ids.numel() > step_kernel.PAIR_ROWS * len(used):
            return None  # torch's bf16 matmul (dot-product instructions) is faster here
        if len(used) <= self.eng.experts.n_slots:
            table, F = self._expert_table(i, spec, used, E)
            return self._moe_call(flat, ids, weights, table, F)
        self.eng.experts.prefetch(i, used)  # as the torch path's MoE: reads start at once
        y = torch.zeros(flat.shape, dtype=torch.float32)
        for e in used:
            t = self.eng.stored_expert(i, e)  # held until the call returns
            if t is not None:  # failed to load: contributes nothing (recorded, exit 4)
                table = torch.zeros(E, 3, dtype=torch.int64)
                table[e] = torch.tensor([t[n].data_ptr() for n in spec.mlp])
                self._moe_call(flat, ids, weights, table, t[spec.mlp[0]].shape[0], y)
        return y

    def _expert_table(self, i: int, spec, used: list[int], E: int) -> tuple[torch.Tensor, int]:
        """Layer i's [E, 3] gate/up/down pointers of the experts in `used` (0 elsewhere, and for
        an expert that failed to load: it contributes nothing, recorded, exit 4) and the
        experts' width; with every expert resident, the whole-token path's table, built once
        (the call reads the rows of the used experts only)."""
        if self._resident():
            self.eng.experts.count_hits(len(used))
            return self._tok["tables"][i], self._tok["f"][i]
        self.eng.experts.prefetch(i, used)
        table = torch.zeros(E, 3, dtype=torch.int64)
        F = 0
        for e in used:  # the cache holds every used expert until release(): pointers stay valid
            t = self.eng.stored_expert(i, e)
            if t is not None:
                table[e] = torch.tensor([t[n].data_ptr() for n in spec.mlp])
                F = t[spec.mlp[0]].shape[0]
        return table, F

    def _moe_call(self, flat, ids, weights, table, F: int, y=None) -> torch.Tensor:
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

    def _scratch_of(self, floats: int) -> torch.Tensor:
        """The working buffer of one library call, grown to `floats` when needed."""
        if self._scratch.numel() < floats:
            self._scratch = torch.empty(floats, dtype=torch.float32)
        return self._scratch

    def _attention(self, spec, a, h: torch.Tensor, cache) -> None:
        """The attention half for one sequence: h updated in place, the MLP input in _x2, the
        routing in _ids/_wts; the cache advanced by the position written."""
        a[_A["scratch"]] = self._scratch_of(self._bind(spec, a, h, cache)[0]).data_ptr()
        self._floats[0], self._floats[1] = spec.eps, spec.dk**-0.5
        self.lib.reap_attn_step(a, self._floats)
        cache.advance(1)

    def _bind(self, spec, a, h: torch.Tensor, cache) -> tuple[int, int, tuple]:
        """Point the layer's arguments at one sequence's state (h, the cache's room for one
        more position, the rope table). Returns the scratch floats its attention half needs
        at any position the buffers hold, those positions (the room of both the cache and the
        table) and the buffers (kept alive while a binding lasts)."""
        D, H, Hkv, Dh = a[_A["d"]], spec.heads, spec.kv_heads, spec.dk
        kc, vc = cache.room((1, Hkv, 1, Dh), (1, Hkv, 1, Dh), self.eng.dtype)
        pos = cache.length
        cos, sin = spec.rotary.table(pos + 1)
        ts = {"h": h, "x2": self._x2, "cos": cos, "sin": sin, "kc": kc, "vc": vc,
              "ids": self._ids, "weights": self._wts}  # fmt: skip
        step_kernel.put(a, _A, **{k: t.data_ptr() for k, t in ts.items()}, cap=kc.shape[2], pos=pos)
        room = min(kc.shape[2], cos.shape[0])
        need = 2 * D + 2 * H * Dh + 2 * Hkv * Dh + max(H * room, 2 * a[_A["e"]]) + 64
        return need, room, (kc, vc, cos, sin)

    def _mlp(self, i: int, spec, a, units: dict, h: torch.Tensor) -> None:
        """The MLP half for one sequence: h += the routed experts' weighted sum (or the dense
        MLP's output)."""
        if spec.router is None:
            triples, weights = [tuple(units[spec.prefix + n] for n in spec.mlp)], [1.0]
        else:
            ids = self._ids[: spec.top_k].tolist()
            self.eng.experts.prefetch(i, ids)
            triples, weights = [], []
            for e, w in zip(ids, self._wts[: spec.top_k].tolist()):
                t = self.eng.stored_expert(i, e)
                if t is not None:  # failed to load: contributes nothing (recorded, exit 4)
                    triples.append(tuple(t[n] for n in spec.mlp))
                    weights.append(w)
        if not triples:
            return
        F, D = triples[0][0].shape
        scratch = self._scratch_of(len(triples) * (F + D))
        m = self._moe
        for k, (g, u, d) in enumerate(triples):
            self._ptrs[0][k], self._ptrs[1][k] = g.data_ptr(), u.data_ptr()
            self._ptrs[2][k], self._w[k] = d.data_ptr(), weights[k]
        self._point_mlp(h, scratch)
        ptrs = {k: ctypes.addressof(p) for k, p in zip(("gate", "up", "down"), self._ptrs)}
        step_kernel.put(m, _M, k=len(triples), f=F, weights=ctypes.addressof(self._w), **ptrs)
        self.lib.reap_moe_step(m)

    def _point_mlp(self, h: torch.Tensor, scratch: torch.Tensor) -> None:
        """The MLP argument block's fields for one sequence: its input (_x2), the residual h,
        the scratch, the width and rounding (the experts and their count are set per call)."""
        step_kernel.put(self._moe, _M, x2=self._x2.data_ptr(), h=h.data_ptr(), d=h.shape[0],
                        scratch=scratch.data_ptr(), wbf16=int(self.wbf16), rnd=int(self.rnd))

    def _head(self, units: dict, h: torch.Tensor) -> torch.Tensor:
        """Final norm and head of one sequence -> logits [V] fp32 (bf16 values with bf16
        compute, as the torch path's)."""
        norm, head, eps = self.head_names
        w = units[head]
        V, D = w.shape
        logits = torch.empty(V, dtype=torch.float32)
        x = self._scratch_of(D)
        self.lib.reap_head_step(h.data_ptr(), units[norm].data_ptr(), w.data_ptr(), V, D,
                                int(self.wbf16), int(self.rnd), eps, x.data_ptr(),
                                logits.data_ptr())  # fmt: skip
        return logits

    # -- a whole token in one call (every trunk unit pinned, every routed expert resident) ------
    def _resident(self) -> bool:
        """Whether a token can run as one library call: the trunk is pinned and every routed
        expert resident (at `--preset max`, after preload). Nothing can be evicted then, so
        the expert pointer tables, built once, stay valid."""
        eng = self.eng
        n = len(eng.experts.tensors)
        if eng.trunk.streamed or n != self._n_experts:
            return False
        if self._tok is None:
            self._tok = self._token_args()
        return True

    def _token_args(self) -> dict:
        """The argument blocks of `reap_token_step` that do not change between tokens."""
        eng, L = self.eng, len(self.specs)
        tables, dense, widths, uses = self._expert_tables()
        units = eng.trunk.get(L)
        norm, head, eps = self.head_names
        keep = {
            "args": (ctypes.c_int64 * len(_T))(), "tables": tables, "uses": uses,
            "head": units[head], "x": torch.empty(units[head].shape[1]),
            "attn": (ctypes.c_int64 * L)(*(ctypes.addressof(self._static[i][1]) for i in range(L))),
            "tabs": (ctypes.c_int64 * L)(*(x.data_ptr() for x in tables)),
            "dense": (ctypes.c_int64 * L)(*dense), "f": (ctypes.c_int64 * L)(*widths),
            "times": (ctypes.c_double * (L + 1))(),
            "floats": (ctypes.c_double * (2 * L + 1))(
                *(v for s in self.specs for v in (s.eps, s.dk**-0.5)), eps),
            "scratch": max((1 if d else s.top_k) * (f + self._x2.shape[0])
                           for d, s, f in zip(dense, self.specs, widths)),
            "h": torch.empty(self._x2.shape[0]), "table": self._lookup_table(),
        }  # fmt: skip
        t = keep["args"]
        for k in ("attn", "tabs", "dense", "f", "times"):
            t[_T["tables" if k == "tabs" else k]] = ctypes.addressof(keep[k])
        t[_T["layers"]], t[_T["moe"]] = L, ctypes.addressof(self._moe)
        t[_T["norm"]], t[_T["head"]] = units[norm].data_ptr(), units[head].data_ptr()
        t[_T["v"]], t[_T["x"]] = units[head].shape[0], keep["x"].data_ptr()
        return keep

    def _lookup_table(self) -> torch.Tensor | None:
        """The resident embedding table where the family embeds by plain lookup and cast
        (`blocks.PreNormModel.embed`) and its rows are contiguous bf16 or fp32; else None."""
        table, model = self.eng._table, self.eng.model
        if table is None or type(model).embed is not blocks.PreNormModel.embed:
            return None
        ok = table.device.type == "cpu" and table.dim() == 2 and table.stride(1) == 1
        return table if ok and table.dtype in (torch.bfloat16, torch.float32) else None

    def _expert_tables(self):
        """Per layer the [E, 3] gate/up/down pointers of its resident experts (a dense MLP: its
        one triple), whether it is dense, its MLP width; and the expert uses per token."""
        eng = self.eng
        tables, dense, widths, uses = [], [], [], 0
        for i, s in enumerate(self.specs):
            units = eng.trunk.get(i)
            self._layer_args(i, s, units)
            if s.router is None:
                rows = [tuple(units[s.prefix + n] for n in s.mlp)]
            else:
                E = units[s.prefix + s.router].shape[0]
                rows = [tuple(eng.experts.tensors[(i, e)][n] for n in s.mlp) for e in range(E)]
                uses += s.top_k
            tables.append(torch.tensor([[w.data_ptr() for w in r] for r in rows]))
            dense.append(int(s.router is None))
            widths.append(rows[0][0].shape[0])
        return tables, dense, widths, uses

    def _token(self, seq, token: int) -> torch.Tensor:
        """One sequence's token through every layer and the head in one call -> logits [V]."""
        eng, tok = self.eng, self._tok
        args = tok["args"]
        args[_T["emb"]], args[_T["emb_bf16"]] = self._embedding_row(token)
        if not args[_T["emb"]]:  # the family's embedding (or the error of a bad id)
            with torch.inference_mode():  # h may have been made in it
                tok["h"].copy_(eng._embed([[token]])[0].hidden.reshape(-1))
        args[_T["pos"]] = self._position(seq)
        logits = torch.empty(tok["head"].shape[0], dtype=torch.float32)
        args[_T["logits"]] = logits.data_ptr()
        times = tok["times"]
        ctypes.memset(times, 0, ctypes.sizeof(times))
        self.lib.reap_token_step(args, tok["floats"])
        for c in seq.caches:
            c.advance(1)
        eng.experts.count_hits(tok["uses"])
        for i, t in enumerate(times):
            eng.unit_seconds[i] += t
        return logits

    def _embedding_row(self, token: int) -> tuple[int, int]:
        """The address of the token's row in the resident embedding table and whether it is
        bf16, where the family embeds by lookup and cast (`reap_token_step` casts it); (0, 0)
        elsewhere, and for an id outside the table."""
        table = self._tok["table"]
        if table is None or not 0 <= token < table.shape[0]:
            return 0, 0
        return table.data_ptr() + token * table.stride(0) * table.element_size(), int(
            table.dtype == torch.bfloat16
        )

    def _position(self, seq) -> int:
        """The cache position this token writes, every layer's block pointed at seq's caches
        and rope tables, the token's h and the scratch. A binding lasts while the buffers have
        room and no other step pointed the blocks elsewhere (`_layer_args` voids it): the next
        token then sets only the position (in `reap_token_step`). Python between two tokens
        runs with caches the weights just streamed through: the less of it, the faster."""
        held, pos = self._held, seq.caches[0].length
        if not (held and held["seq"] is seq and held["pos"] == pos and pos < held["room"]
                and held["scratch"] is self._scratch):  # fmt: skip
            held = self._bind_token(seq)
        held["pos"] = pos + 1  # where this binding expects the next token (else another step ran)
        return pos

    def _bind_token(self, seq) -> dict:
        """Bind every layer's block to seq's state for the whole-token call (see `_position`);
        the scratch sized for the last position the buffers hold."""
        tok, L = self._tok, len(self.specs)
        args = [self._static[i][1] for i in range(L)]
        bound = [self._bind(s, a, tok["h"], c) for s, a, c in zip(self.specs, args, seq.caches)]
        scratch = self._scratch_of(max(*(b[0] for b in bound), tok["scratch"]))
        for a in args:
            a[_A["scratch"]] = scratch.data_ptr()
        self._point_mlp(tok["h"], scratch)
        self._held = {"seq": seq, "room": min(b[1] for b in bound), "scratch": scratch,
                      "buffers": [b[2] for b in bound]}  # fmt: skip
        return self._held


_ROUNDS = {torch.float32: False, torch.bfloat16: True}  # compute dtype -> round to bf16
