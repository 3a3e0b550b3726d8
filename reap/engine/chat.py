"""Chat formatting: OpenAI-style messages -> the prompt text a model was trained on.

Two renderers behind one class, `ChatTemplate`:
- the checkpoint's own template, when it ships one (`chat_template.jinja`, or `chat_template` in
  `tokenizer_config.json`), rendered in a sandboxed Jinja environment with
  `add_generation_prompt=True` and the thinking switch passed as `thinking` (Kimi's spelling) and
  `enable_thinking` (Qwen's);
- otherwise the built-in Kimi K3 format below (`K3_MARKERS`).

ASSUMPTION (K3 format): the K3 release's tokenizer_config is not available offline. The built-in
format is the one published for Kimi K2.5/K2.6, which K3 is assumed to keep:

    <|im_system|>system<|im_middle|>{text}<|im_end|>
    <|im_user|>user<|im_middle|>{text}<|im_end|>
    <|im_assistant|>assistant<|im_middle|><think>{reasoning}</think>{text}<|im_end|>
    generation prompt: <|im_assistant|>assistant<|im_middle|><think>        (thinking on, default)
                       <|im_assistant|>assistant<|im_middle|><think></think> (thinking off)

No default system message is inserted. Assistant turns before the last user turn lose their
reasoning (an empty thinking block), as Kimi's template does. A checkpoint that ships its own
template overrides all of this, so a differing K3 release only needs its own files.

Output side: `TextStream` turns generated token ids into text deltas (whole characters only,
cut at stop strings, never emitting a tail that could still become a stop string) and
`ReasoningSplitter` separates that text into the thinking channel and the answer, also when it
arrives piece by piece (streaming). `encode_prompt` tokenizes a rendered prompt so that the
model's special tokens (chat markers) spelled in it become their single ids.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from reap.errors import ReapError

# The one place the built-in K3 chat markers are defined (see ASSUMPTION above).
K3_MARKERS = {
    "system": "<|im_system|>system<|im_middle|>",
    "user": "<|im_user|>user<|im_middle|>",
    "assistant": "<|im_assistant|>assistant<|im_middle|>",
    "end": "<|im_end|>",
    "think_open": "<think>",
    "think_close": "</think>",
}
ROLES = ("system", "user", "assistant")


class ChatError(ReapError):
    """A request the server cannot honour (bad field, bad role, non-text content, template
    error); `param` names the offending request field (HTTP 400)."""

    def __init__(self, message: str, param: str | None = "messages"):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Message:
    """One validated chat message: role, text and (assistant only) its reasoning text."""

    role: str
    content: str
    reasoning: str = ""


def parse_messages(raw: Any) -> list[Message]:
    """Validate OpenAI-style messages (content a string or a list of text parts)."""
    if not isinstance(raw, list) or not raw:
        raise ChatError("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise ChatError(f"messages[{i}] must be an object")
        role = m.get("role")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        if role not in ROLES:
            raise ChatError(f"messages[{i}].role {role!r} is not one of {', '.join(ROLES)}")
        reasoning = m.get("reasoning_content") or ""
        if not isinstance(reasoning, str):
            raise ChatError(f"messages[{i}].reasoning_content must be a string")
        out.append(Message(role, _text(m.get("content"), i), reasoning))
    return out


def _text(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(
                p.get("text"), str
            ):
                raise ChatError(f"messages[{i}].content: only text parts are supported")
            parts.append(p["text"])
        return "".join(parts)
    raise ChatError(f"messages[{i}].content must be a string or a list of text parts")


def render_k3(messages: list[Message], thinking: bool = True) -> str:
    """The built-in K3 prompt for `messages`, ending with the assistant generation prompt."""
    mk = K3_MARKERS
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    out = []
    for i, m in enumerate(messages):
        if m.role != "assistant":
            out.append(f"{mk[m.role]}{m.content}{mk['end']}")
            continue
        reasoning = m.reasoning if i > last_user else ""
        out.append(
            f"{mk['assistant']}{mk['think_open']}{reasoning}{mk['think_close']}"
            f"{m.content}{mk['end']}"
        )
    out.append(mk["assistant"] + (mk["think_open"] if thinking else mk["think_open"] +
                                  mk["think_close"]))
    return "".join(out)


class ChatTemplate:
    """Renders chat requests for one model: its own Jinja template if it has one, else K3's.

    `stop` holds the strings that end an assistant turn (to pass to the engine as stop strings).
    """

    def __init__(self, source: str | None = None, special: dict[str, str] | None = None):
        self.source = source
        self.special = dict(special or {})
        end = K3_MARKERS["end"] if source is None else self.special.get("eos_token")
        self.stop: tuple[str, ...] = (end,) if end else ()
        self._compiled = None

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> ChatTemplate:
        """The template of a checkpoint directory (built-in K3 format when it ships none)."""
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}
        special = {k: v for k, v in special.items() if v}
        jinja_path = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                return cls(f.read(), special)
        return cls(_pick_template(config.get("chat_template"), path), special)

    def render(self, messages: list[Message], thinking: bool = True,
               extra: dict[str, Any] | None = None) -> str:
        """Prompt text for `messages` plus the generation prompt; `extra` reaches the template."""
        if self.source is None:
            return render_k3(messages, thinking)
        env_kwargs = dict(self.special)
        env_kwargs.update(extra or {})
        env_kwargs.update(thinking=thinking, enable_thinking=thinking,
                          add_generation_prompt=True, messages=[_as_dict(m) for m in messages])
        try:
            return self._template().render(**env_kwargs)
        except ChatError:
            raise
        except Exception as e:  # noqa: BLE001 - any Jinja error: the template's or the request's
            raise ChatError(f"chat template failed: {type(e).__name__}: {e}") from None

    def opens_thinking(self, prompt: str) -> bool:
        """Whether generation starts inside a thinking channel (the prompt ends with `<think>`)."""
        return prompt.rstrip().endswith(K3_MARKERS["think_open"])

    def _template(self):
        if self._compiled is None:
            self._compiled = _compile(self.source)
        return self._compiled


def _compile(source: str):
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ChatError("this checkpoint ships a chat template: install jinja2 to use it") from None

    def raise_exception(message: str):
        raise ChatError(f"chat template refused the request: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ChatError(f"chat template does not compile: {e}") from None


def _as_dict(m: Message) -> dict[str, str]:
    d = {"role": m.role, "content": m.content}
    if m.reasoning:
        d["reasoning_content"] = m.reasoning
    return d


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ChatError(f"{path}: unreadable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ChatError(f"{path}: expected a JSON object")
    return data


def _token_text(tok: Any) -> str | None:
    if isinstance(tok, dict):  # {"content": "<|im_end|>", ...} in older tokenizer configs
        tok = tok.get("content")
    return tok if isinstance(tok, str) else None


def _pick_template(value: Any, path: str | os.PathLike) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of {name, template} (use 'default')."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ChatError(f"{path}/tokenizer_config.json: chat_template has no usable default template")


class ReasoningSplitter:
    """Splits generated text into (reasoning, content) at the first `</think>`.

    Feed pieces as they are generated; a piece that might be the start of `</think>` is held back
    until the next piece decides it. With `thinking=False` everything is content.
    """

    def __init__(self, thinking: bool, close: str = K3_MARKERS["think_close"]):
        self.in_reasoning = thinking
        self.close = close
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning delta, content delta) for the next piece of generated text."""
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

    def flush(self) -> tuple[str, str]:
        """Whatever is held back at the end of generation (it was reasoning after all)."""
        held, self._held = self._held, ""
        return (held, "") if self.in_reasoning else ("", held)


