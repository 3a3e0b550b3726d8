"""The released K3 vision tower as a size stand-in: its real MoonViT-V2 tensor names and shapes are
not public here, so `standin_specs` lists generic transformer blocks whose count and widths match
the release's tensor count (12 per block, 168 in all) and parameters (~401 M).

Used by a family's `layout` when a config has a `vision_config` (size accounting, `reap synth` of
k3-full); the engine and calibration skip component "vision"."""

from __future__ import annotations

from reap.checkpoint import TensorSpec


def standin_specs(vision_config: dict, dtype: str) -> list[TensorSpec]:
    """The stand-in tower's tensors (component "vision", stored without a text prefix), from a
    `vision_config` with hidden_size W, intermediate_size M and num_hidden_layers n."""
    W, M = vision_config["hidden_size"], vision_config["intermediate_size"]
    lin = {"attn.qkv": (3 * W, W), "attn.proj": (W, W), "mlp.fc1": (M, W), "mlp.fc2": (W, M)}
    block = [(f"{m}.{p}", (W,)) for m in ("norm1", "norm2") for p in ("weight", "bias")]
    block += [
        (f"{m}.{p}", s if p == "weight" else s[:1])
        for m, s in lin.items()
        for p in ("weight", "bias")
    ]
    return [
        TensorSpec(f"vision_tower.blocks.{b}.{k}", dtype, s, "vision")
        for b in range(vision_config["num_hidden_layers"])
        for k, s in block
    ]
