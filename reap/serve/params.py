"""Request parsing for the OpenAI-compatible server: messages, the thinking switch, template
variables, sampling parameters and /v1/completions prompts, each validated with a `RequestError`
that names the offending field (the server answers it with HTTP 400)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from reap.engine.generate import OptionError, request_options
from reap.errors import ReapError, is_int
from reap.tokenizer import encode_prompt

ROLES = ("system", "user", "assistant")
_UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "tools", "functions", "suffix")


class RequestError(ReapError):
    """A request the server cannot honour (bad field, bad role, non-text content, template
    error); `param` names the offending request field (HTTP 400), `code` is OpenAI's error code."""

    def __init__(self, message: str, param: str | None = "messages", code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class Message:
    """One validated chat message: role, text and (assistant only) its reasoning text."""

    role: str
    content: str
    reasoning: str = ""


def parse_messages(raw: Any) -> list[Message]:
    """Validate OpenAI-style messages (content a string or a list of text parts)."""
    if not isinstance(raw, list) or not raw:
        raise RequestError("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object")
        role = m.get("role")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        if role not in ROLES:
            raise RequestError(f"messages[{i}].role {role!r} is not one of {', '.join(ROLES)}")
        reasoning = m.get("reasoning_content") or ""
        if not isinstance(reasoning, str):
            raise RequestError(f"messages[{i}].reasoning_content must be a string")
        out.append(Message(role, _text(m.get("content"), i), reasoning))
    return out


def _text(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
            raise RequestError(f"messages[{i}].content: only text parts are supported")
        return "".join(texts)
    raise RequestError(f"messages[{i}].content must be a string or a list of text parts")


def thinking_option(body: dict[str, Any], default: bool = True) -> bool:
    """The request's thinking switch: `"thinking": bool` or `chat_template_kwargs.thinking`
    (or `enable_thinking`, Qwen's spelling); default on."""
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise RequestError("'chat_template_kwargs' must be an object")
    for value in (body.get("thinking"), kwargs.get("thinking"), kwargs.get("enable_thinking")):
        if value is not None:
            if not isinstance(value, bool):
                raise RequestError("'thinking' must be true or false")
            return value
    return default


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """Extra JSON-scalar variables a request passes to a checkpoint's own template."""
    kwargs = body.get("chat_template_kwargs") or {}
    return {k: v for k, v in kwargs.items() if isinstance(k, str)
            and k not in ("messages", "add_generation_prompt")
            and (v is None or isinstance(v, (str, int, float, bool)))}


@dataclass
class Params:
    """Validated sampling parameters of one request."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()


def parse_params(body: dict[str, Any], default_max: int, limit: int) -> Params:
    """Sampling parameters of an OpenAI request body (`reap.engine.generate.request_options`,
    with OpenAI's bounds: temperature <= 2, at most 4 stop strings); RequestError naming the
    field. `limit`: the server limit and the room the prompt leaves in the context."""
    body = {**body, "max_tokens": body.get("max_completion_tokens", body.get("max_tokens"))}
    defaults = {"max_tokens": default_max, "temperature": 1.0, "top_p": 1.0, "seed": 0, "stop": ()}
    try:
        o = request_options(body, defaults, limit)
    except OptionError as e:
        raise RequestError(str(e), e.param) from None
    _need(o["temperature"] <= 2, "temperature", "must be a number in [0, 2]")
    _need(len(o["stop"]) <= 4 and all(o["stop"]), "stop",
          "must be a non-empty string or a list of at most 4 of them")
    _need(body.get("n", 1) == 1 and body.get("best_of", 1) == 1, "n", "only n=1 is supported")
    for name in _UNSUPPORTED:
        _need(body.get(name) in (None, False, []), name, "is not supported by this server")
    return Params(**o)


def check_prompt_chars(n_chars: int, max_chars: int, param: str) -> None:
    """RequestError (before anything is tokenized) for a prompt of over `max_chars` characters."""
    if n_chars > max_chars:
        raise RequestError(f"the prompt of {n_chars} characters is over the limit of {max_chars} "
                           "(--max-prompt-chars)", param, "context_length_exceeded")


def completion_ids(body: dict[str, Any], encode: Callable[[str], list[int]],
                   specials: dict[str, int], max_chars: int) -> list[int]:
    """Prompt token ids of a /v1/completions body: one string (of at most `max_chars`
    characters) or one list of token ids."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        check_prompt_chars(len(p), max_chars, "prompt")
        ids = encode_prompt(p, encode, specials)
    else:
        ok = isinstance(p, list) and all(is_int(t) and t >= 0 for t in p)
        _need(ok, "prompt", "must be one string or one list of token ids")
        ids = list(p)
    _need(bool(ids), "prompt", "is empty")
    return ids


def _need(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise RequestError(f"'{param}' {message}", param)
