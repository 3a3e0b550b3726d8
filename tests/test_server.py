"""`reap serve`: chat format, text streaming and the OpenAI-compatible HTTP layer.

The HTTP tests run a live server on 127.0.0.1 (ephemeral port) and talk to it with the official
`openai` client. Most use a small fake backend (byte-level tokens, scripted or seeded output) so
that every expected answer is known exactly; the end-to-end test serves a real k3-tiny engine.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from reap.errors import ReapError
from reap.models import FAMILIES, builtin_config, family
from reap.models.base import ChatFormat
from reap.serve.chat import ChatTemplate, render_markers
from reap.serve.hosts import check_host
from reap.serve.http import Server
from reap.serve.limits import Limits
from reap.serve.params import parse_messages
from reap.serve.stream import ReasoningSplitter, TextStream
from reap.tokenizer import encode_prompt

openai = pytest.importorskip("openai")

ALPHABET = "ab cdé中🙂\n"
K3_CONFIG = builtin_config("k3-tiny")
# a marker chat format for the server tests (Kimi K2.5's markers); K3's own format and the
# release templates are tested in tests/test_chat_release.py
K3 = ChatFormat(system="<|im_system|>system<|im_middle|>", user="<|im_user|>user<|im_middle|>",
                assistant="<|im_assistant|>assistant<|im_middle|>", end="<|im_end|>",
                think_open="<think>", think_close="</think>")


def render_k3(messages, thinking: bool = True) -> str:
    return render_markers(K3, messages, thinking)


class FakeBackend:
    """Byte tokens (0-255), EOS 256. Greedy output is `script(prompt)`; sampled output is seeded
    random text. Records prompts; detects concurrent use."""

    model_id = "fake-model"
    eos_id = 256

    def __init__(self, delay: float = 0.0, template: ChatTemplate | None = None):
        self.template = template or ChatTemplate(builtin=K3)
        self.special = {"<|im_end|>": 257}  # a chat marker that is one special token
        self.expert_failures: list = []
        self.fail: str | None = None  # "refuse" (engine limits) or "expert" (a load failure)
        self.delay = delay
        self.gate = threading.Event()  # generation waits on it; set unless a test holds a job
        self.gate.set()
        self.prompts: list[str] = []
        self.prompt_ids: list[list[int]] = []
        self.inside = 0
        self.overlap = False
        self.closed = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    @staticmethod
    def script(prompt: str) -> str:
        if prompt.endswith("<think>"):
            return "I ponder.</think>The answer is 42.<|im_end|>never sent"
        if prompt.endswith("<think></think>"):
            return "Quick answer.<|im_end|>"
        return "echo:" + prompt[-12:] + " STOP tail" + "." * 100

    def tokens(self, ids, *, max_tokens, temperature, top_p, seed):
        self.inside += 1
        self.overlap |= self.inside > 1
        try:
            if self.fail == "refuse":
                raise ReapError("prompt of 9 tokens exceeds the limit of 8 (--max-prompt)")
            if self.fail == "expert":
                self.expert_failures.append((1, 3, "short read"))
            assert self.gate.wait(60), "a test held the backend for over 60 s"
            prompt = self.decode(ids)
            self.prompts.append(prompt)
            self.prompt_ids.append(list(ids))
            if temperature == 0:
                text = self.script(prompt)
            else:
                rng = random.Random(seed)
                text = "".join(rng.choice(ALPHABET) for _ in range(max_tokens))
            for t in encode_prompt(text, self.encode, self.special):
                if self.delay:
                    time.sleep(self.delay)
                yield t
            yield self.eos_id
        finally:
            self.inside -= 1

    def close(self) -> None:
        self.closed += 1


@pytest.fixture
def served():
    servers = []

    def start(backend=None, **kw):
        s = Server(backend or FakeBackend(), "127.0.0.1", 0, **kw).start()
        servers.append(s)
        client = openai.OpenAI(base_url=s.url, api_key="none", max_retries=0, timeout=20)
        return s, client

    yield start
    for s in servers:
        s.stop()


def post(url: str, body, timeout: float = 20) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# --------------------------------------------------------------------------- chat format

# Reference: the Kimi K2.5-style template written independently as Jinja (rendered by jinja2).
KIMI_JINJA = """
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}
{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}<|im_system|>system<|im_middle|>{{ m.content }}<|im_end|>
{%- elif m.role == 'user' -%}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>
{%- else -%}<|im_assistant|>assistant<|im_middle|><think>
{%- if loop.index0 > ns.last_user -%}{{ m.reasoning_content or '' }}{%- endif -%}
</think>{{ m.content }}<|im_end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>
{%- if thinking is defined and thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}
{%- endif -%}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "a"},
     {"role": "assistant", "content": "b", "reasoning_content": "old thought"},
     {"role": "user", "content": [{"type": "text", "text": "c"}, {"type": "text", "text": "d"}]}],
    [{"role": "user", "content": "continue"},
     {"role": "assistant", "content": "partial", "reasoning_content": "kept"}],
]


