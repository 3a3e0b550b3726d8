"""Tokenizers shipped with checkpoints: any `tokenizer.json` (the byte-level one `reap synth`
writes is an ordinary byte-level BPE with no merges: id = byte value, 256 = end of text), Kimi's
tiktoken format, and encoding text in which special tokens (chat markers) are spelled out.

Kimi releases ship BPE ranks (`tiktoken.model`) and name their special tokens in
`tokenizer_config.json`; `KimiTokenizer` reads them with `tiktoken` the way the release's
`tokenization_kimi.py` does (its split pattern, 258 special ids from the base vocabulary up).
Text is always encoded as text, as the release encodes it with `allow_special_tokens=False`.

A chat prompt is rendered as text with its markers spelled out; `encode_prompt` maps the markers
to their ids. Content that spells a marker stays text: `protect` marks each spelling (a
noncharacter after its first character) before rendering, and `encode_prompt` unmarks it.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

from reap.errors import CheckpointError

EOS_TOKEN = "<|endoftext|>"
KIMI_RANKS = "tiktoken.model"  # the Kimi releases' BPE rank file
# Kimi's split pattern (the release's `pat_str`): runs of Han characters; words with an optional
# leading non-letter, split at case changes, with English contractions; 1-3 digits; punctuation
# runs; newlines; other whitespace (as in cl100k).
_LETTERS_UP = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LETTERS_LOW = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_WORD_LEAD = r"[^\r\n\p{L}\p{N}]?"
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    _WORD_LEAD + _LETTERS_UP + "*" + _LETTERS_LOW + "+" + _CONTRACTION,
    _WORD_LEAD + _LETTERS_UP + "+" + _LETTERS_LOW + "*" + _CONTRACTION,
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
KIMI_SPECIAL_SLOTS = 258  # special ids after the base vocabulary (256 reserved + 2)
# tiktoken's Rust core panics on very long pieces; the release cuts text as below first, which
# changes ids only for runs this long (so the cut must be the same to give the same ids)
_MAX_CHUNK_CHARS = 400_000
_MAX_RUN_CHARS = 25_000
MARK = "\ufdd0"  # a noncharacter: never in real text, marks spelled markers in message content


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
        self._special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens added or recognized in the text)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], keep: frozenset[int] = frozenset()) -> str:
        """Text of `ids` (special tokens dropped but those in `keep`, such as the markers of a
        chat format's reasoning channel; invalid UTF-8 becomes U+FFFD)."""
        if not keep:
            return self._tok.decode(list(ids), skip_special_tokens=True)
        ids = [i for i in ids if i in keep or i not in self._special]
        return self._tok.decode(ids, skip_special_tokens=False)

    def special_tokens(self) -> dict[str, int]:
        """Added tokens (text -> id): the chat markers and controls `encode` treats as text and
        `encode_prompt` maps to their ids (markers not flagged special, such as Qwen3's
        `<think>`, included)."""
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}


class KimiTokenizer:
    """Kimi's tiktoken tokenizer (see the module docstring); the same interface as `Tokenizer`.

    `ranks`: token bytes -> rank (= id); `named`: id -> (text, special flag) from
    `added_tokens_decoder`."""

    def __init__(self, ranks: dict[bytes, int], named: dict[int, tuple[str, bool]],
                 eos_id: int | None, name: str = KIMI_RANKS):
        import tiktoken

        base = len(ranks)
        self.specials = {named.get(i, (f"<|reserved_token_{i}|>", True))[0]: i
                         for i in range(base, base + KIMI_SPECIAL_SLOTS)}
        self._enc = tiktoken.Encoding(name=name, pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                                      special_tokens=self.specials)
        # decode drops the special-flagged and reserved ids, keeps named markers (as HF does)
        self._dropped = {i for i in self.specials.values() if named.get(i, ("", True))[1]}
        self.eos_id, self.vocab_size = eos_id, self._enc.n_vocab

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, all of it as text (spelled special tokens included)."""
        ids: list[int] = []
        for piece in _kimi_pieces(text):
            ids += self._enc.encode_ordinary(piece)
        return ids

    def decode(self, ids: list[int], keep: frozenset[int] = frozenset()) -> str:
        """Text of `ids` (special-flagged and reserved ids dropped but those in `keep`;
        invalid UTF-8 -> U+FFFD)."""
        return self._enc.decode([i for i in ids if i in keep or i not in self._dropped])

    def special_tokens(self) -> dict[str, int]:
        """The special ids' texts (text -> id), markers not flagged special included."""
        return dict(self.specials)


