"""Chat templates render within bounds (`reap.serve.sandbox`): a template that loops for hours,
builds a gigabyte string or fails to compile is refused in one line naming the bound it passed,
and the server keeps answering meanwhile and afterwards (issue 34, part 3). The harness around
it is experiments/fuzz_tokenizers.py.

Each render here that the old code ran in-process would hang or build the string: the renders
run in a thread joined with a generous bound, so a regression fails instead of hanging.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import psutil
import pytest

from reap.errors import CheckpointError
from reap.serve import sandbox
from reap.serve.chat import ChatTemplate
from reap.serve.params import Message, RequestError

MSGS = [Message("user", "hi")]
NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}BODY{% endfor %}{% endfor %}"


@pytest.fixture
def one_second(monkeypatch):
    monkeypatch.setattr(sandbox, "SECONDS", 1.0)


def refusal(source: str, max_chars: int = 100_000) -> str:
    """The one-line refusal of rendering `source` (fails if it renders or takes over 60 s)."""
    tpl = ChatTemplate(source)
    out: dict = {}

    def render():
        try:
            out["text"] = tpl.render(MSGS, max_chars=max_chars)
        except RequestError as e:
            out["error"] = str(e)

    thread = threading.Thread(target=render, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the render was not stopped"
    assert "error" in out, f"rendered {len(out['text'])} characters"
    assert "\n" not in out["error"]
    return out["error"]


@pytest.mark.parametrize("source,bound", [
    (NESTED.replace("BODY", "x"), "over the limit of 100000 characters"),  # output
    (NESTED.replace("BODY", ""), "took over the 1 s limit"),  # no output: time
    ("{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}",
     "took over the 1 s limit"),
    ("{{ 'a' * 10**9 }}", "memory limit"),
    ("{{ 'a'.ljust(10**9) }}", "memory limit"),
    ("{{ 10 ** (10 ** 10) }}", "took over the 1 s limit"),
    ("{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}",
     "took over the 1 s limit"),
])
def test_hostile_templates_are_refused_naming_the_bound(one_second, source, bound):
    assert bound in refusal(source)


@pytest.mark.parametrize("source,message", [
    ("{% for m in messages %}{{ m.content }", "TemplateSyntaxError: unexpected '}'"),
    ("{{ messages[0].nothing.deeper }}", "UndefinedError"),
    ("{{ raise_exception('no\\nway') }}", "chat template refused the request: no way"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
])
def test_template_errors_are_one_line(one_second, source, message):
    assert message in refusal(source)


def test_a_render_after_a_refusal_and_a_valid_render_in_bounds(monkeypatch):
    tpl = ChatTemplate("{% if messages[0].content == 'loop' %}" + NESTED.replace("BODY", "")
                       + "{% endif %}{{ messages[0].content }}|{{ bos_token }}",
                       {"bos_token": "[BOS]"})
    with monkeypatch.context() as m:
        m.setattr(sandbox, "SECONDS", 1.0)
        with pytest.raises(RequestError, match="took over the 1 s limit"):
            tpl.render([Message("user", "loop")])
    assert tpl.render(MSGS) == "hi|[BOS]"
    with pytest.raises(RequestError, match="over the limit of 3 characters"):
        tpl.render(MSGS, max_chars=3)


def test_template_file_not_utf8_is_a_checkpoint_error(tmp_path):
    (tmp_path / "chat_template.jinja").write_bytes(b"{{ '\xff' }}")
    with pytest.raises(CheckpointError, match="not UTF-8"):
        ChatTemplate.from_dir(tmp_path)


class EchoBackend:
    """Byte tokens; generates nothing but the end of text (no model)."""

    model_id, eos_id, special, context, expert_failures = "fake", 256, {}, 1024, []

    def __init__(self, template: ChatTemplate):
        self.template = template

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return ""

    def tokens(self, ids, *, max_tokens, temperature, top_p, seed):
        yield self.eos_id

    def close(self) -> None:
        pass


def render_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children() if "sandbox.py" in " ".join(p.cmdline())]


def test_server_answers_during_and_after_a_refused_render(monkeypatch):
    from reap.serve.http import Server

    monkeypatch.setattr(sandbox, "SECONDS", 3.0)
    server = Server(EchoBackend(ChatTemplate(NESTED.replace("BODY", ""))), "127.0.0.1", 0).start()
    base = server.url.removesuffix("/v1")
    answer: dict = {}

    def chat():
        body = json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode()
        req = urllib.request.Request(server.url + "/chat/completions", body,
                                     {"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=60)
        except urllib.error.HTTPError as e:
            answer.update(status=e.code, body=json.loads(e.read()))

    try:
        thread = threading.Thread(target=chat, daemon=True)
        thread.start()
        for _ in range(600):  # until the render's process is running
            if render_children() or not thread.is_alive():
                break
            time.sleep(0.05)
        with urllib.request.urlopen(base + "/health", timeout=10) as r:
            assert r.status == 200
        thread.join(60)
        assert answer["status"] == 400
        assert "took over the 3 s limit" in answer["body"]["error"]["message"]
        with urllib.request.urlopen(base + "/health", timeout=10) as r:
            assert r.status == 200
        assert render_children() == []  # killed: nothing keeps burning
    finally:
        server.stop()