def test_k3_format_golden():
    msgs = parse_messages([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert render_k3(msgs) == ("<|im_system|>system<|im_middle|>S<|im_end|>"
                               "<|im_user|>user<|im_middle|>U<|im_end|>"
                               "<|im_assistant|>assistant<|im_middle|><think>")
    assert render_k3(msgs, thinking=False).endswith("<|im_middle|><think></think>")


@pytest.mark.parametrize("thinking", [True, False])
def test_builtin_format_matches_jinja_reference(thinking):
    jinja = ChatTemplate(KIMI_JINJA)
    for conv in CONVERSATIONS:
        msgs = parse_messages(conv)
        assert render_k3(msgs, thinking) == jinja.render(msgs, thinking)
        assert ChatTemplate(builtin=K3).render(msgs, thinking) == render_k3(msgs, thinking)


def test_checkpoint_template_is_used(tmp_path):
    chatml = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
              "{% if not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": chatml, "eos_token": {"content": "<|im_end|>"}}))
    tpl = ChatTemplate.from_dir(tmp_path)
    msgs = parse_messages([{"role": "user", "content": "x"}])
    assert tpl.render(msgs) == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    assert tpl.render(msgs, thinking=False).endswith("<think>\n\n</think>\n\n")
    assert tpl.stop == ("<|im_end|>",)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}|{{ custom }}")
    assert ChatTemplate.from_dir(tmp_path).render(msgs, extra={"custom": 7}) == "x|7"
    assert ChatTemplate.from_dir(tmp_path / "missing", K3).source is None  # no files: K3


def test_chat_format_comes_from_the_family():
    """Every family declares its built-in chat format (None: its checkpoints bring a template);
    with neither a template nor a built-in format, chat requests are refused, not guessed."""
    for model_type in FAMILIES:
        config = {"model_type": model_type}
        fmt = family(config).chat_format(config)  # K3: its format; gpt-oss: harmony markers
        assert (fmt is None) == (model_type not in ("kimi_k3", "gpt_oss"))
        assert fmt is None or fmt.renders == (model_type == "kimi_k3")
    msgs = parse_messages([{"role": "user", "content": "x"}])
    with pytest.raises(ReapError, match="no chat template"):
        ChatTemplate().render(msgs)
    assert ChatTemplate().stop == () and ChatTemplate(builtin=K3).stop == (K3.end,)


@pytest.mark.parametrize("bad", [[], [{"role": "robot", "content": "x"}],
                                 [{"role": "user", "content": [{"type": "image_url"}]}],
                                 [{"role": "user", "content": 5}], "hello"])
def test_bad_messages_rejected(bad):
    with pytest.raises(ReapError):
        parse_messages(bad)


def test_encode_prompt_maps_special_tokens():
    specials = {"<|a|>": 1000, "<|ab|>": 1001}
    enc = FakeBackend().encode
    assert encode_prompt("x<|ab|>y<|a|><|a|>", enc, specials) == [120, 1001, 121, 1000, 1000]
    assert encode_prompt("<|a|", enc, specials) == list(b"<|a|")
    assert encode_prompt("x<|ab|>", enc, {}) == list(b"x<|ab|>")


def split_reasoning(text: str, thinking: bool) -> tuple[str, str]:
    s = ReasoningSplitter(thinking)
    parts = [s.feed(text), s.flush()]
    return "".join(p[0] for p in parts), "".join(p[1] for p in parts)


