"""Config validation shared by every family: one checker driven by the `Config` dataclass's field
types, plus range rules a family states once; every command reaches it through
`Config.from_dict` (so `info`, `run`, `calibrate`, `prune`, `verify` and `plan --config` agree).

    check_fields(Config, text)           # types; Config.REQUIRED, the keys every release has
    need_int(text, "num_experts_per_token", 1, text["num_experts"], "num_experts")

A bad value raises `ConfigError` (exit 2): `FILE: FIELD: must be ... (got VALUE)`. Bounds are far
above any released model (the largest has ~900 experts per layer and < 100 layers) but low enough
that a layout listing every tensor stays small (`reap info` must not grow with a typo).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import types
import typing
from collections.abc import Mapping

from reap.errors import ReapError

MAX_EXPERTS = 1 << 16  # routed experts of one layer
MAX_LAYERS = 1 << 12  # decoder layers
MAX_ROUTED = 1 << 18  # routed experts over all layers (each is a few tensors in the layout)
MAX_WIDTH = 1 << 22  # any hidden, head or intermediate width
MAX_VOCAB = 1 << 24
MAX_INT = (1 << 31) - 1  # any other integer field (positions, token ids, windows)
MAX_SCALE = 1e6  # routed_scaling_factor and other multipliers


class ConfigError(ReapError):
    """A config.json value is missing, of the wrong type or out of range (exit 2)."""

    def __init__(self, field: str, detail: str, source: str = "config.json"):
        super().__init__(f"{source}: {field}: {detail}")
        self.field, self.detail, self.source = field, detail, source

    def at(self, source: str) -> ConfigError:
        """The same error naming config file `source`."""
        return ConfigError(self.field, self.detail, source)


def config_source(path: str | os.PathLike) -> str:
    """The config.json a checkpoint path reads (a directory's, or the one beside a file)."""
    path = os.fspath(path)
    if "://" in path:  # a remote checkpoint: its config.json sits at the top
        return path.rstrip("/") + "/config.json"
    return os.path.join(path if os.path.isdir(path) else os.path.dirname(path), "config.json")


def text_of(config: Mapping) -> Mapping:
    """The text config of a config.json dict (`text_config`, or the dict itself)."""
    if not isinstance(config, Mapping):
        raise ConfigError("config", f"must be a JSON object (got {_show(config)})")
    text = config.get("text_config", config)
    if not isinstance(text, Mapping):
        raise ConfigError("text_config", f"must be a JSON object (got {_show(text)})")
    return text


def text_prefix(config: Mapping) -> str:
    """The prefix of the text model's tensor names in a checkpoint of `config`: the multimodal
    releases (a `text_config`) store them under `language_model.`."""
    from reap.checkpoint.spec import TEXT_PREFIX

    return TEXT_PREFIX if "text_config" in config else ""


# -- the type checker --------------------------------------------------------------------------
def check_fields(cls, text: Mapping, none_is_default: bool = False) -> None:
    """Check `text` (a config.json text dict) against dataclass `cls`: every key that names a
    field has the field's type (an int is not a bool or a float; a float is finite), integers lie
    in 0..MAX_INT, and every key of `cls.REQUIRED` is given (an entry that is a tuple: one of its
    alternative spellings; null only where the field's type allows None). `none_is_default`: the
    family reads a null as the default, so null passes for any field."""
    hints = _hints(cls)
    for names in getattr(cls, "REQUIRED", ()):
        names = (names,) if isinstance(names, str) else names
        if not any(n in text and (text[n] is not None or _nullable(hints.get(n))) for n in names):
            alt = f" unless {' or '.join(names[1:])} is given" if names[1:] else ""
            raise ConfigError(names[0], f"is missing (required{alt}: there is no safe default)")
    for f in dataclasses.fields(cls):
        value = text.get(f.name)
        if f.name in text and f.init and not (value is None and none_is_default):
            _check_value(f.name, value, hints[f.name])


def _nullable(hint) -> bool:  # no hint: the family reads the key itself (a null is a value)
    return hint is None or type(None) in _allowed(hint)


@functools.cache
def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def _check_value(name: str, value, hint) -> None:
    allowed = _allowed(hint)
    if value is None and type(None) in allowed:
        return
    for kind in allowed:
        if _is(value, kind):
            if kind is int and not 0 <= value <= MAX_INT:
                raise ConfigError(name, f"must be an int in 0..{MAX_INT} (got {_show(value)})")
            if kind is float and not math.isfinite(value):
                raise ConfigError(name, f"must be a finite number (got {_show(value)})")
            return
    want = " or ".join(_NAMES.get(k, k.__name__) for k in allowed)
    raise ConfigError(name, f"must be {want} (got {_show(value)})")


_NAMES = {
    int: "an int",
    float: "a number",
    bool: "true or false",
    str: "a string",
    dict: "a JSON object",
    list: "a list",
    tuple: "a list",
    type(None): "null",
}


def _allowed(hint) -> tuple:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return tuple(a for arg in typing.get_args(hint) for a in _allowed(arg))
    return (origin or hint,)


def _is(value, kind) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is tuple:
        return isinstance(value, (list, tuple))
    if kind is typing.Any:
        return True
    return isinstance(value, kind)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# -- range rules -------------------------------------------------------------------------------
def need_int(text: Mapping, name: str, lo: int, hi: int, hi_name: str | None = None) -> None:
    """`text[name]`, when present and not null, is an int in lo..hi (`hi_name` names hi)."""
    value = text.get(name)
    if value is None:
        return
    if not _is(value, int) or not lo <= value <= hi:
        raise ConfigError(name, f"must be an int in {lo}..{hi_name or hi} (got {_show(value)})")


def need_float(text: Mapping, name: str, lo: float, hi: float, above_lo: bool = False) -> None:
    """`text[name]`, when present and not null, is a finite number in [lo, hi] ((lo, hi] with
    `above_lo`)."""
    value = text.get(name)
    if value is None:
        return
    ok = _is(value, float) and math.isfinite(value) and value <= hi
    ok = ok and (value > lo if above_lo else value >= lo)
    if not ok:
        span = f"{'>' if above_lo else '>='} {lo:g} and <= {hi:g}"
        raise ConfigError(name, f"must be a finite number {span} (got {_show(value)})")


def need_sizes(
    text: Mapping,
    widths: tuple[str, ...] = (),
    vocab: str = "vocab_size",
    layers: str = "num_hidden_layers",
) -> None:
    """The common size fields: `vocab` in 1..MAX_VOCAB, `layers` in 1..MAX_LAYERS, each of
    `widths` in 1..MAX_WIDTH."""
    need_int(text, vocab, 1, MAX_VOCAB)
    need_int(text, layers, 1, MAX_LAYERS)
    for name in widths:
        need_int(text, name, 1, MAX_WIDTH)


def need_experts(text: Mapping, experts: str, top_k: str, n_layers: int, lo: int = 0) -> None:
    """Routed experts in lo..MAX_EXPERTS (and at most MAX_ROUTED over `n_layers` layers), top-k
    in 1..experts (when the model has experts)."""
    need_int(text, experts, lo, MAX_EXPERTS)
    n = text.get(experts) or 0
    if n * n_layers > MAX_ROUTED:
        raise ConfigError(
            experts, f"{n} experts x {n_layers} layers exceeds {MAX_ROUTED} routed experts"
        )
    if n:
        need_int(text, top_k, 1, n, experts)


def need_int_list(text: Mapping, name: str, lo: int, hi: int, hi_name: str | None = None) -> None:
    """`text[name]`, when present and not null, is a list of ints in lo..hi."""
    values = text.get(name)
    if values is None:
        return
    if not isinstance(values, list):
        raise ConfigError(name, f"must be a list (got {_show(values)})")
    for v in values:
        if not _is(v, int) or not lo <= v <= hi:
            raise ConfigError(name, f"must list ints in {lo}..{hi_name or hi} (got {_show(v)})")


def need_str_list(text: Mapping, name: str, choices: tuple[str, ...], length: int) -> None:
    """`text[name]`, when present and not null, lists `length` strings among `choices`."""
    values = text.get(name)
    if values is None:
        return
    if not isinstance(values, list) or len(values) != length:
        raise ConfigError(name, f"must list one entry per layer ({length}) (got {_show(values)})")
    bad = [v for v in values if v not in choices]
    if bad:
        raise ConfigError(
            name, f"entries must be one of {', '.join(choices)} (got {_show(bad[0])})"
        )


HF_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
# REQUIRED entries for RoPE: the release's keys, or the `rope_parameters` transformers 5 writes
ROPE = (("rope_theta", "rope_parameters"), ("rope_scaling", "rope_parameters"))


def need_hf(text: Mapping, experts: str, top_k: str, widths: tuple[str, ...] = ()) -> None:
    """The ranges of the Hugging Face names most families share: sizes (vocab, layers, hidden,
    heads, key/value heads, `widths`), `experts` with top-k `top_k`, `rms_norm_eps` in (0, 1],
    `rope_theta` > 0, `routed_scaling_factor` in (0, MAX_SCALE]."""
    hf = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size")
    need_sizes(text, hf + widths)
    need_experts(text, experts, top_k, text.get("num_hidden_layers") or 1)
    need_float(text, "rms_norm_eps", 0.0, 1.0, above_lo=True)
    need_float(text, "rope_theta", 0.0, 1e12, above_lo=True)
    need_float(text, "routed_scaling_factor", 0.0, MAX_SCALE, above_lo=True)