def split_reasoning(text: str, thinking: bool) -> tuple[str, str]:
    """(reasoning, content) of a whole generated text."""
    s = ReasoningSplitter(thinking)
    parts = [s.feed(text), s.flush()]
    return "".join(p[0] for p in parts), "".join(p[1] for p in parts)


def _partial_suffix(buf: str, marker: str) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(buf)), 0, -1):
        if marker.startswith(buf[-n:]):
            return n
    return 0


def thinking_option(body: dict[str, Any], default: bool = True) -> bool:
    """The request's thinking switch: `"thinking": bool` or `chat_template_kwargs.thinking`
    (or `enable_thinking`, Qwen's spelling); default on."""
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ChatError("'chat_template_kwargs' must be an object")
    for value in (body.get("thinking"), kwargs.get("thinking"), kwargs.get("enable_thinking")):
        if value is not None:
            if not isinstance(value, bool):
                raise ChatError("'thinking' must be true or false")
            return value
    return default


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """Extra JSON-scalar variables a request passes to a checkpoint's own template."""
    kwargs = body.get("chat_template_kwargs") or {}
    return {k: v for k, v in kwargs.items() if isinstance(k, str)
            and k not in ("messages", "add_generation_prompt")
            and (v is None or isinstance(v, (str, int, float, bool)))}


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


