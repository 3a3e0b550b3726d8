"""The server's backend over the streaming engine: tokenizer, chat template and token stream of
one `reap.engine.Engine`, with the chat format its model family declares."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator

from reap.errors import ReapError
from reap.models import family
from reap.serve.chat import ChatTemplate
from reap.tokenizer import encode_prompt


class EngineBackend:
    """The server's backend over a `reap.engine.Engine`; only the worker thread calls it."""

    def __init__(self, engine, model_id: str, template_dir: str | os.PathLike):
        tok = engine.tokenizer
        if tok is None:
            raise ReapError(f"{engine.path}: no tokenizer (tokenizer.json or tiktoken.model); "
                            "the server needs one")
        self.engine, self.model_id, self.context = engine, model_id, engine.context
        self.encode, self.decode, self.eos_id = tok.encode, tok.decode, tok.eos_id
        self.special = tok.special_tokens()
        builtin = family(engine.config).chat_format(engine.config)
        self.template = ChatTemplate.from_dir(template_dir, builtin)
        self.template.protected = tuple(self.special)  # spelled in content, they stay text
        # generated text keeps the special tokens that delimit reasoning or end a turn
        marks = (self.template.think_open, self.template.think_close, *self.template.stop)
        keep = frozenset(i for m in marks for i in encode_prompt(m, lambda s: [], self.special))
        self.decode = functools.partial(tok.decode, keep=keep)

    def tokens(self, ids, *, max_tokens, temperature, top_p, seed) -> Iterator[int]:
        return self.engine.stream(ids, max_tokens=max_tokens, temperature=temperature,
                                  top_p=top_p, seed=seed)

    @property
    def expert_failures(self) -> list:
        return self.engine.expert_failures

    def close(self) -> None:
        self.engine.close()


def open_backend(model: str | None, served_name: str | None = None, **engine_options):
    """Open the engine on `model` (path, URL or None for the default) as a server backend."""
    from reap.checkpoint import default_cache_dir, is_url
    from reap.engine.core import Engine

    engine = Engine.open(model, **engine_options)
    where = default_cache_dir(engine.path) if is_url(engine.path) else engine.path
    name = served_name or os.path.basename(str(engine.path).rstrip("/")) or "model"
    try:
        return EngineBackend(engine, name, where)
    except ReapError:
        engine.close()
        raise
