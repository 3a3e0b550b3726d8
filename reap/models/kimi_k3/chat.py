"""Kimi K3's built-in chat format: the markers `reap.serve` renders chat requests with when a K3
checkpoint ships no chat template (the family hook `kimi_k3.chat_format`), and by which it
splits a K3 reply into reasoning and answer (also when the checkpoint's own template renders).

The K3 release's template wraps each message as
`<|open|>message role="user"<|sep|>...<|close|>message<|sep|><|end_of_msg|>`; an assistant
message holds a think block (only when thinking is on; every turn's reasoning kept) and a
response block. The release template also declares tools and, with thinking on, a
`thinking_effort` system message: the built-in format renders neither (tests/test_chat_release.py
checks the rest against the release's template).
"""

from __future__ import annotations

from reap.models.base import ChatFormat


def _open(tag: str, role: str | None = None) -> str:
    attrs = f' role="{role}"' if role else ""
    return f"<|open|>{tag}{attrs}<|sep|>"


def _close(tag: str) -> str:
    return f"<|close|>{tag}<|sep|>"


END_OF_MESSAGE = "<|end_of_msg|>"

CHAT_FORMAT = ChatFormat(
    system=_open("message", "system"),
    user=_open("message", "user"),
    assistant=_open("message", "assistant"),
    end=_close("message") + END_OF_MESSAGE,
    think_open=_open("think"),
    think_close=_close("think"),
    answer_open=_open("response"),
    answer_close=_close("response"),
    stop=(_close("response"), END_OF_MESSAGE),
    keep_reasoning=True,
    bare_answer=True,
)


def chat_format(config_dict: dict) -> ChatFormat:
    """K3's built-in chat format (every K3 config has the same one)."""
    return CHAT_FORMAT