def test_reasoning_splitter_any_chunking():
    rng = random.Random(0)
    texts = ["abc</think>def", "no close at all <", "x</thi", "</think>", "a</think>b</think>c",
             "<</think>>"]
    for text in texts:
        want = (text.split("</think>", 1) + [""])[:2] if "</think>" in text else [text, ""]
        assert split_reasoning(text, True) == tuple(want)
        assert split_reasoning(text, False) == ("", text)
        for _ in range(30):
            cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, len(text))))
            pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
            s = ReasoningSplitter(True)
            outs = [s.feed(p) for p in pieces] + [s.flush()]
            assert ("".join(o[0] for o in outs), "".join(o[1] for o in outs)) == tuple(want)


# --------------------------------------------------------------------------- text stream

def test_text_stream_matches_naive_decode():
    """Concatenated deltas == the whole decode cut at the first stop string, for any bytes
    (invalid ones and a character cut at the end included)."""
    be = FakeBackend()
    rng = random.Random(1)
    for trial in range(300):
        text = "".join(rng.choice(ALPHABET + "XY") for _ in range(rng.randint(0, 30)))
        ids = list(text.encode())
        if ids and rng.random() < 0.3:
            ids.insert(rng.randrange(len(ids)), rng.choice([0x80, 0xBF, 0xE4, 0xFF]))
        ids = ids[: rng.randint(0, len(ids))]
        stop = tuple(rng.sample(["XY", "中🙂", "b c", "Y"], rng.randint(0, 2)))
        ts = TextStream(be.decode, stop)
        out = ""
        for t in ids:
            out += ts.feed(t)
            if ts.done:
                break
        out += ts.flush()
        whole = be.decode(ids)
        cut = min([whole.find(s) for s in stop if s in whole], default=len(whole))
        assert out == whole[:cut], (trial, ids, stop)
        assert ts.done == (cut < len(whole))


# --------------------------------------------------------------------------- HTTP

