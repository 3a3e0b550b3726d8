"""Kimi K3: the family (`family`), its config checks, layer blocks, chat format and built-in
configs."""
