"""Quantization codecs and their kernels, shared by every stage: one module per format (`mxfp4`,
`fp8`, `int4`) with its vectorized and reference decoders and its matrix record, the expert-matmul
interface the records implement (`matrix`), and the compiled kernels (`ckernel` loads them).

A new format adds its codec module with a reference decoder, a matrix record and, if
it pays, a kernel here; model code applies any record through `reap.models.shared.blocks.linear`.
"""