def test_models_completion_and_errors(served):
    s, client = served()
    assert [m.id for m in client.models.list().data] == ["fake-model"]
    r = client.completions.create(model="fake-model", prompt="hello there", max_tokens=8,
                                  temperature=0)
    assert r.choices[0].text == "echo:hell"[:8] and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (11, 8)
    r = client.completions.create(model="fake-model", prompt=[list(b"hi")], max_tokens=40,
                                  temperature=0, stop=[" STOP"])
    assert r.choices[0].text == "echo:hi" and r.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="fake-model", prompt="x", max_tokens=0)
    assert e.value.status_code == 400 and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="fake-model", prompt="x", temperature=3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    status, body = post(s.url + "/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = post(s.url + "/nowhere", {})
    assert status == 404 and "message" in body["error"]


def test_engine_refusal_and_expert_failure_are_errors(served):
    s, client = served()
    s.app.backend.fail = "refuse"
    with pytest.raises(openai.BadRequestError, match="exceeds the limit"):
        client.completions.create(model="fake-model", prompt="hello", max_tokens=4)
    s.app.backend.fail = "expert"
    with pytest.raises(openai.InternalServerError, match="layer 1 expert 3"):
        client.completions.create(model="fake-model", prompt="hello", max_tokens=4)
    with pytest.raises(openai.APIError, match="not trustworthy"):  # after streamed text
        list(client.completions.create(model="fake-model", prompt="hello", max_tokens=4,
                                       stream=True))
    s.app.backend.fail = None
    assert client.completions.create(model="fake-model", prompt="hello", max_tokens=4,
                                     temperature=0).choices[0].text == "echo"


def test_chat_thinking_and_streaming(served):
    s, client = served()
    be = s.app.backend
    msgs = [{"role": "user", "content": "What is 6*7?"}]
    r = client.chat.completions.create(model="fake-model", messages=msgs, temperature=0)
    want = encode_prompt(render_k3(parse_messages(msgs), thinking=True), be.encode, be.special)
    assert be.prompt_ids[-1] == want and 257 in want  # <|im_end|> as its special id
    m = r.choices[0].message
    assert m.content == "The answer is 42." and m.reasoning_content == "I ponder."
    assert r.choices[0].finish_reason == "stop"
    for extra in ({"thinking": False}, {"chat_template_kwargs": {"thinking": False}}):
        r = client.chat.completions.create(model="fake-model", messages=msgs, temperature=0,
                                           extra_body=extra)
        assert be.prompts[-1].endswith("<think></think>")
        assert r.choices[0].message.content == "Quick answer."
    chunks = list(client.chat.completions.create(
        model="fake-model", messages=msgs, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == "The answer is 42."
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "I ponder."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(
        b"I ponder.</think>The answer is 42.") + 1  # + the <|im_end|> token


def test_seed_determinism_and_streamed_text(served):
    _s, client = served()
    msgs = [{"role": "user", "content": "random please"}]

    def chat(seed, stream=False):
        r = client.chat.completions.create(model="fake-model", messages=msgs, seed=seed,
                                           temperature=1.0, max_tokens=24, stream=stream,
                                           extra_body={"thinking": False})
        if stream:
            return "".join(c.choices[0].delta.content or "" for c in r if c.choices)
        return r.choices[0].message.content

    a, b, c = chat(7), chat(7), chat(8)
    assert a == b and a != c
    assert chat(7, stream=True) == a  # multi-byte characters arrive whole when streamed
    sampled = list(FakeBackend().tokens([0], max_tokens=24, temperature=1, top_p=1, seed=7))
    # 24 tokens; a character cut by the limit decodes as U+FFFD, as in a whole decode
    assert a == bytes(sampled[:24]).decode("utf-8", "replace")


def test_stop_string_never_leaks_when_streamed(served):
    _s, client = served()
    r = client.completions.create(model="fake-model", prompt="abc", max_tokens=60,
                                  temperature=0, stop=["STOP"], stream=True)
    pieces = [c.choices[0].text for c in r]
    assert "".join(pieces) == "echo:abc " and not any("S" in p for p in pieces)


def test_two_concurrent_clients_queue_on_one_engine(served):
    be = FakeBackend(delay=0.002)
    s, client = served(be)
    prompts = ["first prompt", "second prompt"]
    solo = {p: client.completions.create(model="fake-model", prompt=p, max_tokens=50,
                                         temperature=0.8, seed=3).choices[0].text
            for p in prompts}
    results: dict[str, str] = {}

    def ask(p):
        stream = client.completions.create(model="fake-model", prompt=p, max_tokens=50,
                                           temperature=0.8, seed=3, stream=True)
        results[p] = "".join(c.choices[0].text for c in stream)

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == solo and not be.overlap
    assert s.app.worker.served == 4


def test_queue_full_gives_503(served):
    be = FakeBackend()
    be.gate.clear()  # the first job stays inside the backend until the 503 is seen
    s, _client = served(be, queue_size=1)
    body = {"prompt": "slow", "max_tokens": 40, "temperature": 0}
    threads = [threading.Thread(target=post, args=(s.url + "/completions", body))
               for _ in range(2)]
    try:
        threads[0].start()
        wait_until(lambda: be.inside == 1)  # the first job runs; the second fills the queue
        threads[1].start()
        wait_until(lambda: s.app.worker.jobs.qsize() == 1)
        status, err = post(s.url + "/completions", body)
        assert status == 503 and err["error"]["code"] == "queue_full"
    finally:
        be.gate.set()
        for t in threads:
            t.join(30)


def wait_until(cond, timeout: float = 60.0) -> None:
    """Poll cond() until it holds; fail (never hang) after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def test_loopback_only_unless_allowed():
    check_host("127.0.0.1", False)
    check_host("::1", False)
    for host in ("0.0.0.0", "::", "192.168.1.5", "example.com"):
        with pytest.raises(ReapError, match="--allow-remote"):
            check_host(host, False)
    check_host("0.0.0.0", True)


# --------------------------------------------------------------------------- abuse (issue 18)
# Raw HTTP to 127.0.0.1 only. Every refusal must be a JSON error in OpenAI's shape, never an HTML
# page, a hang or a TCP reset; waits are bounded and no test races a timer.

ERROR_FIELDS = {"message", "type", "param", "code"}


def exchange(s, request: bytes, head: bool = False, timeout: float = 20):
    """Send raw bytes to server `s`; (status, headers, JSON body or None) of its answer."""
    with socket.create_connection(s.httpd.server_address[:2], timeout=timeout) as sock:
        sock.sendall(request)
        resp = http.client.HTTPResponse(sock, method="HEAD" if head else "POST")
        resp.begin()
        data = resp.read()
        return resp.status, resp.headers, json.loads(data) if data else None


def raw_post(s, body: bytes, *headers: str, path: str = "/v1/completions",
             content_type: str | None = "application/json") -> bytes:
    """A POST request's bytes: Host and (unless None) Content-Type, then `headers` lines."""
    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{s.httpd.server_address[1]}",
             *([f"Content-Type: {content_type}"] if content_type else []), *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def assert_json_error(status, headers, body, want_status, code=None):
    assert status == want_status, body
    assert headers["Content-Type"] == "application/json" and set(body["error"]) == ERROR_FIELDS
    assert code is None or body["error"]["code"] == code


PROMPT = json.dumps({"prompt": "hi", "max_tokens": 3, "temperature": 0}).encode()


@pytest.mark.parametrize("length, status", [("-1", 400), ("+3", 400), ("0x10", 400),
                                            ("3, 4", 400), ("99999999999", 413), (None, 411)])
def test_bad_or_oversized_content_length_is_refused(served, length, status):
    """A negative length once read the socket to its end (20 MB -> 4 GB); now every bad length is
    a JSON error before any body byte is read, and the connection is closed."""
    s, _ = served()
    headers = [] if length is None else [f"Content-Length: {length}"]
    st, hdrs, body = exchange(s, raw_post(s, b'{"prompt": "x"}', *headers))
    assert_json_error(st, hdrs, body, status)
    assert hdrs["Connection"] == "close"
    assert exchange(s, raw_post(s, PROMPT, f"Content-Length: {len(PROMPT)}"))[0] == 200


def test_json_bombs_are_refused_as_json(served):
    """Bodies that make the JSON parser fail in unusual ways (nesting too deep, an integer of
    too many digits, bad UTF-8, not an object) are 400 answers, not handler crashes."""
    s, _ = served()
    for bomb in (b"[" * 100_000 + b"]" * 100_000, b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}",
                 b'{"prompt": "\xff"}', b'["prompt"]', b'{"prompt": "x"'):
        st, hdrs, body = exchange(s, raw_post(s, bomb, f"Content-Length: {len(bomb)}"))
        assert_json_error(st, hdrs, body, 400)
    assert s.httpd.errors == 0


def chunked(data: bytes, size: int) -> bytes:
    parts = [data[i:i + size] for i in range(0, len(data), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def test_chunked_body_read_and_bounded(served):
    s, _ = served(limits=Limits(max_body=1000))
    st, _, body = exchange(s, raw_post(s, chunked(PROMPT, 7), "Transfer-Encoding: chunked"))
    assert st == 200 and body["choices"][0]["text"] == "ech"
    big = json.dumps({"prompt": "x" * 3000}).encode()
    st, hdrs, body = exchange(s, raw_post(s, chunked(big, 600), "Transfer-Encoding: chunked"))
    assert_json_error(st, hdrs, body, 413, "body_too_large")
    for bad in (b"zz\r\n{}\r\n0\r\n\r\n", b"2\r\n{}XX0\r\n\r\n"):
        st, hdrs, body = exchange(s, raw_post(s, bad, "Transfer-Encoding: chunked"))
        assert_json_error(st, hdrs, body, 400)
    st, hdrs, body = exchange(s, raw_post(s, PROMPT, "Transfer-Encoding: chunked",
                                          f"Content-Length: {len(PROMPT)}"))
    assert_json_error(st, hdrs, body, 400)  # both framings: a smuggling attempt


def test_huge_prompt_refused_before_tokenizing(served):
    """A prompt far over what the context holds is refused on its length: the tokenizer never
    sees it (7.9 MB once cost 1.9 GB and 25 s of tokenizing before the 400)."""
    be = FakeBackend()
    be.context = 1024  # the limit: 32 characters per token of context
    encoded = []
    be.encode = lambda text: encoded.append(len(text)) or list(text.encode())
    s, _ = served(be, limits=Limits(max_body=8 << 20))  # the body limit lets the prompt in
    assert s.app.max_prompt_chars == 32 * 1024
    assert served(be)[0].httpd.limits.max_body == 1 << 20  # by default 8 bytes per character
    huge = "word " * 800_000  # 4 MB, within the 8 MB body limit
    for path, body in (("/completions", {"prompt": huge}),
                       ("/completions", {"prompt": [huge]}),
                       ("/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
                       ("/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 9
                                              + [{"role": "assistant", "content": "y",
                                                  "reasoning_content": huge}]})):
        status, err = post(s.url + path, body)
        assert status == 400 and err["error"]["code"] == "context_length_exceeded", err
    assert encoded == []
    status, err = post(s.url + "/completions", {"prompt": "x" * 32 * 1000, "max_tokens": 1})
    assert encoded == [32 * 1000]  # a prompt that may fit is tokenized, then counted in tokens
    assert status == 400 and "tokens leaves no room" in err["error"]["message"]
    s2, _ = served(FakeBackend(), limits=Limits(max_prompt_chars=10))
    status, err = post(s2.url + "/completions", {"prompt": "x" * 11})
    assert status == 400 and "--max-prompt-chars" in err["error"]["message"]


def test_slow_and_idle_clients_dropped_by_read_timeout(served):
    """A client trickling its request (slowloris) gets a 408 JSON and is closed; an idle one is
    closed; both free their handler slot. The timeout is tiny, the waits generous."""
    s, _ = served(limits=Limits(read_timeout=0.3))
    deadline = time.monotonic() + 60
    with socket.create_connection(s.httpd.server_address[:2], timeout=60) as slow:
        slow.sendall(raw_post(s, b"")[:-2] + b"X-Slow: ")  # headers never finished
        slow.settimeout(0.05)
        answer = b""
        while not answer and time.monotonic() < deadline:
            slow.sendall(b"a")  # well within any per-read timeout: only a deadline stops it
            try:
                answer = slow.recv(65536)
            except TimeoutError:
                pass
        slow.settimeout(60)
        while more := slow.recv(65536):
            answer += more
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"Connection: close" in head
    assert json.loads(body)["error"]["code"] == "request_timeout"
    with socket.create_connection(s.httpd.server_address[:2], timeout=60) as idle:
        assert idle.recv(65536) == b""  # closed without an answer: it asked nothing
    wait_until(lambda: s.httpd.active == 0)


def test_connection_cap_answers_503_json(served):
    s, _ = served(limits=Limits(max_connections=1, read_timeout=120))  # held past any stall
    held = socket.create_connection(s.httpd.server_address[:2], timeout=20)
    try:
        wait_until(lambda: s.httpd.active == 1)  # the one handler waits on the held socket
        st, hdrs, body = exchange(s, raw_post(s, PROMPT, f"Content-Length: {len(PROMPT)}"))
        assert_json_error(st, hdrs, body, 503, "too_many_connections")
        assert body["error"]["type"] == "server_error" and hdrs["Connection"] == "close"
    finally:
        held.close()
    wait_until(lambda: s.httpd.active == 0)
    assert exchange(s, raw_post(s, PROMPT, f"Content-Length: {len(PROMPT)}"))[0] == 200


def test_host_origin_and_content_type_checks(served):
    """DNS rebinding (a foreign Host), cross-site pages (a foreign Origin) and form posts (not
    JSON) are refused; the loopback names and --allowed-host names are served."""
    s, _ = served(allowed_hosts=("reap.internal",))
    port = s.httpd.server_address[1]

    def ask(method="GET", body=None, **headers):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        try:
            conn.request(method, "/v1/models" if body is None else "/v1/completions", body,
                         {k.replace("_", "-"): v for k, v in headers.items()})
            r = conn.getresponse()
            return r.status, r.headers, json.loads(r.read())
        finally:
            conn.close()

    for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", "reap.internal:80",
                 "REAP.internal."):
        assert ask(Host=host)[0] == 200
    for method, body in (("GET", None), ("POST", PROMPT)):
        hdrs = {"Content_Type": "application/json"}
        assert_json_error(*ask(method, body, Host=f"evil.example:{port}", **hdrs), 403,
                          "host_not_allowed")
        assert_json_error(*ask(method, body, Origin="http://evil.example", **hdrs), 403,
                          "origin_not_allowed")
        assert_json_error(*ask(method, body, Origin="null", **hdrs), 403, "origin_not_allowed")
        assert ask(method, body, Origin=f"http://localhost:{port}", **hdrs)[0] == 200
    st, hdrs, body = exchange(s, b"GET /v1/models HTTP/1.0\r\n\r\n")
    assert_json_error(st, hdrs, body, 400)  # no Host at all
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        extra = {} if ctype is None else {"Content_Type": ctype}
        assert_json_error(*ask("POST", PROMPT, **extra), 415, "unsupported_media_type")
    assert ask("POST", PROMPT, Content_Type="Application/JSON; charset=utf-8")[0] == 200


@pytest.mark.parametrize("method", ["PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "HEAD", "BREW"])
def test_every_method_gets_a_json_error(served, method):
    s, _ = served()
    req = (f"{method} /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n"
           "\r\n").encode()
    st, hdrs, body = exchange(s, req, head=method == "HEAD")
    assert hdrs["Content-Type"] == "application/json" and st == (501 if method == "BREW" else 405)
    if method == "HEAD":
        assert body is None  # a HEAD answer has no body, only the JSON error's headers
    else:
        assert_json_error(st, hdrs, body, st)
        assert st == 501 or hdrs["Allow"] == "GET, POST"


def test_malformed_requests_get_json_errors(served):
    s, _ = served(limits=Limits(read_timeout=0.3))
    for req, status in ((b"GARBAGE\r\n\r\n", 400), (b"\n\x01junk\r\n", 400),
                        (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n", 414),
                        (b"GET / HTTP/9.9\r\nHost: x\r\n\r\n", 505),
                        (b"GET /v1/mod", 408)):  # a request line never finished
        assert_json_error(*exchange(s, req), status)
    assert s.httpd.errors == 0


def test_32_clients_3_requests_no_resets(served):
    """32 clients x 3 requests at once on a server capped at 8 connections: every answer is a
    200 or a 503 JSON error; no connection is reset or refused (the backlog queues them)."""
    s, _ = served(FakeBackend(delay=0.001), limits=Limits(max_connections=8))
    port, start = s.httpd.server_address[1], threading.Barrier(32)
    answers, failures = [], []

    def client():
        try:
            start.wait(60)
            for _ in range(3):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                conn.request("POST", "/v1/completions", PROMPT,
                             {"Content-Type": "application/json"})
                r = conn.getresponse()
                answers.append((r.status, json.loads(r.read())))
                conn.close()
        except Exception as e:  # noqa: BLE001 - a reset or refusal is the failure counted
            failures.append(repr(e))

    threads = [threading.Thread(target=client) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert failures == [] and len(answers) == 96
    assert {st for st, _ in answers} <= {200, 503} and any(st == 200 for st, _ in answers)
    for st, body in answers:
        if st == 503:
            assert body["error"]["code"] in ("too_many_connections", "queue_full")
    assert s.httpd.errors == 0


def _wait_for(condition, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the condition did not hold within the bound"
        time.sleep(0.01)


def _stop_within(server, seconds: float) -> bool:
    t = threading.Thread(target=server.stop, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


def test_stop_with_a_full_queue_answers_the_queued_request_and_returns(served):
    """A stop while a job holds the engine and the queue is full: the queued request is
    answered 503 and the stop returns (it used to wait on the full queue until the engine let
    go)."""
    backend = FakeBackend()
    backend.gate.clear()  # the first request holds the engine
    s, _client = served(backend, queue_size=1)
    answers = []

    def ask():
        answers.append(post(s.url + "/completions", {"prompt": "hi", "max_tokens": 4}, 60))

    held, queued = (threading.Thread(target=ask, daemon=True) for _ in range(2))
    held.start()
    _wait_for(lambda: backend.inside == 1)
    queued.start()
    _wait_for(lambda: s.app.worker.jobs.full())
    try:
        assert _stop_within(s, 30)
        queued.join(30)
        assert [a[0] for a in answers] == [503]
        assert "shutting down" in answers[0][1]["error"]["message"]
    finally:
        backend.gate.set()


def test_stop_cancels_a_long_generation(served):
    """A stop during a long generation cancels it between tokens and closes the backend; it
    used to wait for the engine for 30 s."""
    backend = FakeBackend(delay=0.05)  # 1,000 tokens: 50 s
    s, client = served(backend)
    got = []
    ask = threading.Thread(target=lambda: got.append(client.completions.create(
        model="fake-model", prompt="hi", max_tokens=1000, temperature=0.9, seed=1)), daemon=True)
    ask.start()
    _wait_for(lambda: backend.inside == 1)
    assert _stop_within(s, 20)
    assert backend.closed == 1 and backend.inside == 0


# --------------------------------------------------------------------------- real engine

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from reap.synth import synth

    return synth("k3-tiny", tmp_path_factory.mktemp("model") / "k3-tiny", seed=0,
                 dtype="float32")


def test_real_engine_end_to_end(tiny, served):
    """k3-tiny behind the server: every answer equals the engine's own generate()."""
    from reap.serve.backend import open_backend

    backend = open_backend(tiny, "k3-tiny", context=192)
    eng = backend.engine
    ids = encode_prompt("The cat", backend.encode, backend.special)
    msgs = [{"role": "user", "content": "Hi"}]
    k3 = family(K3_CONFIG).chat_format(K3_CONFIG)  # what the server renders for a K3 model
    chat_ids = encode_prompt(render_markers(k3, parse_messages(msgs)), backend.encode,
                             backend.special)
    greedy = eng.generate([ids], max_tokens=6, temperature=0)[0]
    sampled = eng.generate([ids], max_tokens=6, temperature=0.9, seed=11)[0]
    chat_ref = eng.generate([chat_ids], max_tokens=5, temperature=0)[0]
    other = eng.generate([list(b"xyz")], max_tokens=6, temperature=0.9, seed=2)[0]
    _s, client = served(backend)  # from here on only the server's worker uses the engine

    def complete(prompt, **kw):
        r = client.completions.create(model="k3-tiny", prompt=prompt, max_tokens=6, **kw)
        return r.choices[0].text, r.usage.completion_tokens

    assert complete("The cat", temperature=0) == (greedy.text, len(greedy.ids))
    assert complete("The cat", temperature=0.9, seed=11) == (sampled.text, len(sampled.ids))
    assert complete("The cat", temperature=0.9, seed=11)[0] == sampled.text
    chunks = client.chat.completions.create(model="k3-tiny", messages=msgs, max_tokens=5,
                                            temperature=0, stream=True)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = "".join((getattr(d, "reasoning_content", None) or "") + (d.content or "")
                       for d in deltas)
    assert streamed == chat_ref.text  # the reply opens in the thinking channel: </think> split
    results = {}

    def ask(key, prompt, seed):
        results[key] = complete(prompt, temperature=0.9, seed=seed)[0]

    threads = [threading.Thread(target=ask, args=("a", "The cat", 11)),
               threading.Thread(target=ask, args=("b", [list(b"xyz")], 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {"a": sampled.text, "b": other.text}


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_cli_serves_until_interrupted_and_refuses_public_bind(tiny, sig):
    """Ctrl-C and SIGTERM both stop the server with the documented exit code (SIGTERM used to
    kill it, exit -15, with no stop)."""
    import os
    import signal
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "reap.cli", "serve", str(tiny), "--context", "64",
           "--threads", "1"]
    r = subprocess.run(cmd + ["--host", "0.0.0.0"], check=False, capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 2 and "--allow-remote" in r.stderr and "Traceback" not in r.stderr
    p = subprocess.Popen(cmd + ["--port", "0", "--served-name", "tiny"], stderr=subprocess.PIPE,
                         text=True, env=env)
    watchdog = threading.Timer(120, p.kill)
    watchdog.start()
    try:
        line = ""
        while not line.startswith("reap serve:"):
            line = p.stderr.readline()
            assert line, "server exited before listening"
        url = line.split(" at ")[1].split()[0]
        with urllib.request.urlopen(url + "/models", timeout=30) as resp:
            assert json.loads(resp.read())["data"][0]["id"] == "tiny"
        status, body = post(url + "/completions", {"prompt": "hi", "max_tokens": 2,
                                                   "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] >= 1
        p.send_signal(getattr(signal, sig))
        assert p.wait(60) == 5  # the documented exit code for an interrupt
    finally:
        watchdog.cancel()
        p.kill()
        p.stderr.close()
