"""DeepSeek-V3 and Kimi K2 (`family`), their FP8/INT4 expert formats (`quant`), and the K2.5
wrapper with MoonViT (`kimi_k25`)."""