def special_tokens(tokenizer: Any) -> dict[str, int]:
    """Special tokens (text -> id) of a `reap.tokenizer.Tokenizer`-like object: its
    `special_tokens` mapping if it has one, else those of its wrapped `tokenizers.Tokenizer`."""
    specials = getattr(tokenizer, "special_tokens", None)
    if isinstance(specials, dict):
        return dict(specials)
    inner = getattr(tokenizer, "_tok", None)
    if inner is None or not hasattr(inner, "get_added_tokens_decoder"):
        return {}
    return {t.content: i for i, t in inner.get_added_tokens_decoder().items() if t.special}


def encode_prompt(text: str, encode: Callable[[str], list[int]],
                  specials: dict[str, int]) -> list[int]:
    """Token ids of a rendered prompt: special tokens spelled in it map to their ids, the text
    between them goes through `encode` (which treats everything as plain text)."""
    if not specials:
        return encode(text)
    pattern = "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))
    ids: list[int] = []
    at = 0
    for m in re.finditer(pattern, text):
        if m.start() > at:
            ids += encode(text[at:m.start()])
        ids.append(specials[m.group()])
        at = m.end()
    if at < len(text):
        ids += encode(text[at:])
    return ids


# --------------------------------------------------------------------------- request fields

@dataclass
class Params:
    """Validated sampling parameters of one request."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()


_UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "tools", "functions", "suffix")


def parse_params(body: dict[str, Any], default_max: int, limit: int) -> Params:
    """Sampling parameters of an OpenAI request body (no seed: 0); ChatError naming the field."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = default_max if max_tokens is None else max_tokens
    _need(_is_int(max_tokens) and 1 <= max_tokens <= limit, "max_tokens",
          f"must be an integer in [1, {limit}] (the server limit and the room the prompt "
          "leaves in the context)")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    _need(top_p > 0, "top_p", "must be in (0, 1]")
    seed = 0 if body.get("seed") is None else body["seed"]
    _need(_is_int(seed) and 0 <= seed < 2**63, "seed", "must be an integer in [0, 2^63)")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    _need(isinstance(stop, list) and len(stop) <= 4 and all(isinstance(x, str) and x
                                                            for x in stop),
          "stop", "must be a non-empty string or a list of at most 4 of them")
    _need(body.get("n", 1) == 1 and body.get("best_of", 1) == 1, "n", "only n=1 is supported")
    for name in _UNSUPPORTED:
        _need(body.get(name) in (None, False, []), name, "is not supported by this server")
    return Params(max_tokens, temperature, top_p, seed, tuple(stop))


def completion_ids(body: dict[str, Any], encode: Callable[[str], list[int]],
                   specials: dict[str, int]) -> list[int]:
    """Prompt token ids of a /v1/completions body: one string or one list of token ids."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        ids = encode_prompt(p, encode, specials)
    else:
        ok = isinstance(p, list) and all(_is_int(t) and t >= 0 for t in p)
        _need(ok, "prompt", "must be one string or one list of token ids")
        ids = list(p)
    _need(bool(ids), "prompt", "is empty")
    return ids


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    _need(isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v <= hi, name,
          f"must be a number in [{lo:g}, {hi:g}]")
    return float(v)


def _need(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ChatError(f"'{param}' {message}", param)
