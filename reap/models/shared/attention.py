"""Softmax attention variants shared by the families: RoPE (default, linear, YaRN, Llama-3
scaling), grouped-query attention over a growing KV cache with optional sliding window and
per-head sink logits, and multi-head latent attention (MLA) with a compressed latent KV cache,
NoPE (Kimi K3, Kimi Linear) or with RoPE (DeepSeek-V3). For GQA, families do their own
projections and norms and call these on per-head tensors.

Dimension letters: B batch, T new tokens, S all tokens (cache + new), H query heads, Hkv key/value
heads (H a multiple of Hkv), Dk query/key width, Dv value width, d rotated width, R latent KV width.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from reap.errors import ReapError
from reap.models.shared.blocks import WeightFn, linear, rms_norm

Tensor = torch.Tensor


def rope_settings(config: dict | object) -> tuple[float, dict | None]:
    """(theta, scaling) from a config dict or object: transformers 5 `rope_parameters`
    ({"rope_type", "rope_theta", ...}) or the older `rope_theta` + `rope_scaling`."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    params = get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        kind = params.get("rope_type", params.get("type", "default"))
        return float(params["rope_theta"]), None if kind == "default" else dict(params)
    scaling = get("rope_scaling")
    theta = float(get("rope_theta", 10000.0) or 10000.0)
    if not scaling or scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return theta, None
    return theta, dict(scaling)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(inv: Tensor, d: int, theta: float, s: dict) -> tuple[Tensor, float]:
    """YaRN: interpolate the slow frequencies by `factor`, keep the fast ones, ramp between."""
    factor, old = float(s["factor"]), float(s["original_max_position_embeddings"])
    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all else None
        attn = attn if attn is not None else _yarn_mscale(factor)

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(s.get("beta_fast") or 32), dim_of(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (fast, unchanged), 0: interpolate (slow, / factor)
    return inv / factor * (1 - keep) + inv * keep, float(attn)


def _llama3(inv: Tensor, s: dict) -> Tensor:
    """Llama 3: long wavelengths / factor, short ones unchanged, smooth in between."""
    factor, old = float(s["factor"]), float(s["original_max_position_embeddings"])
    lo, hi = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    wavelen = 2 * math.pi / inv
    smooth = ((old / wavelen - lo) / (hi - lo)).clamp(0, 1)
    return (1 - smooth) * inv / factor + smooth * inv


@dataclass
class Rope:
    """Rotary position embedding of the first `2 * len(inv_freq)` dims of each head."""

    inv_freq: Tensor  # [d/2] float64
    attention_factor: float = 1.0  # multiplies cos and sin (YaRN)

    @classmethod
    def create(cls, dim: int, theta: float, scaling: dict | None = None) -> Rope:
        """RoPE over `dim` rotated dims with base `theta` and an HF scaling dict (or None)."""
        inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # [d/2]
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if kind == "default":
            return cls(inv)
        if kind == "linear":
            return cls(inv / float(scaling["factor"]))
        if kind == "yarn":
            return cls(*_yarn(inv, dim, theta, scaling))
        if kind == "llama3":
            return cls(_llama3(inv, scaling))
        raise ReapError(
            f"unsupported rope_type {kind!r} (supported: default, linear, yarn, llama3)"
        )

    def apply(self, x: Tensor, start: int, interleaved: bool = False) -> Tensor:
        """Rotate x [B, T, H, Dk] at positions start..start+T-1 (rotate-half pairing of dims
        i and i + d/2; `interleaved` pairs 2i and 2i+1). Dims past d pass unchanged. cos and
        sin come from a table grown on demand (tests/references.py computes them per call)."""
        cos, sin = self.table(start + x.shape[1])
        return self._rotate(x, cos[start : start + x.shape[1]], sin[start : start + x.shape[1]],
                            interleaved)  # fmt: skip

    def _cos_sin(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        ang = pos[:, None] * self.inv_freq[None]  # [T, d/2] float64
        return ((ang.cos() * self.attention_factor).to(torch.float32),
                (ang.sin() * self.attention_factor).to(torch.float32))  # fmt: skip

    def table(self, n: int) -> tuple[Tensor, Tensor]:
        """cos, sin [>= n, d/2] fp32 of positions 0.. (grown in 256-position steps; a compiled
        decode step reads them in place)."""
        table = self.__dict__.get("_cs")
        if table is None or table[0].shape[0] < n:
            table = self._cos_sin(torch.arange(-(-n // 256) * 256, dtype=torch.float64))
            self.__dict__["_cs"] = table
        return table

    def _rotate(self, x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
        d = 2 * self.inv_freq.shape[0]
        cos, sin = cos[None, :, None], sin[None, :, None]  # [1, T, 1, d/2]
        rot, rest = x[..., :d].float(), x[..., d:]
        if interleaved:
            a, b = rot[..., 0::2], rot[..., 1::2]  # [B, T, H, d/2] each
        else:
            a, b = rot[..., : d // 2], rot[..., d // 2 :]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], -1).to(x.dtype)  # half layout
        return torch.cat([out, rest], -1) if rest.shape[-1] else out


def _append(buf: Tensor | None, n: int, new: Tensor, dim: int) -> Tensor:
    """`new` written in place into `buf` at positions n.. along `dim` (the first n hold the
    cache); a full or missing buffer is replaced by one with room for 256 more positions
    (amortized: no copy of the whole cache per token). Returns the buffer."""
    buf = _grow(buf, n, new.shape, dim, new.dtype, new.device)
    buf.narrow(dim, n, new.shape[dim]).copy_(new)
    return buf


def _grow(buf: Tensor | None, n: int, shape, dim: int, dtype: torch.dtype, device=None) -> Tensor:
    """`buf` if it holds n + shape[dim] positions along `dim` in `dtype`, else a buffer with
    room for 256 more (the first n positions copied over)."""
    end = n + shape[dim]
    if buf is None or buf.shape[dim] < end or buf.dtype != dtype:
        size = list(shape)
        size[dim] = -(-end // 256) * 256
        dev = device if device is not None else (buf.device if buf is not None else "cpu")
        grown = torch.empty(size, dtype=dtype, device=dev)
        if buf is not None and n:
            grown.narrow(dim, 0, n).copy_(buf.narrow(dim, 0, n))
        buf = grown
    return buf


class KVCache:
    """Keys and values of one attention layer: k [B, Hkv, S, Dk], v [B, Hkv, S, Dv] (views of
    preallocated buffers that new tokens are written into)."""

    def __init__(self) -> None:
        self._k: Tensor | None = None
        self._v: Tensor | None = None
        self.length = 0

    @property
    def k(self) -> Tensor | None:
        return None if self._k is None else self._k[:, :, : self.length]

    @property
    def v(self) -> Tensor | None:
        return None if self._v is None else self._v[:, :, : self.length]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add k [B, Hkv, T, Dk], v [B, Hkv, T, Dv]; returns all keys and values [.., S, ..]."""
        self._k = _append(self._k, self.length, k, 2)
        self._v = _append(self._v, self.length, v, 2)
        self.length += k.shape[2]
        return self.k, self.v

    def room(self, k_shape, v_shape, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The whole k and v buffers [B, Hkv, cap, D] with room for T more positions after
        `length` (grown as `append` grows them), for a compiled step that writes positions
        `length`.. itself and then calls `advance(T)`. k_shape/v_shape: [B, Hkv, T, D]."""
        self._k = _grow(self._k, self.length, k_shape, 2, dtype)
        self._v = _grow(self._v, self.length, v_shape, 2, dtype)
        return self._k, self._v

    def advance(self, n: int) -> None:
        """n positions were written in place after `length` (see `room`)."""
        self.length += n


def gqa_attention(q: Tensor, k: Tensor, v: Tensor, cache: KVCache | None, scale: float,
                  sinks: Tensor | None = None, window: int | None = None) -> Tensor:
    """Causal grouped-query attention of T new queries over the cache plus the T new keys.

    q [B, T, H, Dk], k [B, T, Hkv, Dk], v [B, T, Hkv, Dv] -> [B, T, H, Dv]; appends k/v to
    `cache`. `window`: a query at position p sees keys p-window+1..p. `sinks` [H]: a per-head
    logit joining each softmax row as an extra column that receives probability but no value.
    Chunks of FUSED_MIN_QUERIES or more queries without sinks (prefill) run torch's fused
    `scaled_dot_product_attention` (fp32 softmax, no [T, S] score tensor in the compute dtype);
    the others `gqa_attention_reference`, the op-by-op form (torch's fused kernel for a few
    fp32 queries gives results that depend on the thread count)."""
    if sinks is not None or q.shape[1] < FUSED_MIN_QUERIES:
        return gqa_attention_reference(q, k, v, cache, scale, sinks, window)
    T = q.shape[1]
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, T, D]
    if cache is not None:
        k, v = cache.append(k, v)  # [B, Hkv, S, D]
    mask = _visible(T, k.shape[2], window)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )  # [B, H, T, Dv]
    return o.transpose(1, 2)


FUSED_MIN_QUERIES = 16


def _visible(T: int, S: int, window: int | None) -> Tensor | None:
    """[T, S] bool: which keys each of the last T queries sees (None: all of them)."""
    if T == 1 and (window is None or window >= S):  # one query, no window: sees every key
        return None
    qpos = torch.arange(S - T, S)[:, None]  # [T, 1] absolute positions of the new queries
    kpos = torch.arange(S)[None]  # [1, S]
    visible = kpos <= qpos
    if window is not None:
        visible &= kpos > qpos - window
    return visible


def gqa_attention_reference(q: Tensor, k: Tensor, v: Tensor, cache: KVCache | None, scale: float,
                            sinks: Tensor | None = None, window: int | None = None) -> Tensor:
    """`gqa_attention` op by op: scores in the compute dtype, masked, softmax in fp32 (with the
    sink column), probabilities cast back, times the values."""
    Bn, T, H, _ = q.shape
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, T, D]
    if cache is not None:
        k, v = cache.append(k, v)  # [B, Hkv, S, D]
    S, group = k.shape[2], H // k.shape[1]
    qg = q.transpose(1, 2).reshape(Bn, k.shape[1], group * T, -1)  # [B, Hkv, group*T, Dk]
    scores = (qg @ k.transpose(-1, -2)).float() * scale  # [B, Hkv, group*T, S]
    scores = scores.reshape(Bn, H, T, S)
    visible = _visible(T, S, window)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, H, 1, 1).expand(Bn, H, T, 1)
        p = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :S]  # [B, H, T, S]
    else:
        p = torch.softmax(scores, -1)
    pg = p.to(v.dtype).reshape(Bn, k.shape[1], group * T, S)
    o = (pg @ v).reshape(Bn, H, T, -1)  # [B, H, T, Dv]
    return o.transpose(1, 2)


# -- MLA ---------------------------------------------------------------------------------------
class MLACache:
    """Compressed KV cache of one MLA layer: normalized latent [B, S, R] and k_pe [B, S, rope]
    (views of preallocated buffers, as `KVCache`)."""

    def __init__(self) -> None:
        self._c: Tensor | None = None
        self._pe: Tensor | None = None
        self.length = 0

    @property
    def kv_latent(self) -> Tensor | None:
        return None if self._c is None else self._c[:, : self.length]

    @property
    def k_pe(self) -> Tensor | None:
        return None if self._pe is None else self._pe[:, : self.length]

    def append(self, c: Tensor, k_pe: Tensor) -> tuple[Tensor, Tensor]:
        """Add c [B, T, R], k_pe [B, T, rope]; returns all of them [B, S, ...]."""
        self._c = _append(self._c, self.length, c, 1)
        self._pe = _append(self._pe, self.length, k_pe, 1)
        self.length += c.shape[1]
        return self.kv_latent, self.k_pe


@dataclass
class MLADims:
    """MLA widths: heads, per-head nope/rope query-key widths, value width, latent ranks."""

    heads: int
    nope: int
    rope: int
    v: int
    kv_lora: int
    q_lora: int | None
    output_gate: bool

    @classmethod
    def from_config(cls, c) -> MLADims:
        """From a DeepSeek-style config object (num_attention_heads, qk_nope_head_dim, ...;
        no `mla_use_output_gate` field: no output gate)."""
        widths = (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim)
        gate = getattr(c, "mla_use_output_gate", False)
        return cls(c.num_attention_heads, *widths, c.kv_lora_rank, c.q_lora_rank, gate)

    def specs(self, t: Callable, hidden: int) -> list:
        """The layout of one MLA block in file order, each tensor as `t(name, shape, "mla")`
        (names under `self_attn.`; `hidden`: D)."""
        D, H, r, kv, q = hidden, self.heads, self.q_lora, self.kv_lora, self.nope + self.rope
        if r:
            shapes = {"q_a_proj": (r, D), "q_a_layernorm": (r,), "q_b_proj": (H * q, r)}
        else:
            shapes = {"q_proj": (H * q, D)}
        shapes |= {
            "kv_a_proj_with_mqa": (kv + self.rope, D),
            "kv_a_layernorm": (kv,),
            "kv_b_proj": (H * (self.nope + self.v), kv),
            "o_proj": (D, H * self.v),
        }
        if self.output_gate:
            shapes["g_proj"] = (H * self.v, D)
        return [t(f"self_attn.{n}.weight", s, "mla") for n, s in shapes.items()]


def mla_attention(
    x: Tensor,
    w: WeightFn,
    d: MLADims,
    cache: MLACache | None = None,
    absorbed: bool | None = None,
    rope: Callable[[Tensor, int], Tensor] | None = None,
    scale: float | None = None,
) -> Tensor:
    """Multi-head latent attention (gated NoPE for K3, RoPE for DeepSeek-V3): x [B, T, D] ->
    [B, T, D], causal over the cache plus the new tokens. `absorbed` (default: when T == 1) folds
    kv_b into the query and output so attention runs in the R-wide latent space; otherwise
    keys/values are expanded per head. `rope(x [B, T, H, rope], start)` rotates q_pe and the
    shared k_pe at positions start.. (start = tokens already cached; k_pe is cached rotated);
    `scale` overrides the softmax scale 1/sqrt(nope + rope) (YaRN's mscale)."""
    Bn, T, _ = x.shape
    H = d.heads
    if d.q_lora:
        q = linear(
            rms_norm(linear(x, w("q_a_proj.weight")), w("q_a_layernorm.weight"), 1e-6),
            w("q_b_proj.weight"),
        )
    else:
        q = linear(x, w("q_proj.weight"))
    q = q.reshape(Bn, T, H, d.nope + d.rope)  # [B, T, H, nope+rope]
    q_nope, q_pe = q.split([d.nope, d.rope], dim=-1)
    c, k_pe = linear(x, w("kv_a_proj_with_mqa.weight")).split([d.kv_lora, d.rope], dim=-1)
    c = rms_norm(c, w("kv_a_layernorm.weight"), 1e-6)  # [B, T, R]
    if rope is not None:
        start = cache.length if cache is not None else 0
        q_pe = rope(q_pe, start)
        k_pe = rope(k_pe[:, :, None], start)[:, :, 0]  # [B, T, rope] one head shared by all
    if cache is not None:
        c, k_pe = cache.append(c, k_pe)  # [B, S, R], [B, S, rope]
    kv_b = w("kv_b_proj.weight").reshape(H, d.nope + d.v, d.kv_lora)  # [H, nope+v, R]
    wk, wv = kv_b[:, : d.nope], kv_b[:, d.nope :]  # [H, nope, R], [H, v, R]
    scale = (d.nope + d.rope) ** -0.5 if scale is None else scale
    scores = torch.einsum("bthr,bsr->bhts", q_pe, k_pe)  # [B, H, T, S]
    if absorbed if absorbed is not None else T == 1:
        q_lat = torch.einsum("bthn,hnr->bthr", q_nope, wk)
        p = _causal_softmax((scores + torch.einsum("bthr,bsr->bhts", q_lat, c)) * scale)
        o = torch.einsum("bhtr,hvr->bthv", p @ c[:, None], wv)  # [B, T, H, v]
    else:
        k = torch.einsum("bsr,hnr->bhsn", c, wk)  # [B, H, S, nope]
        vv = torch.einsum("bsr,hvr->bhsv", c, wv)  # [B, H, S, v]
        p = _causal_softmax((scores + q_nope.transpose(1, 2) @ k.transpose(-1, -2)) * scale)
        o = (p @ vv).transpose(1, 2)  # [B, T, H, v]
    o = o.reshape(Bn, T, H * d.v)
    if d.output_gate:
        o = o * torch.sigmoid(linear(x, w("g_proj.weight")))
    return linear(o, w("o_proj.weight"))


def _causal_softmax(scores: Tensor) -> Tensor:
    """Softmax over keys [..., T, S] where query t (the last T of S positions) sees keys <= it."""
    T, S = scores.shape[-2:]
    visible = torch.ones(T, S, dtype=torch.bool, device=scores.device).tril(S - T)
    return torch.softmax(scores.float().masked_fill(~visible, float("-inf")), -1).to(scores.dtype)
