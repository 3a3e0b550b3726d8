"""Chat templates: validated messages -> the prompt text a model was trained on.

`ChatTemplate` renders with, in order of preference:
- the checkpoint's own template (`chat_template.jinja`, or `chat_template` in
  `tokenizer_config.json`), in Jinja's sandbox in a child process, within a time and an output
  bound (`reap.serve.sandbox`), with reasoning and the thinking switch under both Kimi's and
  Qwen's spellings;
- else the built-in `ChatFormat` its model family declares, rendered by `render_markers`:

      {system}{text}{end}    {user}{text}{end}
      {assistant}{think_open}{reasoning}{think_close}{text}{end}
      generation prompt: {assistant}{think_open}                (thinking on, the default)
                         {assistant}{think_open}{think_close}   (thinking off)

  with no default system message; turns before the last user turn lose their reasoning;
- with neither, chat requests are refused (plain completions still work).

Message content that spells a special token stays text (`reap.tokenizer.protect`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from reap.checkpoint.files import read_regular
from reap.checkpoint.header import load_json
from reap.checkpoint.spec import MAX_JSON_BYTES
from reap.errors import CheckpointError
from reap.models.base import ChatFormat
from reap.serve import sandbox
from reap.serve.params import Message, RequestError
from reap.serve.stream import REASONING_MARKERS
from reap.tokenizer import protect, token_text

# tokenizer_config keys naming special tokens that Hugging Face passes to templates
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                "mask_token")


def render_markers(fmt: ChatFormat, messages: list[Message], thinking: bool = True) -> str:
    """The prompt for `messages` in the marker format `fmt`, ending with the generation prompt."""
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    header = {"system": fmt.system, "user": fmt.user}
    out = []
    for i, m in enumerate(messages):
        if m.role != "assistant":
            out.append(f"{header[m.role]}{m.content}{fmt.end}")
            continue
        keep = fmt.keep_reasoning or i > last_user
        reasoning = m.reasoning if keep and m.reasoning.strip() else ""
        block = "" if fmt.bare_answer and not thinking else \
            f"{fmt.think_open}{reasoning}{fmt.think_close}"
        out.append(f"{fmt.assistant}{block}{fmt.answer_open}{m.content}{fmt.answer_close}"
                   f"{fmt.end}")
    if thinking:
        out.append(fmt.assistant + fmt.think_open)
    elif fmt.bare_answer:
        out.append(fmt.assistant + fmt.answer_open)
    else:
        out.append(fmt.assistant + fmt.think_open + fmt.think_close + fmt.answer_open)
    return "".join(out)


class ChatTemplate:
    """Renders chat requests for one model: its own Jinja template `source` if it has one, else
    its family's `builtin` format.

    `stop` holds the strings that end an assistant turn (to pass to the engine as stop strings);
    `think_open`/`think_close` delimit the reasoning channel of generated text.
    """

    def __init__(self, source: str | None = None, special: dict[str, str] | None = None,
                 builtin: ChatFormat | None = None):
        self.source, self.builtin = source, builtin
        self.special = dict(special or {})
        if source is not None:
            end = self.special.get("eos_token")
        else:
            end = builtin.end if builtin else None
        extra = builtin.stop if builtin else ()
        self.stop: tuple[str, ...] = tuple(dict.fromkeys(s for s in (end, *extra) if s))
        # the reasoning ends where the answer begins (K3: its think block closes, its response
        # block opens)
        markers = (builtin.think_open, builtin.think_close + builtin.answer_open) if builtin \
            else REASONING_MARKERS
        self.think_open, self.think_close = markers
        self.protected: tuple[str, ...] = ()  # special tokens kept as text in message content

    @classmethod
    def from_dir(cls, path: str | os.PathLike, builtin: ChatFormat | None = None) -> ChatTemplate:
        """The template of a checkpoint directory (`builtin` when it ships none)."""
        config_path = Path(path, "tokenizer_config.json")
        config = load_json(config_path, "tokenizer config") if config_path.is_file() else {}
        special = {k: token_text(config.get(k)) for k in SPECIAL_KEYS}
        special = {k: v for k, v in special.items() if v}
        jinja = Path(path, "chat_template.jinja")
        try:
            source = read_regular(jinja, "chat template", MAX_JSON_BYTES).decode() \
                if jinja.is_file() else _pick_template(config.get("chat_template"), path)
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{jinja}: not UTF-8 text ({e.reason})") from None
        return cls(source, special, builtin)

    def render(self, messages: list[Message], thinking: bool = True,
               extra: dict[str, Any] | None = None, max_chars: int = 1 << 24) -> str:
        """Prompt text for `messages` plus the generation prompt; `extra` reaches the template."""
        if self.source is None:
            if self.builtin is None or not self.builtin.renders:
                raise RequestError("this checkpoint ships no chat template and its model family "
                                   "has no built-in chat format: use /v1/completions")
            return render_markers(self.builtin, self._guard(messages), thinking)
        env_kwargs: dict[str, Any] = dict(self.special, tools=None, documents=None)  # as HF
        env_kwargs.update(extra or {})
        env_kwargs.update(thinking=thinking, enable_thinking=thinking, add_generation_prompt=True,
                          messages=[_as_dict(m) for m in self._guard(messages)])
        reply = sandbox.render(self.source, env_kwargs, max_chars)
        if "text" not in reply:
            raise RequestError(reply["error"])
        return reply["text"]

    def _guard(self, messages: list[Message]) -> list[Message]:
        if not self.protected:
            return messages
        return [Message(m.role, protect(m.content, self.protected),
                        protect(m.reasoning, self.protected)) for m in messages]

    def opens_thinking(self, prompt: str) -> bool:
        """Whether generation starts inside the reasoning channel (the prompt ends opening it)."""
        return prompt.rstrip().endswith(self.think_open)


def _as_dict(m: Message) -> dict[str, str]:
    d = {"role": m.role, "content": m.content}
    if m.reasoning:  # under both names templates read it by (K2/K3/Qwen3, gpt-oss)
        d.update(reasoning_content=m.reasoning, thinking=m.reasoning)
    return d


def _pick_template(value: Any, path: str | os.PathLike) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of {name, template} (use 'default')."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise RequestError(f"{path}/tokenizer_config.json: chat_template has no usable default "
                       "template")
