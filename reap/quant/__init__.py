"""Quantization codecs and their kernels, shared by every stage.

- `mxfp4`: the MXFP4 codec (OCP Microscaling): quantize, the vectorized and the reference
  decoders, and `MXFP4Matrix`, a stored matrix as model code multiplies it;
- `mxfp4_decode`: the engine's table decoder (C or torch), bit-identical to `mxfp4.dequantize`;
- `mxfp4_matmul`: the fused MXFP4 matmul (C) with its torch reference, and `MXFP4Kernels`;
- `fp8`: the block-scaled FP8 codec (DeepSeek-V3 / Kimi K2 releases);
- `int4`: compressed-tensors `pack-quantized` INT4 (Kimi-K2-Thinking's experts): pack, unpack,
  quantize, the vectorized and the reference decoders, `INT4Matrix`, and `Int4Scheme` (reads a
  config's `quantization_config`);
- `matrix`: the expert-matmul interface every quantized matrix record implements;
- `ckernel`: the one loader of the C libraries (built, checked, loaded) and their thread pool.

A new format adds its codec module with a reference decoder, a matrix record and, if
it pays, a kernel here; model code applies any record through `reap.models.shared.blocks.linear`.
"""
