"""Budgets of a plan: how many experts each MoE layer keeps.

`--keep N` (per layer), `--ratio R` (kept fraction) or `--target-size` (bytes, solved exactly with
`reap.sizes.SizeModel`: the largest build that fits). `uniform` scope keeps the same count in
every layer (with grouped routers, `groups` > 1, rounded down to the largest multiple of the
group count that fits: grouped top-k routes as before only if every group keeps as many, and
`rounding_note` says so in the plan); `global` scope shares the budget across layers by the
per-layer shares of the combined score (`criteria.global_counts`: this keeps the experts of
largest share anywhere, which minimizes the total share dropped), never below the per-layer
minimum (at least top_k, and at least the layer's protected experts).
"""

from __future__ import annotations

from reap.errors import ReapError
from reap.prune import criteria


def min_keep(min_keep: int | None, top_k: int, E: int) -> int:
    """The per-layer minimum: `--min-keep`, default top_k; checked to lie in [top_k, E]."""
    m = top_k if min_keep is None else min_keep
    if m < top_k or m > E:
        raise ReapError(f"--min-keep {m} must be between top_k ({top_k}) and n_experts ({E})")
    return m


def layer_counts(scope, size, shape, combined, prot, floor_, keep, ratio, target_size,
                 groups: int = 1) -> list[int]:
    """Experts to keep per layer [L] under exactly one of keep / ratio / target_size.

    shape: (MoE layers, n_experts, top_k); combined: [L, E] shares (global scope); prot: the
    protected ids per layer; floor_: the per-layer minimum; size: a SizeModel (target size);
    groups: routing groups (a uniform target-size count is rounded down to a multiple)."""
    layers, E, _ = shape
    L = len(layers)
    given = [x is not None for x in (keep, ratio, target_size)]
    if sum(given) != 1:
        raise ReapError("give exactly one budget: --keep N, --ratio R or --target-size SIZE")
    if ratio is not None and not 0 < ratio <= 1:
        raise ReapError(f"--ratio {ratio} must be in (0, 1]")
    target = _target_bytes(target_size, size) if target_size is not None else None
    if scope == "uniform":
        if keep is not None:
            n = keep
        elif ratio is not None:
            n = round(ratio * E)
        else:
            n = size.max_uniform_keep(target)
            n -= n % groups
        if not floor_ <= n <= E:
            raise ReapError(_too_small(n, floor_, E, size, target))
        return [n] * L
    if scope != "global":
        raise ReapError(f"unknown scope {scope!r} (uniform or global)")
    floor = [max(floor_, len(p)) for p in prot]
    if target is not None:
        unit = _unit_bytes(size)
        spent = [size.predict_bytes(dict(zip(layers, floor)))]
        if spent[0] > target:
            raise ReapError(_too_small(0, floor_, E, size, target))

        def admit(counts, li):
            if spent[0] + unit[li] > target:
                return False
            spent[0] += unit[li]
            return True
    else:
        total = keep * L if keep is not None else round(ratio * E * L)
        if not sum(floor) <= total <= E * L:
            raise ReapError(f"budget of {total} experts is outside [{sum(floor)}, {E * L}] "
                            f"(the per-layer minimum {floor_} x {L} layers .. all)")

        def admit(counts, li):
            return sum(counts) < total

    counts = criteria.global_counts(combined, floor, prot, admit)
    if target is not None and size.predict_bytes(dict(zip(layers, counts))) > target:
        raise ReapError("internal: global plan exceeds the target size")  # size model not linear
    return counts


def _target_bytes(text: str, size) -> int:
    if size is None:
        raise ReapError("--target-size needs the model: give --model DIR or --config NAME")
    return positive_size(text, "--target-size")


def positive_size(text: str, flag: str) -> int:
    """A size argument ('5GB', '8GiB') in bytes; ReapError naming `flag` unless it is a finite
    whole number of bytes above zero (not -1GB, 0, nan or inf)."""
    from reap.units import parse_bytes

    try:
        n = parse_bytes(text)
    except ReapError:
        msg = f"{flag}: cannot read size {text!r} (use e.g. 350GB, 8GiB, 1.5TB)"
        raise ReapError(msg) from None
    except OverflowError:  # int(inf) inside parse_bytes (a digit string beyond float range)
        n = 0
    if n <= 0:
        raise ReapError(f"{flag}: {text!r} is not a positive, finite size")
    return n


def _unit_bytes(size) -> list[int]:
    """Bytes one more expert adds in each MoE layer [L] (the size model is linear in counts)."""
    zero = {layer: 0 for layer in size.moe_layers}
    base = size.predict_bytes(zero)
    return [size.predict_bytes({**zero, layer: 1}) - base for layer in size.moe_layers]


def _too_small(n, floor_, E, size, target) -> str:
    if target is None:
        return f"{n} experts per layer is outside [{floor_}, {E}] (min keep .. n_experts)"
    from reap.units import format_bytes

    smallest = size.predict_bytes(floor_)
    return (f"target size {format_bytes(target)} is below the smallest build, "
            f"{format_bytes(smallest)} with {floor_} experts per layer")


def rounding_note(size, target_size: str, groups: int, kept: int) -> str | None:
    """What a plan says when grouped routing rounded a target-size count down (else None)."""
    fits = size.max_uniform_keep(positive_size(target_size, "--target-size"))
    if fits == kept:
        return None
    return (f"{fits} experts per layer would fit; rounded down to {kept}, the largest multiple "
            f"of the {groups} routing groups (each group keeps {kept // groups})")


def budget_record(keep, ratio, target_size, floor_) -> dict:
    """The budget as recorded in a plan."""
    if keep is not None:
        b = {"keep": keep}
    elif ratio is not None:
        b = {"ratio": ratio}
    else:
        from reap.units import parse_bytes

        b = {"target_size": target_size, "target_bytes": parse_bytes(target_size)}
    return {**b, "min_keep": floor_}
