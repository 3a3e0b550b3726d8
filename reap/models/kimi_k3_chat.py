"""Kimi K3's built-in chat format: the markers `reap.serve` renders chat requests with when a K3
checkpoint ships no chat template (the family hook `kimi_k3.chat_format`).

ASSUMPTION: the K3 release's tokenizer_config is not available offline. These are the markers
published for Kimi K2.5/K2.6 (a turn is `<|im_user|>user<|im_middle|>{text}<|im_end|>`, the
reply opens with `<think>`), which K3 is assumed to keep. A checkpoint that ships its own
template overrides them, so a differing K3 release only needs its own files.
"""

from __future__ import annotations

from reap.models.base import ChatFormat

CHAT_FORMAT = ChatFormat(
    system="<|im_system|>system<|im_middle|>",
    user="<|im_user|>user<|im_middle|>",
    assistant="<|im_assistant|>assistant<|im_middle|>",
    end="<|im_end|>",
    think_open="<think>",
    think_close="</think>",
)


def chat_format(config_dict: dict) -> ChatFormat:
    """K3's built-in chat format (every K3 config has the same one)."""
    return CHAT_FORMAT
