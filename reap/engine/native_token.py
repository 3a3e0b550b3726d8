"""A whole token in one library call (`reap_token_step`: every layer, the same two halves as
`reap.engine.native`'s step, and the head) for one sequence decoding alone with the trunk pinned
and every routed expert resident (`--preset max`, after preload): nothing can be evicted, so the
pointer tables and argument blocks are built once. Each `NativeDecoder` holds a `WholeToken`.
"""

from __future__ import annotations

import ctypes

import torch

from reap.models.shared import blocks
from reap.quant import step_kernel

_A, _T = step_kernel.ATTN, step_kernel.TOKEN


class WholeToken:
    """The whole-token call of one `NativeDecoder` `nd` (see module docstring)."""

    def __init__(self, nd):
        self.nd = nd
        self.tok: dict | None = None  # reap_token_step's lasting arguments (`ready`)
        self.held: dict | None = None  # the blocks' binding to a sequence (None: bind anew)

    def ready(self) -> bool:
        """Whether a token can run as one call: the trunk pinned and every routed expert
        resident; the lasting arguments are built the first time."""
        eng = self.nd.eng
        if eng.trunk.streamed or len(eng.experts.tensors) != self.nd.n_experts:
            return False
        if self.tok is None:
            self.tok = self._arguments()
        return True

    def expert_table(self, i: int) -> tuple[torch.Tensor, int]:
        """Layer i's [E, 3] gate/up/down pointers of every expert and their width (once `ready`)."""
        return self.tok["pointers"][i], self.tok["f"][i]

    def run(self, seq, token: int) -> torch.Tensor:
        """One sequence's token through every layer and the head in one call -> logits [V]."""
        nd, tok = self.nd, self.tok
        args, table = tok["args"], tok["table"]
        if table is not None and 0 <= token < table.shape[0]:  # reap_token_step casts the row
            args[_T["emb"]] = table.data_ptr() + token * table.stride(0) * table.element_size()
            args[_T["emb_bf16"]] = int(table.dtype == torch.bfloat16)
        else:  # the family's embedding (or the error of a bad id)
            args[_T["emb"]] = args[_T["emb_bf16"]] = 0
            with torch.inference_mode():  # h may have been made in it
                tok["h"].copy_(nd.eng.embed([[token]])[0].hidden.reshape(-1))
        args[_T["pos"]] = self._position(seq)
        logits = torch.empty(tok["head"].shape[0], dtype=torch.float32)
        args[_T["logits"]] = logits.data_ptr()
        times = tok["times"]
        ctypes.memset(times, 0, ctypes.sizeof(times))
        nd.lib.reap_token_step(args, tok["floats"])
        for c in seq.caches:
            c.advance(1)
        nd.eng.experts.count_hits(tok["uses"])
        for i, t in enumerate(times):
            nd.eng.unit_seconds[i] += t
        return logits

    def _arguments(self) -> dict:
        """The argument blocks of `reap_token_step` that do not change between tokens."""
        nd, L = self.nd, len(self.nd.specs)
        layer_args, tables, dense, widths, uses = self._expert_tables()
        units = nd.eng.trunk.get(L)
        norm, head, eps = nd.head_names
        V, D = units[head].shape
        arrays = {  # the C side's per-layer arrays, by their field names
            "attn": (ctypes.c_int64 * L)(*(ctypes.addressof(a) for a in layer_args)),
            "tables": (ctypes.c_int64 * L)(*(x.data_ptr() for x in tables)),
            "dense": (ctypes.c_int64 * L)(*dense), "f": (ctypes.c_int64 * L)(*widths),
            "times": (ctypes.c_double * (L + 1))(),
        }  # fmt: skip
        x = torch.empty(D)
        args = step_kernel.put(
            (ctypes.c_int64 * len(_T))(), _T, **{k: ctypes.addressof(a) for k, a in arrays.items()},
            layers=L, moe=ctypes.addressof(nd.mlp_args), norm=units[norm].data_ptr(),
            head=units[head].data_ptr(), v=V, x=x.data_ptr(),
        )  # fmt: skip
        floats = (v for s in nd.specs for v in (s.eps, s.dk**-0.5))
        return {
            **arrays, "args": args, "x": x, "h": torch.empty(D), "head": units[head],
            "layer_args": layer_args, "pointers": tables, "uses": uses,
            "floats": (ctypes.c_double * (2 * L + 1))(*floats, eps),
            "scratch": max((1 if d else s.top_k) * (f + D)
                           for d, s, f in zip(dense, nd.specs, widths)),
            "table": self._lookup_table(),
        }  # fmt: skip

    def _lookup_table(self) -> torch.Tensor | None:
        """The resident embedding table where the family embeds by plain lookup and cast
        (`blocks.PreNormModel.embed`) and its rows are contiguous bf16 or fp32; else None."""
        table, model = self.nd.eng.embedding, self.nd.eng.model
        if table is None or type(model).embed is not blocks.PreNormModel.embed:
            return None
        ok = table.device.type == "cpu" and table.dim() == 2 and table.stride(1) == 1
        return table if ok and table.dtype in (torch.bfloat16, torch.float32) else None

    def _expert_tables(self):
        """Per layer its argument block, [E, 3] gate/up/down pointers (a dense MLP: its one
        triple), whether it is dense, its MLP width; and the expert uses per token."""
        eng = self.nd.eng
        layer_args, tables, dense, widths, uses = [], [], [], [], 0
        for i, s in enumerate(self.nd.specs):
            units = eng.trunk.get(i)
            layer_args.append(self.nd.layer_args(i, s, units))  # pinned: the same block for good
            if s.router is None:
                rows = [tuple(units[s.prefix + n] for n in s.mlp)]
            else:
                E = units[s.prefix + s.router].shape[0]
                rows = [tuple(eng.experts.tensors[(i, e)][n] for n in s.mlp) for e in range(E)]
                uses += s.top_k
            tables.append(torch.tensor([[w.data_ptr() for w in r] for r in rows]))
            dense.append(int(s.router is None))
            widths.append(rows[0][0].shape[0])
        return layer_args, tables, dense, widths, uses

    def _position(self, seq) -> int:
        """The cache position this token writes, every layer's block pointed at seq's caches and
        rope tables, the token's h and the scratch. A binding lasts while the buffers have room,
        the scratch has not grown and no other step pointed the blocks elsewhere (`held`): the
        next token sets only the position. Python between two tokens runs with caches the
        weights just streamed through: the less of it, the faster."""
        held, pos = self.held, seq.caches[0].length
        if not (held and held["seq"] is seq and held["pos"] == pos and pos < held["room"]
                and held["scratch"] is self.nd.scratch_of(0)):  # fmt: skip
            held = self._bind(seq)
        held["pos"] = pos + 1  # where this binding expects the next token (else another step ran)
        return pos

    def _bind(self, seq) -> dict:
        """Bind every layer's block to seq's state (see `_position`); the scratch sized for the
        last position the buffers hold."""
        nd, tok = self.nd, self.tok
        args = tok["layer_args"]
        bound = [nd.bind(s, a, tok["h"], c) for s, a, c in zip(nd.specs, args, seq.caches)]
        scratch = nd.scratch_of(max(*(b[0] for b in bound), tok["scratch"]))
        for a in args:
            a[_A["scratch"]] = scratch.data_ptr()
        nd.point_mlp(tok["h"], scratch)
        self.held = {"seq": seq, "room": min(b[1] for b in bound), "scratch": scratch,
                     "buffers": [b[2] for b in bound]}  # fmt: skip
        return self.held
