"""Kimi's tiktoken tokenizer (`reap.tokenizer.KimiTokenizer`) against the release's construction.

The oracle is `tiktoken`'s own `Encoding` built the way the release's `tokenization_kimi.py`
builds it (written out here independently of `reap`): the rank file read by tiktoken's
`load_tiktoken_bpe`, the release's split pattern spelled as the release spells it, special
tokens at ids from the base vocabulary size up (named by `added_tokens_decoder`, the rest
`<|reserved_token_{id}|>`), text cut into 400,000-character chunks and runs of at most 25,000
(non-)whitespace characters, each piece encoded with `disallowed_special=()` (the release's
`encode(text, allow_special_tokens=False)`).

The rank file is made here: a small BPE trained with tiktoken's own educational trainer on the
shipped corpora. The tokenizer config is made here too, with the K3 release's special-token
names (the release's own file is not public); its ids start at this rank file's base size.
"""

from __future__ import annotations

import base64
import functools
import json
import lzma
from pathlib import Path

import pytest
import tiktoken

from reap.errors import CheckpointError
from reap.tokenizer import encode_prompt, load_tokenizer, protect

CORPORA = Path(__file__).resolve().parents[1] / "corpora"
# the release's pat_str, as tokenization_kimi.py writes it
RELEASE_PAT = "|".join([  # noqa: FLY002 - spelled as the release spells it
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# K3's special-token names by offset from the base vocabulary (163584 in the release)
K3_NAMES = {0: ("[BOS]", True), 1: ("[EOS]", True), 2: ("<|end_of_msg|>", True),
            3: ("<|open|>", False), 4: ("<|close|>", False), 5: ("<|sep|>", False),
            21: ("<|media_pad|>", True), 254: ("[UNK]", True), 255: ("[PAD]", True)}
MERGES = 160  # trained merges on top of the 256 bytes


def corpus_texts(split: str) -> list[str]:
    """Texts of every shipped corpus's `split` (corpora/*/<split>.jsonl.xz) and the prompts."""
    texts = []
    for path in sorted(CORPORA.glob(f"*/{split}.jsonl.xz")):
        with lzma.open(path, "rt", encoding="utf-8") as f:
            texts += [json.loads(line)["text"] for line in f]
    for path in sorted(CORPORA.glob("prompts/*.jsonl")):
        texts += [json.dumps(json.loads(line), ensure_ascii=False) for line in path.open()]
    return texts


def write_kimi_tokenizer(d: Path, ranks: dict[bytes, int], names=K3_NAMES,
                         eos: str = "<|end_of_msg|>") -> dict:
    """tiktoken.model and a K3-style tokenizer_config.json in `d`; returns the config."""
    d.mkdir(parents=True, exist_ok=True)
    lines = [base64.b64encode(t) + b" " + str(r).encode() for t, r in
             sorted(ranks.items(), key=lambda kv: kv[1])]
    (d / "tiktoken.model").write_bytes(b"\n".join(lines) + b"\n")
    base = len(ranks)
    cfg = {"added_tokens_decoder": {str(base + k): {"content": t, "lstrip": False,
                                                    "normalized": False, "rstrip": False,
                                                    "single_word": False, "special": s}
                                    for k, (t, s) in names.items()},
           "bos_token": "[BOS]", "eos_token": eos, "pad_token": "[PAD]", "unk_token": "[UNK]",
           "tokenizer_class": "TikTokenTokenizer",
           "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return cfg


@functools.cache  # one training per test session (tests/test_chat_release.py uses it too)
def train_ranks() -> dict[bytes, int]:
    """A small BPE trained by tiktoken's own trainer on a sample of every shipped corpus."""
    from tiktoken._educational import bpe_train

    sample = []
    for path in sorted(CORPORA.glob("*/train.jsonl.xz")):
        with lzma.open(path, "rt", encoding="utf-8") as f:
            sample += [json.loads(next(f))["text"][:300] for _ in range(6)]
    return bpe_train("".join(sample), 256 + MERGES, RELEASE_PAT, visualise=None)


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("kimi")
    write_kimi_tokenizer(d, dict(train_ranks()))
    return d


@pytest.fixture(autouse=True)
def no_tiktoken_cache(monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # tiktoken caches local files by path: off


def release_encoding(d: Path):
    """tiktoken's Encoding built as tokenization_kimi.py builds it."""
    from tiktoken.load import load_tiktoken_bpe

    cfg = json.loads((d / "tokenizer_config.json").read_text())
    names = {int(i): e["content"] for i, e in cfg["added_tokens_decoder"].items()}
    ranks = load_tiktoken_bpe(str(d / "tiktoken.model"))
    n = len(ranks)
    specials = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + 256 + 2)}
    return tiktoken.Encoding(name="tiktoken.model", pat_str=RELEASE_PAT,
                             mergeable_ranks=ranks, special_tokens=specials)


def release_pieces(text: str) -> list[str]:
    """The release's cut: 400,000-character chunks, then runs of at most 25,000."""
    out = []
    for i in range(0, len(text), 400_000):
        s = text[i:i + 400_000]
        n, space, start = 0, s[0].isspace() if s else False, 0
        for j in range(len(s)):
            if space ^ s[j].isspace():
                n, space = 1, s[j].isspace()
            else:
                n += 1
                if n > 25_000:
                    out.append(s[start:j])
                    start, n = j, 1
        out.append(s[start:])
    return out


def release_encode(enc, text: str) -> list[int]:
    return [t for p in release_pieces(text) for t in enc.encode(p, disallowed_special=())]


def test_pattern_is_the_releases():
    from reap.tokenizer import KIMI_PATTERN

    assert KIMI_PATTERN == RELEASE_PAT


def test_every_shipped_corpus_gives_the_releases_ids_and_round_trips(kimi_dir):
    tok, enc = load_tokenizer(kimi_dir), release_encoding(kimi_dir)
    texts = corpus_texts("eval")  # every corpus's held-out split (3 M characters)
    assert len(texts) > 900 and {p.parent.name for p in CORPORA.glob("*/eval.jsonl.xz")} >= {
        "en", "de", "fr", "es", "it", "ja", "zh", "code-py", "code-c"}
    merged = 0
    for text in texts:
        ids = tok.encode(text)
        assert ids == enc.encode_ordinary(text), text[:80]
        assert tok.decode(ids) == text  # byte-exact round trip
        merged += sum(i >= 256 for i in ids)
    assert merged > 50_000  # the trained merges are used, not only single bytes


def test_release_cut_of_long_runs_and_edge_text(kimi_dir):
    tok, enc = load_tokenizer(kimi_dir), release_encoding(kimi_dir)
    cases = ["", " ", "a" * 60_001, " " * 50_003 + "x", ("ab " * 9000) + "\n" * 30_000,
             "中" * 26_000 + "文", "x" * 400_010, "naïve café 123456 ’s DON'T\r\n\t"]
    for text in cases:
        assert tok.encode(text) == release_encode(enc, text), (len(text), text[:20])
        assert tok.decode(tok.encode(text)) == text


def test_special_ids_and_names(kimi_dir):
    tok, enc = load_tokenizer(kimi_dir), release_encoding(kimi_dir)
    base = 256 + MERGES
    assert tok.vocab_size == enc.n_vocab == base + 258
    specials = tok.special_tokens()
    assert specials == {enc.decode_single_token_bytes(i).decode(): i
                        for i in range(base, base + 258)}
    assert specials["<|open|>"] == base + 3 and specials[f"<|reserved_token_{base + 6}|>"]
    assert tok.eos_id == base + 2  # eos_token "<|end_of_msg|>" of tokenizer_config.json
    # decode drops special-flagged and reserved ids, keeps named markers (not flagged special)
    ids = [base, *tok.encode("hi"), base + 3, base + 7, base + 2]
    assert tok.decode(ids) == "hi<|open|>"


def test_spelled_special_tokens_stay_text(kimi_dir):
    """Special-token text is encoded as text, as the release encodes it with
    allow_special_tokens=False: no special id, and the same ids as tiktoken's encode."""
    tok, enc = load_tokenizer(kimi_dir), release_encoding(kimi_dir)
    base = 256 + MERGES
    text = "a <|open|>message role=\"user\"<|sep|>[EOS]<|end_of_msg|><|reserved_token_500|> b"
    ids = tok.encode(text)
    assert ids == enc.encode(text, disallowed_special=()) and max(ids) < base
    assert tok.decode(ids) == text
    # in a rendered chat prompt: markers -> ids, the same text in protected content -> text
    specials = tok.special_tokens()
    content = protect("say <|end_of_msg|> and \ufdd0 too", specials)
    prompt = "<|open|>message<|sep|>" + content + "<|close|>message<|sep|><|end_of_msg|>"
    got = encode_prompt(prompt, tok.encode, specials, protected=True)
    want = ([base + 3, *enc.encode_ordinary("message"), base + 5]
            + enc.encode_ordinary("say <|end_of_msg|> and \ufdd0 too")
            + [base + 4, *enc.encode_ordinary("message"), base + 5, base + 2])
    assert got == want


def test_overlapping_spellings_are_all_protected():
    specials = {"ab": 1, "bc": 2}
    marked = protect("xabcx", specials)
    ids = encode_prompt(marked, lambda s: [ord(c) for c in s], specials, protected=True)
    assert ids == [ord(c) for c in "xabcx"]


@pytest.mark.parametrize("mutate,expected", [
    (lambda d: (d / "tiktoken.model").write_bytes(b"!!notbase64 0\n"), "line 1"),
    (lambda d: (d / "tiktoken.model").write_bytes(b"YQ== 0\nYg== 2\n"), "ranks are not"),
    (lambda d: (d / "tokenizer_config.json").write_text("{\"added_tokens_decoder\": []}"),
     "added_tokens_decoder is not an object"),
    (lambda d: (d / "tokenizer_config.json").write_text(
        json.dumps({"added_tokens_decoder": {"x": {"content": "a"}}})), "added_tokens_decoder"),
    (lambda d: (d / "tokenizer_config.json").write_text(
        json.dumps({"added_tokens_decoder": {"5": {"content": "a"}}})), "outside the special"),
    (lambda d: (d / "tokenizer_config.json").unlink(), "missing"),
])
def test_bad_files_are_one_line_errors(tmp_path, mutate, expected):
    write_kimi_tokenizer(tmp_path, {bytes([i]): i for i in range(256)})
    mutate(tmp_path)
    with pytest.raises(CheckpointError, match=expected) as e:
        load_tokenizer(tmp_path)
    assert "\n" not in str(e.value) and str(tmp_path) in str(e.value)
