"""Behaviour that issue 30's removal of twice-written logic changed or unified: one request-option
validator for `reap run` and the server, one --threads check, `text_config` read through
`reap.models.validate`."""

import json

import pytest

from reap.engine.generate import OPTIONS, OptionError, request_options
from reap.errors import ReapError
from reap.serve.params import RequestError, parse_params

DEFAULTS = {"max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "seed": 0, "stop": ()}


@pytest.mark.parametrize("body, field", [
    ({"max_tokens": 1.5}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 101}, "max_tokens"),
    ({"seed": 2**63}, "seed"), ({"seed": -1}, "seed"), ({"seed": 1.0}, "seed"),
    ({"temperature": "hot"}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": -0.5}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_p": False}, "top_p"), ({"stop": 3}, "stop"), ({"stop": ["a", 1]}, "stop"),
])
def test_run_and_the_server_refuse_the_same_options(body, field):
    """`reap run --prompts` lines and the server's bodies go through one validator: the same bad
    option is refused by both, naming the same field."""
    with pytest.raises(OptionError) as run_err:
        request_options(body, DEFAULTS, 100)
    assert run_err.value.param == field
    with pytest.raises(RequestError) as serve_err:
        parse_params(body, 16, 100)
    assert serve_err.value.param == field


def test_run_and_the_server_accept_the_same_options():
    """A 40-bit seed seeds torch's generator: `reap run` used to refuse it above 2^32 while the
    server took it; options come back typed (floats, a tuple of stops)."""
    body = {"max_tokens": 100, "temperature": 1, "top_p": 1, "seed": 2**40, "stop": "x"}
    opts = request_options(body, DEFAULTS, 100)
    assert opts == {"max_tokens": 100, "temperature": 1.0, "top_p": 1.0, "seed": 2**40,
                    "stop": ("x",)}
    assert type(opts["temperature"]) is float and set(opts) == set(OPTIONS)
    assert parse_params(body, 16, 100).seed == 2**40
    # the server's own bounds stay on top (OpenAI's): temperature <= 2, at most 4 stop strings
    for extra, field in (({"temperature": 3}, "temperature"), ({"stop": list("abcde")}, "stop"),
                         ({"stop": [""]}, "stop")):
        request_options(extra, DEFAULTS, 100)
        with pytest.raises(RequestError) as e:
            parse_params(extra, 16, 100)
        assert e.value.param == field


@pytest.mark.parametrize("threads", ["0", "5000"])
def test_serve_threads_out_of_range_are_exit_2_before_the_model_opens(threads, capsys,
                                                                      monkeypatch):
    """`reap serve --threads` is checked as run and eval check it (it had no upper bound, and 0
    passed silently), before any model is opened."""
    import torch

    import reap.serve.backend
    from reap.cli import main

    def no_model(*a, **k):
        raise AssertionError("the model was opened")

    monkeypatch.setattr(reap.serve.backend, "open_backend", no_model)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    assert main(["serve", "--threads", threads]) == 2
    assert f"--threads {threads}: need an integer in [1, 4096]" in capsys.readouterr().err


def test_a_malformed_text_config_is_bad_input_for_the_tokenizer(tmp_path):
    """The eos id fallback reads `text_config` through `reap.models.validate.text_of`: a
    non-object is a one-line ConfigError, not an AttributeError."""
    from reap.models.validate import ConfigError
    from reap.tokenizer import byte_tokenizer_files, load_tokenizer

    (tmp_path / "tokenizer.json").write_text(byte_tokenizer_files()["tokenizer.json"])
    (tmp_path / "config.json").write_text(json.dumps({"text_config": [1]}))
    with pytest.raises(ConfigError, match="text_config"):
        load_tokenizer(tmp_path)
    assert issubclass(ConfigError, ReapError)
