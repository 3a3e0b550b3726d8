"""Generated tokens -> text -> OpenAI response bodies.

`TextStream` turns generated token ids into text deltas (whole characters only, cut at stop
strings, never emitting a tail that could still become a stop string); `ReasoningSplitter`
separates that text into the reasoning channel and the answer, also when it arrives piece by
piece; `Reply` formats a job's text as an OpenAI completion or chat completion, whole or as the
chunks of a server-sent event stream (`sse_event`).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

# Reasoning-channel delimiters of checkpoint templates whose family declares no chat format
# (the spelling DeepSeek-R1, Qwen3 and Kimi templates share).
REASONING_MARKERS = ("<think>", "</think>")


class TextStream:
    """Token ids -> text deltas, holding back bytes of unfinished characters and any tail that
    could still become a stop string; `done` is set once a stop string appears."""

    def __init__(self, decode, stop: tuple[str, ...]):
        self.decode, self.stop = decode, stop
        self.ids: list[int] = []
        self.text = ""  # all text decoded so far (cut at a stop string once found)
        self.sent = 0  # characters of `text` already emitted
        self._prefix, self._read = 0, 0
        self.done = False

    def feed(self, token: int) -> str:
        """Add one generated token; return the text that is now safe to emit."""
        self.ids.append(token)
        return self._advance(final=False)

    def _advance(self, final: bool) -> str:
        prefix = self.decode(self.ids[self._prefix:self._read])
        full = self.decode(self.ids[self._prefix:])
        if full.endswith("\ufffd") and not final:  # maybe an unfinished character: wait
            return ""
        old = len(self.text)
        self.text += full[len(prefix):]
        self._prefix, self._read = self._read, len(self.ids)
        return self._emit(old)

    def _emit(self, old: int) -> str:
        width = max((len(s) for s in self.stop), default=0)
        start = max(0, old - width + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text, self.done = self.text[: min(hits)], True
            return self.flush()
        hold = max((_partial_suffix(self.text, s) for s in self.stop), default=0)
        end = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent:end], end
        return out

    def flush(self) -> str:
        """Everything not yet emitted, at the end of generation (a character left unfinished
        decodes as U+FFFD, as in a whole decode)."""
        out = "" if self.done or self._read == len(self.ids) else self._advance(final=True)
        rest, self.sent = self.text[self.sent:], len(self.text)
        return out + rest


class ReasoningSplitter:
    """Splits generated text into (reasoning, content) at the first `close` marker.

    Feed pieces as they are generated; a piece that might be the start of `close` is held back
    until the next piece decides it. With `thinking=False` everything is content, unless the
    text itself opens with `open` (after whitespace): models whose prompt does not open the
    reasoning block (Qwen3, Kimi K2-Thinking, gpt-oss's analysis channel) open it themselves.
    """

    def __init__(self, thinking: bool, close: str = REASONING_MARKERS[1],
                 open: str | None = None):
        self.in_reasoning = thinking
        self.close, self.open = close, open
        self._undecided = not thinking and bool(open)  # may the text still open reasoning?
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning delta, content delta) for the next piece of generated text."""
        if self._undecided:
            text = self._decide(self._held + text)
            if self._undecided:
                return "", ""
        if not self.in_reasoning:
            return "", text
        buf = self._held + text
        at = buf.find(self.close)
        if at >= 0:
            self.in_reasoning, self._held = False, ""
            return buf[:at], buf[at + len(self.close):]
        keep = _partial_suffix(buf, self.close)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], ""

    def _decide(self, buf: str) -> str:
        """Whether `buf` opens the reasoning block; the text left to feed (all held if open)."""
        head = buf.lstrip()
        if head.startswith(self.open):
            self._undecided, self.in_reasoning, self._held = False, True, ""
            return head[len(self.open):]
        if self.open.startswith(head):  # too short to tell
            self._held = buf
            return ""
        self._undecided, self._held = False, ""
        return buf

    def flush(self) -> tuple[str, str]:
        """Whatever is held back at the end of generation (it was reasoning after all)."""
        held, self._held = self._held, ""
        if self._undecided:
            self._undecided = False
            return "", held
        return (held, "") if self.in_reasoning else ("", held)


def _partial_suffix(buf: str, marker: str) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(buf)), 0, -1):
        if marker.startswith(buf[-n:]):
            return n
    return 0


class Reply:
    """Formats one job's text as an OpenAI completion or (`is_chat`) chat completion; a chat
    reply that opens in the reasoning channel (`thinking`, or its text starts with
    `think_open`) is split at `think_close`."""

    def __init__(self, model: str, prompt_tokens: int, is_chat: bool, thinking: bool = False,
                 think_close: str = REASONING_MARKERS[1], think_open: str | None = None):
        self.model, self.prompt_tokens, self.chat = model, prompt_tokens, is_chat
        self.id = ("chatcmpl-" if is_chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.splitter = ReasoningSplitter(thinking, think_close, think_open) if is_chat else None

    def _head(self, stream: bool) -> dict:
        kind = "chat.completion" + (".chunk" if stream else "") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": "reap"}

    def _choice(self, text: str, finish: str | None, stream: bool) -> dict:
        c: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if not self.chat:
            return {**c, "text": text}
        reasoning, content = self.splitter.feed(text)
        if finish is not None:  # the end: whatever the splitter still holds
            r, t = self.splitter.flush()
            reasoning, content = reasoning + r, content + t
        if stream:
            parts = (("reasoning_content", reasoning), ("content", content))
            return {**c, "delta": {k: v for k, v in parts if v}}
        message = {"role": "assistant", "content": content}
        return {**c, "message": message | ({"reasoning_content": reasoning} if reasoning else {})}

    def chunk(self, text: str, finish: str | None = None, first: bool = False) -> dict:
        """One streamed chunk carrying `text` (may be empty) and an optional finish reason;
        a chat stream's `first` chunk announces the assistant role."""
        choice = self._choice(text, finish, stream=True)
        if first and self.chat:
            choice["delta"] = {"role": "assistant", "content": ""}
        return {**self._head(True), "choices": [choice]}

    def usage(self, n: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n,
                "total_tokens": self.prompt_tokens + n}

    def whole(self, text: str, finish: str, n: int) -> dict:
        """The non-streamed response."""
        return {**self._head(False), "choices": [self._choice(text, finish, stream=False)],
                "usage": self.usage(n)}


def sse_event(obj: dict) -> bytes:
    """One server-sent event carrying `obj` as JSON."""
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
