"""Merged experts (`reap prune` on a `--method` plan): a group of several source experts becomes
their weighted average, in float32 from the decoded tensors, stored like the source (names,
dtypes, shapes; quantized matrices, by layout role, re-encoded with `reap.quant`'s codecs). With
align "weight-matching" (M-SMoE) each member's neurons are first permuted to the dominant's: the
linear assignment minimising the summed squared distance of the neurons' weights (input matrix
rows, output matrix columns). The re-encoding's relative Frobenius error goes to the manifest;
`verify` recomputes each merged expert with this code.
"""

from __future__ import annotations

import torch

from reap.errors import ReapError
from reap.models.base import expert_short_names

# a codec's first stored part -> the parts that follow it (`TensorSpec.role`s)
_CODECS = {"mxfp4.blocks": ("mxfp4.scales",), "fp8.weight": ("fp8.scales",),
           "int4.packed": ("int4.scales", "int4.shape")}
# the output matrix of a GLU expert, by the short names families use (HF down_proj; w2)
_OUTPUT_NAMES = ("down", "w2")


class Merger:
    """Merged tensors of a build's groups {layer: [[[expert, weight], ...] per new id]}."""

    def __init__(self, ck, fam, groups: dict[int, list], align: str | None):
        self.ck, self.fam, self.groups, self.align = ck, fam, groups, align
        self.cfg = fam.Config.from_dict(ck.config)
        specs = [s for s in fam.layout(ck.config) if s.expert is not None]
        self.roles = {s.name: s.role for s in specs}
        self.blocks = {s.name: s.block for s in specs if s.block}  # FP8 weights' scale blocks
        self.errors: dict[tuple[int, int], float] = {}

    def members(self, layer: int, new: int) -> list | None:
        """[[expert, weight], ...] of output expert `new`; None when it is one source expert."""
        group = self.groups.get(layer, [[0]] * (new + 1))[new]
        return group if len(group) > 1 else None

    def tensors(self, layer: int, new: int) -> list[torch.Tensor]:
        """Output expert `new`'s stored tensors in `expert_tensor_names` order."""
        group, total = self.groups[layer][new], None
        names0 = self.fam.expert_tensor_names(self.cfg, layer, group[0][0])
        layout = _matrices(names0, [self.roles.get(n, "weight") for n in names0])
        short = [expert_short_names(names0)[part[0][0]] for part in layout]
        blocks = [self.blocks.get(names0[part[0][0]]) for part in layout]
        for e, w in group:
            names = self.fam.expert_tensor_names(self.cfg, layer, e)
            got = self.ck.read_many(names)
            stored = [[(r, got[names[i]]) for i, r in part] for part in layout]
            mats = [_decode(part, block) for part, block in zip(stored, blocks)]
            if total is None:
                first, dom, total = stored, mats, [m * w for m in mats]
                continue
            if self.align:
                mats = _aligned(mats, dom, short, names[0])
            total = [t + m * w for t, m in zip(total, mats)]
        out, err, ref = [], 0.0, 0.0
        for like, merged, block in zip(first, total, blocks):
            parts = _encode(merged, like, block)
            back = _decode([(r, t) for (r, _), t in zip(like, parts)], block)
            err += float((back - merged).double().pow(2).sum())
            ref += float(merged.double().pow(2).sum())
            out += parts
        self.errors[(layer, new)] = (err / ref) ** 0.5 if ref > 0 else 0.0
        return out


def _matrices(names: list[str], roles: list[str]) -> list[list[tuple[int, str]]]:
    """The expert's tensors grouped into matrices: [(index, role), ...] each, a codec's parts
    after its first part."""
    out: list[list[tuple[int, str]]] = []
    for i, role in enumerate(roles):
        if out and role in _CODECS.get(out[-1][0][1], ()):
            out[-1].append((i, role))
        elif "." in role and role not in _CODECS:
            raise ReapError(f"{names[i]}: a {role} tensor without its codec's first part")
        else:
            out.append([(i, role)])
    return out


def _decode(parts: list[tuple[str, torch.Tensor]], block=None) -> torch.Tensor:
    """One matrix's stored parts [(role, tensor)] -> its weights in float32 (`block`: an FP8
    weight's scale block, from the layout)."""
    from reap.quant import fp8, int4, mxfp4

    role, t = parts[0]
    if role == "mxfp4.blocks":  # packed [..., N/2] (or [..., N/32, 16]), scales [..., N/32]
        scales = parts[1][1]
        return mxfp4.dequantize(t.reshape(*scales.shape[:-1], -1), scales)
    if role == "fp8.weight":
        return fp8.dequantize(t, parts[1][1], block)
    if role == "int4.packed":
        return int4.INT4Matrix.from_stored(t, parts[1][1], parts[2][1]).dense()
    return t.float()


def _encode(w: torch.Tensor, like: list[tuple[str, torch.Tensor]],
            block=None) -> list[torch.Tensor]:
    """Weights w (float32) stored as the parts `like` are: same dtypes and shapes."""
    from reap.quant import fp8, int4, mxfp4

    role, t = like[0]
    if role == "mxfp4.blocks":
        packed, scales = mxfp4.quantize(w)
        return [packed.reshape(t.shape), scales.reshape(like[1][1].shape)]
    if role == "fp8.weight":
        q, scale = fp8.quantize(w, block)
        return [q.to(t.dtype), scale.to(like[1][1].dtype)]
    if role == "int4.packed":
        m = int4.INT4Matrix.from_stored(t, like[1][1], like[2][1])
        packed, scales = int4.quantize(w, m.group, like[1][1].dtype)
        return [packed.to(t.dtype), scales, like[2][1].clone()]
    return [w.to(t.dtype)]


def _aligned(mats: list[torch.Tensor], dom: list[torch.Tensor], short: list[str],
             where: str) -> list[torch.Tensor]:
    """mats with their intermediate neurons permuted to best match dom's (weight matching): the
    input matrices' rows and the output matrix's columns (`short`: the matrices' short names)."""
    from scipy.optimize import linear_sum_assignment

    out_at = [i for i, n in enumerate(short) if n.startswith(_OUTPUT_NAMES)]
    F = mats[out_at[0]].shape[-1] if len(out_at) == 1 else -1
    if len(out_at) != 1 or any(m.dim() != 2 or (i not in out_at and m.shape[0] != F)
                               for i, m in enumerate(mats)):
        raise ReapError(f"{where}: neuron alignment needs a GLU expert: [F, D] input "
                        "matrices and one [D, F] output matrix named down_proj or w2")
    cost = torch.zeros(F, F, dtype=torch.float64)
    for i, (m, d) in enumerate(zip(mats, dom)):
        a, b = (m.T, d.T) if i in out_at else (m, d)  # [F, *] neuron rows
        cost += torch.cdist(a.double(), b.double()).pow(2)
    _, to_dom = linear_sum_assignment(cost.numpy())  # neuron i -> dominant neuron to_dom[i]
    perm = torch.as_tensor(to_dom).argsort()  # new neuron j = old neuron perm[j]
    return [m[:, perm] if i in out_at else m[perm] for i, m in enumerate(mats)]
