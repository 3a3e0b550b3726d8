"""Checks of a checkpoint's weights against its family, shared by every stage that reads them
(`reap run`, `reap calibrate`, `reap info`), so they refuse the same checkpoints:

    specs = check_binding(ckpt.tensors, fam, config, path)   # names, shapes, dtypes: exit 1
    guard = FiniteGuard(fam, cfg, specs, path)
    guard(name, tensor)                                       # NaN/Inf in a norm or router: exit 2

`FiniteGuard` checks, once per tensor when it is first read, that the small tensors feeding routing and normalization (norm weights, router
weights and biases) hold no NaN or Inf: such a value does not fail loudly later, it turns every
routing decision or logit into NaN (then token 0). The large matrices are never scanned.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from reap.checkpoint import split_view
from reap.checkpoint.spec import UNUSED_COMPONENTS
from reap.errors import EXIT_FAILURE, CheckpointError, ReapError

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# components the text model never reads: listed by layouts, recognised by binding, not bound
NOT_READ = frozenset({"vision", "buffers", *UNUSED_COMPONENTS})
# roles (TensorSpec.role) of the tensors feeding normalization and routing
GUARDED_ROLES = frozenset({"norm", "router_bias"})


def check_binding(tensors: Mapping, fam, config: dict, path: str, layout=None) -> list:
    """The layout's TensorSpecs the text model reads, after checking that `tensors` (name ->
    anything with `.shape` and `.dtype`) holds each with its shape and a dtype the family reads
    (`read_dtypes`) and nothing the layout does not name; else ReapError (exit 1, "tensor
    binding failed"). Tensors the text model never reads (`NOT_READ`) are checked the same way
    when present, and not returned. `layout`: `fam.layout(config)` if the caller has it."""
    layout = fam.layout(config) if layout is None else layout
    specs = [s for s in layout if s.component not in NOT_READ]
    known = {split_view(s.name)[0] for s in layout}  # fused views: stored name
    for s in layout:
        t = tensors.get(s.name)
        if t is None and s.component in NOT_READ:
            continue  # a release may leave them out; the text model does not need them
        if t is None:
            raise ReapError(f"{path}: tensor binding failed: {s.name} is missing", EXIT_FAILURE)
        bad_dtype = t.dtype != s.dtype and t.dtype not in read_dtypes(fam, s)
        if tuple(t.shape) != tuple(s.shape) or bad_dtype:
            raise ReapError(
                f"{path}: tensor binding failed: {s.name} is {t.dtype} "
                f"{list(t.shape)}, the layout wants {s.dtype} {list(s.shape)}",
                EXIT_FAILURE,
            )
    unused = sorted(n for n in tensors if n not in known)
    if unused:
        raise ReapError(
            f"{path}: tensor binding failed: {unused[0]} is not used by the model "
            f"({len(unused)} unused tensors)",
            EXIT_FAILURE,
        )
    return specs


def read_dtypes(fam, spec) -> frozenset[str]:
    """The stored dtypes binding accepts for `spec`: its own, plus those the family lists in an
    optional `READ_DTYPES` {name suffix: dtype codes} for tensors released in more than one
    dtype (the family's code casts them when read)."""
    extra = getattr(fam, "READ_DTYPES", {})
    return frozenset({spec.dtype}).union(
        *(codes for suffix, codes in extra.items() if spec.name.endswith(suffix))
    )


def guarded_names(fam, cfg, specs: list) -> set[str]:
    """Names of the tensors `FiniteGuard` checks: norms and router biases (by layout role) and
    every MoE layer's router tensors (`fam.router_tensors`)."""
    names = {s.name for s in specs if s.role in GUARDED_ROLES}
    for layer in sorted({s.layer for s in specs if s.component == "routed_experts"}):
        names.update(fam.router_tensors(cfg, layer))
    known = {s.name for s in specs}
    return names & known


class FiniteGuard:
    """Callable `(name, tensor)` raising CheckpointError (exit 2) the first time a guarded
    tensor holding NaN or Inf is seen; each guarded tensor is checked once (the first read),
    others pass untouched. Thread-safe enough for a reader thread: a tensor checked twice by a
    race is only a wasted scan."""

    def __init__(self, fam, cfg, specs: list, path: str):
        self.pending, self.path = guarded_names(fam, cfg, specs), path

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.pending or tensor.dtype not in _FLOATS:
            return
        if not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(
                f"{self.path}: {name}: holds NaN or Inf (a norm or router weight): corrupt weights"
            )
        self.pending.discard(name)

    def check_all(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Check each guarded tensor of a name -> tensor mapping (e.g. a layer just read)."""
        for name, tensor in tensors.items():
            self(name, tensor)
