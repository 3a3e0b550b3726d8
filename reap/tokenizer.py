"""Tokenizers shipped with checkpoints: loading any `tokenizer.json`, the byte-level one that
`reap synth` writes (token id = UTF-8 byte value, 256 = end of text), and encoding text in which
special tokens (chat markers) are spelled out.

The byte-level tokenizer is an ordinary Hugging Face `tokenizers` byte-level BPE with no merges,
so a trained BPE tokenizer saved the same way loads through the same `load_tokenizer`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from reap.errors import CheckpointError

EOS_TOKEN = "<|endoftext|>"


def _byte_chars() -> list[str]:
    """The printable character standing for each byte in byte-level BPE (GPT-2's mapping):
    printable Latin-1 bytes stand for themselves, the others for code points from 256 up."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    others = iter(range(256, 512))  # the next free code point for each non-printable byte
    return [chr(b) if b in keep else chr(next(others)) for b in range(256)]


def byte_tokenizer_files() -> dict[str, str]:
    """`tokenizer.json` and `tokenizer_config.json` of the byte-level tokenizer (ids 0-255 are the
    bytes, 256 is `<|endoftext|>`)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: b for b, c in enumerate(_byte_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True)])
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "bos_token": None,
        "model_max_length": 1048576,
        "clean_up_tokenization_spaces": False,
    }
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(config, indent=2)}


class Tokenizer:
    """A loaded tokenizer: `encode(text) -> list[int]`, `decode(ids) -> str`, `eos_id`,
    `vocab_size` (number of token ids it can produce)."""

    def __init__(self, tok, eos_id: int | None):
        self._tok, self.eos_id = tok, eos_id
        tok.encode_special_tokens = True  # text spelling "<|endoftext|>" is text, not a control
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens added or recognized in the text)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of `ids` (special tokens dropped; invalid UTF-8 becomes U+FFFD)."""
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def special_tokens(self) -> dict[str, int]:
        """Special tokens (text -> id): the chat markers and controls `encode` treats as text."""
        added = self._tok.get_added_tokens_decoder()
        return {t.content: i for i, t in added.items() if t.special}


def encode_prompt(text: str, encode: Callable[[str], list[int]],
                  specials: dict[str, int]) -> list[int]:
    """Token ids of a rendered prompt: special tokens spelled in it map to their ids, the text
    between them goes through `encode` (which treats everything as plain text)."""
    if not specials:
        return encode(text)
    pattern = "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))
    ids: list[int] = []
    for i, part in enumerate(re.split(f"({pattern})", text)):  # text, special, text, ...
        if i % 2:
            ids.append(specials[part])
        elif part:
            ids += encode(part)
    return ids


def load_tokenizer(checkpoint_dir: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint directory (`tokenizer.json`; end-of-text token from
    `tokenizer_config.json`, else `eos_token_id` in config.json)."""
    from tokenizers import Tokenizer as HFTokenizer

    d = Path(checkpoint_dir)
    path = d / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: no tokenizer.json in the checkpoint")
    try:
        tok = HFTokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on bad JSON
        raise CheckpointError(f"{path}: cannot load tokenizer ({str(e).splitlines()[0]})") from None
    return Tokenizer(tok, _eos_id(d, tok))


def _eos_id(d: Path, tok) -> int | None:
    from reap.checkpoint.header import load_json  # the checkpoint layer imports torch

    for name in ("tokenizer_config.json", "config.json"):
        cfg = load_json(d / name, name) if (d / name).is_file() else {}
        eos = token_text(cfg.get("eos_token"))
        if eos is not None and tok.token_to_id(eos) is not None:
            return tok.token_to_id(eos)
        eid = cfg.get("eos_token_id", cfg.get("text_config", {}).get("eos_token_id"))
        if isinstance(eid, list):
            eid = eid[0] if eid else None
        if isinstance(eid, int):
            return eid
    return None


def token_text(token) -> str | None:
    """A special token's text as a tokenizer config spells it: a string or {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None