def _kimi_pieces(text: str) -> Iterator[str]:
    """`text` cut as the release cuts it before BPE: chunks of at most 400,000 characters, each
    cut so no run of whitespace or of non-whitespace exceeds 25,000 characters (re's whitespace
    is str.isspace, the release's test)."""
    for at in range(0, len(text), _MAX_CHUNK_CHARS):
        chunk = text[at:at + _MAX_CHUNK_CHARS]
        cuts = [m.start() + k for m in re.finditer(r"\s+|\S+", chunk)
                for k in range(_MAX_RUN_CHARS, len(m[0]), _MAX_RUN_CHARS)]
        yield from (chunk[a:b] for a, b in zip([0, *cuts], [*cuts, len(chunk)]))


def encode_prompt(text: str, encode: Callable[[str], list[int]],
                  specials: dict[str, int], protected: bool = False) -> list[int]:
    """Token ids of a rendered prompt: special tokens spelled in it map to their ids, the text
    between them goes through `encode` (which treats everything as plain text). With
    `protected`, the text was rendered from content passed through `protect`: the spellings it
    marked are encoded as text and the marks removed."""
    if not specials:
        return encode(_unmark(text) if protected else text)
    pattern = "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))
    ids: list[int] = []
    for i, part in enumerate(re.split(f"({pattern})", text)):  # text, special, text, ...
        if i % 2:
            ids.append(specials[part])
        elif part:
            ids += encode(_unmark(part) if protected else part)
    return ids


def protect(content: str, specials: dict[str, int] | list[str]) -> str:
    """Message content with every spelled special token marked (`MARK` after its first
    character) so that `encode_prompt(..., protected=True)` encodes it as text; a `MARK`
    already in the content is doubled."""
    content = content.replace(MARK, MARK + MARK)
    if not specials or not content:
        return content
    pattern = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)
                                  if s))
    while pattern.search(content):  # again: marking one spelling may leave an overlapping one
        content = pattern.sub(lambda m: m[0][0] + MARK + m[0][1:], content)
    return content


def _unmark(text: str) -> str:
    return re.sub(MARK + f"({MARK})?", lambda m: m[1] or "", text)


def has_tokenizer(checkpoint_dir: str | Path) -> bool:
    """Whether a checkpoint directory ships a tokenizer `load_tokenizer` reads."""
    d = Path(checkpoint_dir)
    return (d / "tokenizer.json").is_file() or (d / KIMI_RANKS).is_file()


def load_tokenizer(checkpoint_dir: str | Path) -> Tokenizer | KimiTokenizer:
    """The tokenizer of a checkpoint directory: `tokenizer.json` (end-of-text token from
    `tokenizer_config.json`, else `eos_token_id` in config.json), else Kimi's
    `tiktoken.model` + `tokenizer_config.json`."""
    from tokenizers import Tokenizer as HFTokenizer

    d = Path(checkpoint_dir)
    path = d / "tokenizer.json"
    if not path.is_file() and (d / KIMI_RANKS).is_file():
        return load_kimi_tokenizer(d)
    if not path.is_file():
        raise CheckpointError(f"{path}: no tokenizer.json (nor {KIMI_RANKS}) in the checkpoint")
    try:
        tok = HFTokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on bad JSON
        raise CheckpointError(f"{path}: cannot load tokenizer ({str(e).splitlines()[0]})") from None
    return Tokenizer(tok, _eos_id(d, tok.token_to_id, tok.get_vocab_size()))


