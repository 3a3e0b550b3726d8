"""Blocks the families share: attention variants, KDA, the MoE router and expert blocks, MoonViT."""
