"""Errors contained at the tokenizer boundary (issue 34, part 5): a Kimi tokenizer that would make
tiktoken panic (a rank file missing single bytes: `pyo3_runtime.PanicException`, a BaseException)
or fail (`added_tokens_decoder` keys that pass `str.isdigit()` but not `int()`, texts tiktoken
cannot take, two ids with one text) is a one-line CheckpointError when it is loaded, so `run`,
`calibrate` and `reap serve` refuse it with exit 2 before any text reaches tiktoken. The harness
around it is experiments/fuzz_tokenizers.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from test_tokenizer_kimi import K3_NAMES, write_kimi_tokenizer

from reap.errors import CheckpointError, ReapError
from reap.models import builtin_config
from reap.tokenizer import load_tokenizer

BYTES = {bytes([b]): b for b in range(256)}
BASE = 256


def without(*dropped: int) -> dict[bytes, int]:
    kept = [t for t in BYTES if t[0] not in dropped]
    return {t: i for i, t in enumerate(kept)}


def rekey(new_key: str):
    def fn(cfg):
        added = cfg["added_tokens_decoder"]
        added[new_key] = added.pop(str(BASE + 3))
    return fn


def entry(offset: int, **fields):
    return lambda cfg: cfg["added_tokens_decoder"][str(BASE + offset)].update(fields)


@pytest.fixture(autouse=True)
def no_tiktoken_cache(monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")


def test_missing_single_byte_ranks_are_refused(tmp_path):
    write_kimi_tokenizer(tmp_path, without(0xE4))
    with pytest.raises(CheckpointError, match="no rank for the single byte 0xe4") as e:
        load_tokenizer(tmp_path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("edit,expected", [
    (rekey("²"), "is not an id"),  # isdigit() but not int()
    (rekey("9" * 5000), "is not an id"),  # past int()'s 4300 digits
    (rekey("５"), "is not an id"),
    (entry(3, content=""), "non-empty 'content'"),  # would match between every character
    (entry(4, content="<|open|>"), "two ids the same text"),
    (entry(3, content=f"<|reserved_token_{BASE + 6}|>"), "two ids the same text"),
    (entry(3, content="\ud800"), "tiktoken refuses it"),
    (entry(3, content="<" + "x" * 1_000_000), "tiktoken refuses it"),
    # before: accepted, and generation never stopped at it (exit 0)
    (lambda cfg: cfg.update(eos_token="[none]", eos_token_id=-5), "eos_token_id -5 is not in"),
])
def test_bad_added_tokens_are_one_line_errors(tmp_path, edit, expected):
    cfg = write_kimi_tokenizer(tmp_path, BYTES)
    edit(cfg)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=expected) as e:
        load_tokenizer(tmp_path)
    assert "\n" not in str(e.value) and len(str(e.value)) < 500


@pytest.fixture(scope="module")
def broken_kimi(tmp_path_factory) -> Path:
    """A tiny K3 whose Kimi tokenizer has no rank for 0xe4 (the first byte of CJK text)."""
    from reap.synth import synth

    cfg = copy.deepcopy(builtin_config("k3-tiny"))
    cfg["text_config"]["vocab_size"] = BASE - 1 + 258
    d = Path(synth(cfg, tmp_path_factory.mktemp("k3") / "k3", seed=0, dtype="float32"))
    (d / "tokenizer.json").unlink()
    write_kimi_tokenizer(d, without(0xE4), K3_NAMES)
    return d


@pytest.mark.parametrize("command", [
    ["run", "--prompt", "中文", "--max-tokens", "1", "--context", "32", "--threads", "1"],
    ["calibrate", "--corpus", "zh", "--tokens", "16", "--seq-len", "8", "--no-progress",
     "--out", "OUT"],
])
def test_run_and_calibrate_refuse_a_panicking_tokenizer(broken_kimi, tmp_path, capsys, command):
    from reap.cli import main

    argv = [command[0], str(broken_kimi)] + [str(tmp_path / "cal") if a == "OUT" else a
                                             for a in command[1:]]
    assert main(argv) == 2  # before: pyo3_runtime.PanicException escaped main
    err = capsys.readouterr().err
    assert err.count("reap: error:") == 1 and "no rank for the single byte 0xe4" in err
    assert "Traceback" not in err and "panicked" not in err


def test_serve_refuses_a_panicking_tokenizer_at_start(broken_kimi):
    from reap.serve.backend import open_backend

    # before: the server started and dropped the connection of a request holding 0xe4
    with pytest.raises(ReapError, match="no rank for the single byte 0xe4"):
        open_backend(str(broken_kimi), "k3", context=64)