def load_kimi_tokenizer(d: Path) -> KimiTokenizer:
    """Kimi's tokenizer from `d/tiktoken.model` and `d/tokenizer_config.json`."""
    from reap.checkpoint.header import load_json
    from reap.checkpoint.spec import MAX_TOKENIZER_BYTES

    cfg_path = d / "tokenizer_config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{cfg_path}: missing (a {KIMI_RANKS} tokenizer names its "
                              "special tokens there)")
    named = _named_tokens(load_json(cfg_path, "tokenizer config"), cfg_path)
    ranks = read_ranks(d / KIMI_RANKS, MAX_TOKENIZER_BYTES)
    base = len(ranks)
    outside = sorted(i for i in named if not base <= i < base + KIMI_SPECIAL_SLOTS)
    if outside:
        raise CheckpointError(f"{cfg_path}: added_tokens_decoder id {outside[0]} is outside the "
                              f"special ids {base}..{base + KIMI_SPECIAL_SLOTS - 1} of "
                              f"{KIMI_RANKS}")
    try:
        tok = KimiTokenizer(ranks, named, None, name=KIMI_RANKS)
    except ValueError as e:  # tiktoken's, e.g. special tokens too long for its regex
        raise CheckpointError(f"{cfg_path}: tiktoken refuses it ({str(e).splitlines()[0]})"
                              ) from None
    if len(tok.specials) < KIMI_SPECIAL_SLOTS:
        raise CheckpointError(f"{cfg_path}: added_tokens_decoder gives two ids the same text")
    tok.eos_id = _eos_id(d, tok.specials.get, tok.vocab_size)
    return tok


def read_ranks(path: Path, limit: int) -> dict[bytes, int]:
    """A tiktoken rank file (`base64(token) rank` per line) as token bytes -> rank; the ranks
    must be 0..n-1 (ids), each once (CheckpointError naming the file and line otherwise)."""
    from reap.checkpoint.files import read_regular

    ranks: dict[bytes, int] = {}
    for n, line in enumerate(read_regular(path, KIMI_RANKS, limit).splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise CheckpointError(f"{path}: line {n} is not 'base64-token rank'") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise CheckpointError(f"{path}: ranks are not the ids 0..{len(ranks) - 1}, each once "
                              "(a duplicate token or rank, or a gap)")
    if missing := [b for b in range(256) if bytes([b]) not in ranks]:  # tiktoken panics on it
        raise CheckpointError(f"{path}: no rank for the single byte {missing[0]:#04x} "
                              f"({len(missing)} of the 256 bytes missing)")
    return ranks


def _named_tokens(cfg: dict, path: Path) -> dict[int, tuple[str, bool]]:
    """id -> (text, special flag) of `added_tokens_decoder`."""
    added = cfg.get("added_tokens_decoder", {})
    if not isinstance(added, dict):
        raise CheckpointError(f"{path}: added_tokens_decoder is not an object")
    named = {}
    for key, entry in added.items():
        text = token_text(entry)
        if not re.fullmatch("[0-9]{1,18}", key) or not text:
            raise CheckpointError(f"{path}: added_tokens_decoder[{key[:40]!r}] is not an id "
                                  "with a non-empty 'content' string")
        flag = entry.get("special", True) if isinstance(entry, dict) else True
        named[int(key)] = (text, bool(flag))
    return named


def _eos_id(d: Path, token_to_id: Callable[[str], int | None], n_vocab: int) -> int | None:
    from reap.checkpoint.header import load_json  # the checkpoint layer imports torch
    from reap.models.validate import text_of

    for name in ("tokenizer_config.json", "config.json"):
        cfg = load_json(d / name, name) if (d / name).is_file() else {}
        eos = token_text(cfg.get("eos_token"))
        if eos is not None and token_to_id(eos) is not None:
            return token_to_id(eos)
        eid = cfg.get("eos_token_id", text_of(cfg).get("eos_token_id"))
        if isinstance(eid, list):
            eid = eid[0] if eid else None
        if isinstance(eid, int) and not 0 <= eid < n_vocab:
            raise CheckpointError(f"{d / name}: eos_token_id {eid} is not in 0..{n_vocab - 1}")
        if isinstance(eid, int):
            return eid
    return None


def token_text(token) -> str | None:
    """A special token's text as a tokenizer config spells it: a string or {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None
