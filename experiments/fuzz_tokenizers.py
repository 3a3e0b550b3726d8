"""Corrupted Kimi tokenizers and hostile chat templates against `reap run`, `calibrate` and
`serve` -> reports/reliability-tokenizers.json.

    OMP_NUM_THREADS=1 nice -n 10 python -m experiments.fuzz_tokenizers
    python -m experiments.fuzz_tokenizers --only template/ --keep /tmp/work   # some cases

The base is a tiny K3 (`reap synth` of k3-tiny's config with room for the tokenizer) saved as the
Kimi releases ship their tokenizer: `tiktoken.model` (the 256 bytes and 64 merges),
a K3-style `tokenizer_config.json` (the release's special-token names), no `tokenizer.json`, and
the K3 release's `chat_template.jinja`. Each case breaks one tokenizer file or replaces the
template, then:

- `run` and `calibrate` go through the batch driver of fuzz_common (hard timeout, 4 GB address
  space cap) and are classified as there (clean / internal / hang / memory / silent);
- `serve`: `reap serve --port 0` in a process of its own. It must refuse to start (a documented
  exit with one `reap: error:` line) or answer a chat request in OpenAI's JSON shape, and
  `/health` must answer while that request is being handled. After the answer the server's
  processes must be idle (CPU over 1 s) and hold under 1 GiB; SIGINT stops it. A dropped
  connection, a 5xx or a traceback is internal, no answer (or CPU still burning) a hang, a
  200 for a broken input silent.

Tokenizer cases are invalid by construction (exit 0 / 200 is silent) except the few marked valid;
template cases are served only (`run` and `calibrate` take raw text and read no template).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from experiments.fuzz_common import (
    REPO,
    Result,
    Run,
    child_env,
    classify,
    count_table,
    python_m,
    run_batch,
    write_table,
)

RELEASE_TEMPLATE = REPO / "tests" / "fixtures" / "releases" / "kimi-k3" / "chat_template.jinja"
# K3's special-token names by offset from the base vocabulary
K3_NAMES = {0: ("[BOS]", True), 1: ("[EOS]", True), 2: ("<|end_of_msg|>", True),
            3: ("<|open|>", False), 4: ("<|close|>", False), 5: ("<|sep|>", False),
            21: ("<|media_pad|>", True), 254: ("[UNK]", True), 255: ("[PAD]", True)}
MERGES = [b"th", b"he", b"in", b"er", b"an", b"re", b"on", b"at", b"en", b"nd", b"ti", b"es",
          b"or", b"te", b"of", b"ed", b"is", b"it", b"al", b"ar", b"st", b"to", b"nt", b"ng",
          b"se", b"ha", b"as", b"ou", b"io", b"le", b"ve", b"co", b"me", b"de", b"hi", b"ri",
          b"ro", b"ic", b"ne", b"ea", b"ra", b"ce", b"li", b"ch", b"ll", b"be", b"ma", b"si",
          b"om", b"ur", b" t", b" a", b" s", b" o", b" w", b" c", b" b", b" p", b" i", b" f",
          b" the", b"ing", b"ion", b" and"]
SERVE_MEM = 1 << 30  # the server's RSS (all its processes) after a request must stay below
PROMPT = "Hi <|open|> 中文 ü"  # bytes past 0x7f, a spelled marker


@dataclass
class Case:
    """One broken (or, with `valid`, unusual but valid) input and the commands that read it."""

    name: str  # "category/what"
    mutate: Callable[[Path], None]  # edits the model directory in place
    commands: tuple = ("run", "calibrate", "serve")
    valid: bool = False

    @property
    def category(self) -> str:
        return self.name.split("/")[0]


# --- the base model ----------------------------------------------------------------------------

def ranks() -> dict[bytes, int]:
    table = {bytes([b]): b for b in range(256)}
    for m in MERGES:
        table[m] = len(table)
    return table


def write_ranks(d: Path, table: dict[bytes, int]) -> None:
    lines = [base64.b64encode(t) + b" " + str(r).encode()
             for t, r in sorted(table.items(), key=lambda kv: kv[1])]
    (d / "tiktoken.model").write_bytes(b"\n".join(lines) + b"\n")


def tokenizer_config(base: int) -> dict:
    added = {str(base + k): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                             "single_word": False, "special": s} for k, (t, s) in K3_NAMES.items()}
    return {"added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "<|end_of_msg|>",
            "pad_token": "[PAD]", "unk_token": "[UNK]", "tokenizer_class": "TikTokenTokenizer"}


def build_base(root: Path, log=None) -> Path:
    """The tiny K3 with a Kimi tokenizer and the release's template (through the public CLI)."""
    tiny, model = root / "k3-tiny", root / "model"
    setup = run_batch([Run("setup/tiny", ["synth", "k3-tiny", "--out", str(tiny)], "accept")],
                      timeout=300, log=log)
    config = json.loads((tiny / "config.json").read_text())
    config["text_config"]["vocab_size"] = len(ranks()) + 258
    (root / "config.json").write_text(json.dumps(config))
    setup.update(run_batch([Run("setup/model", ["synth", str(root / "config.json"), "--out",
                                                str(model)], "accept")], timeout=300, log=log))
    failed = {k: r.stderr[-500:] for k, r in setup.items() if r.rc != 0}
    if failed:
        raise RuntimeError(f"setup failed: {failed}")
    (model / "tokenizer.json").unlink()
    write_ranks(model, ranks())
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(len(ranks())),
                                                            indent=2))
    shutil.copy(RELEASE_TEMPLATE, model / "chat_template.jinja")
    return model


# --- cases ---------------------------------------------------------------------------------------

def _drop_bytes(*dropped: int) -> Callable[[Path], None]:
    def fn(d):
        table = [t for t in sorted(ranks(), key=ranks().get)
                 if not (len(t) == 1 and t[0] in dropped)]
        write_ranks(d, {t: i for i, t in enumerate(table)})
        _fit_config(d, len(table))
    return fn


def _more_ranks(tokens: list[bytes]) -> Callable[[Path], None]:
    def fn(d):
        table = ranks()
        for t in tokens:
            table.setdefault(t, len(table))
        write_ranks(d, table)
        _fit_config(d, len(table))
    return fn


def _fit_config(d: Path, base: int) -> None:
    (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(base)))


def _ranks_text(text: bytes) -> Callable[[Path], None]:
    return lambda d: (d / "tiktoken.model").write_bytes(text)


def _edit_ranks(fn: Callable[[list[bytes]], list[bytes]]) -> Callable[[Path], None]:
    def apply(d):
        lines = (d / "tiktoken.model").read_bytes().splitlines()
        (d / "tiktoken.model").write_bytes(b"\n".join(fn(lines)) + b"\n")
    return apply


def _line(token: bytes, rank) -> bytes:
    return base64.b64encode(token) + b" " + str(rank).encode()


def _config(fn: Callable[[dict], object]) -> Callable[[Path], None]:
    def apply(d):
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        fn(cfg)
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return apply


def _added(fn: Callable[[dict], object]) -> Callable[[Path], None]:
    return _config(lambda cfg: fn(cfg["added_tokens_decoder"]))


def _rekey(old_offset: int, new_key: str) -> Callable[[dict], None]:
    def fn(added):
        key = str(len(ranks()) + old_offset)
        added[new_key] = added.pop(key)
    return fn


def _set_entry(offset: int, **fields) -> Callable[[dict], None]:
    return lambda added: added[str(len(ranks()) + offset)].update(fields)


def _write(name: str, data: bytes | str) -> Callable[[Path], None]:
    def fn(d):
        p = d / name
        p.unlink(missing_ok=True)
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return fn


def _replace_with_dir(name: str) -> Callable[[Path], None]:
    def fn(d):
        (d / name).unlink()
        (d / name).mkdir()
    return fn


def _template(src: str) -> Callable[[Path], None]:
    return _write("chat_template.jinja", src)


def _config_template(value) -> Callable[[Path], None]:
    def fn(d):
        (d / "chat_template.jinja").unlink()
        _config(lambda cfg: cfg.update(chat_template=value))(d)
    return fn


def tokenizer_cases() -> list[Case]:
    n = len(ranks())
    return [
        Case("control/unchanged", lambda d: None, valid=True),
        Case("ranks/missing_byte_0x41", _drop_bytes(0x41)),
        Case("ranks/missing_byte_0xe4", _drop_bytes(0xE4)),  # in every CJK character
        Case("ranks/missing_bytes_above_0x7f", _drop_bytes(*range(0x80, 0x100))),
        Case("ranks/missing_byte_0x00", _drop_bytes(0x00)),
        Case("ranks/gap", _edit_ranks(lambda ls: ls[:100] + ls[101:])),
        Case("ranks/duplicate_rank", _edit_ranks(lambda ls: ls + [_line(b"zz", 5)])),
        Case("ranks/duplicate_token", _edit_ranks(lambda ls: ls + [_line(b"th", n)])),
        Case("ranks/negative_rank", _edit_ranks(lambda ls: ls + [_line(b"zz", -1)])),
        Case("ranks/rank_1e30", _edit_ranks(lambda ls: ls + [_line(b"zz", 10**30)])),
        Case("ranks/rank_5000_digits", _edit_ranks(lambda ls: ls + [_line(b"zz", "9" * 5000)])),
        Case("ranks/rank_superscript", _edit_ranks(lambda ls: ls + [_line(b"zz", "²")])),
        Case("ranks/rank_float", _edit_ranks(lambda ls: ls + [_line(b"zz", "320.0")])),
        Case("ranks/not_base64", _edit_ranks(lambda ls: ls + [b"!!!! 320"])),
        Case("ranks/three_columns", _edit_ranks(lambda ls: ls + [_line(b"zz", n) + b" 7"])),
        Case("ranks/empty_file", _ranks_text(b"")),
        Case("ranks/blank_lines_only", _ranks_text(b"\n\n  \n")),
        Case("ranks/binary_garbage", _ranks_text(bytes(range(256)) * 64)),
        Case("ranks/truncated_mid_line", lambda d: (d / "tiktoken.model").write_bytes(
            (d / "tiktoken.model").read_bytes()[:-7])),
        Case("ranks/crlf_lines", _edit_ranks(lambda ls: [ln + b"\r" for ln in ls]), valid=True),
        Case("ranks/huge_token", _more_ranks([b"q" * 300_000]), valid=True),
        # valid: K2's tokenizer has 2 ids past its model's vocabulary; the engine refuses those
        Case("ranks/more_ids_than_the_model", _more_ranks([bytes([a, b]) for a in b"xyz"
                                                           for b in range(256)]), valid=True),
        Case("ranks/is_directory", _replace_with_dir("tiktoken.model")),
        Case("ranks/dev_zero_symlink", lambda d: ((d / "tiktoken.model").unlink(),
                                                  (d / "tiktoken.model").symlink_to("/dev/zero"))),
        Case("config/key_superscript_digit", _added(_rekey(3, "²"))),
        Case("config/key_fullwidth_digit", _added(_rekey(3, "５"))),
        Case("config/key_5000_digits", _added(_rekey(3, "9" * 5000))),
        Case("config/key_negative", _added(_rekey(3, "-1"))),
        Case("config/key_spaced", _added(_rekey(3, f" {n + 3}"))),
        Case("config/key_outside_specials", _added(_rekey(3, str(n + 300)))),
        Case("config/key_inside_ranks", _added(_rekey(3, "7"))),
        Case("config/content_missing", _added(lambda a: a[str(n + 3)].pop("content"))),
        Case("config/content_empty", _added(_set_entry(3, content=""))),
        Case("config/content_int", _added(_set_entry(3, content=7))),
        Case("config/content_surrogate", _added(_set_entry(3, content="\ud800"))),
        Case("config/content_1M_chars", _added(_set_entry(3, content="<" + "x" * 1_000_000))),
        Case("config/content_duplicate", _added(_set_entry(4, content="<|open|>"))),
        Case("config/content_reserved_name", _added(
            _set_entry(3, content=f"<|reserved_token_{n + 6}|>"))),
        Case("config/special_flag_string", _added(_set_entry(3, special="no")), valid=True),
        Case("config/added_is_list", _config(lambda c: c.update(added_tokens_decoder=[]))),
        Case("config/entry_is_list", _added(lambda a: a.update({str(n + 3): []}))),
        Case("config/eos_token_dict_int", _config(lambda c: c.update(eos_token={"content": 5})),
             valid=True),
        Case("config/eos_token_id_1e30", _config(lambda c: (c.pop("eos_token"),
                                                            c.update(eos_token_id=10**30)))),
        Case("config/eos_token_id_negative", _config(lambda c: (c.pop("eos_token"),
                                                                c.update(eos_token_id=-5)))),
        Case("config/not_json", _write("tokenizer_config.json", "{not json")),
        Case("config/array", _write("tokenizer_config.json", "[]")),
        Case("config/deeply_nested", _write("tokenizer_config.json", "[" * 100_000)),
        Case("config/not_utf8", _write("tokenizer_config.json", b'{"a": "\xff\xfe"}')),
        Case("config/missing", lambda d: (d / "tokenizer_config.json").unlink()),
    ]


NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}BODY{% endfor %}{% endfor %}"


def template_cases() -> list[Case]:
    serve = ("serve",)
    templates = {
        "nested_loop_output": NESTED.replace("BODY", "x"),
        "nested_loop_silent": NESTED.replace("BODY", ""),
        "nested_loop_set": "{% set r = range(100000) %}{% for i in r %}{% for j in r %}"
                           "{% endfor %}{% endfor %}",
        "string_times_1e9": "{{ 'a' * 10**9 }}",
        "string_times_1e8": "{{ 'a' * 10**8 }}",
        "list_times_1e9": "{{ ([0] * 10**9)|length }}",
        "pow_1e10_digits": "{{ 10 ** (10 ** 10) }}",
        "ljust_1e9": "{{ 'a'.ljust(10**9) }}",
        "center_filter_1e9": "{{ 'a'|center(10**9) }}",
        "percent_width_1e9": "{{ '%1000000000d' % 1 }}",
        "format_width_1e9": "{{ '{:>1000000000}'.format(1) }}",
        "replace_amplified": "{% set s = 'a' * 40000 %}{{ s.replace('', s) }}",
        "exponential_macro": "{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}"
                             "{% endmacro %}{{ f(60) }}",
        "doubling_namespace": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
                              "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
        "recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
        "syntax_error": "{% for m in messages %}{{ m.content }",
        "undefined_attribute": "{{ messages[0].nothing.deeper }}",
        "raise_exception": "{{ raise_exception('refused\\nover two lines') }}",
        "sandbox_escape": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "huge_output_one_chunk": "{{ 'x' * 5000000 }}",
    }
    cases = [Case(f"template/{k}", _template(v), serve) for k, v in templates.items()]
    cases += [
        Case("template/not_utf8", _write("chat_template.jinja", b"{{ '\xff' }}"), serve),
        Case("template/is_directory", _replace_with_dir("chat_template.jinja"), serve,
             valid=True),  # not a file: the tokenizer config's template (none) is used
        Case("template/over_16MB", _template("x" * (17 << 20)), serve),
        Case("template/config_number", _config_template(7), serve),
        Case("template/config_list_no_default", _config_template([{"name": "x"}]), serve),
        Case("template/config_string", _config_template("{{ messages[0].content }}"), serve,
             valid=True),
    ]
    return cases


def all_cases() -> list[Case]:
    return tokenizer_cases() + template_cases()


# --- commands ------------------------------------------------------------------------------------

def cli_runs(case: Case, model: Path, out: Path) -> list[Run]:
    argv = {"run": ["run", str(model), "--prompt", PROMPT, "--max-tokens", "2", "--context",
                    "64", "--threads", "1", "--quiet"],
            "calibrate": ["calibrate", str(model), "--corpus", "zh", "--tokens", "32",
                          "--seq-len", "16", "--no-progress", "--out", str(out)]}
    return [Run(f"{case.name}/{c}", argv[c], "any" if case.valid else "reject", case.category,
                c) for c in case.commands if c in argv]


def serve_probe(case: Case, model: Path, timeout: float) -> tuple[str, dict]:
    """Start `reap serve` on `model`, send one chat request with /health meanwhile; the verdict
    and what was seen."""
    import psutil

    log = model.parent / "serve.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(python_m("reap.cli", ["serve", str(model), "--port", "0",
                                                      "--context", "1024", "--threads", "1"]),
                                cwd=REPO, env=child_env(), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    seen: dict = {}
    try:
        url = _wait_url(proc, log, timeout)
        if url is None:
            return _refused(case, proc, log, seen)
        seen["started"] = True
        answer: dict = {}
        thread = threading.Thread(target=_chat, args=(url, answer, timeout), daemon=True)
        start = time.monotonic()
        thread.start()
        thread.join(0.5)
        seen["health"] = _health(url.removesuffix("/v1")) if thread.is_alive() else "after"
        thread.join(timeout)
        seen.update(answer, seconds=round(time.monotonic() - start, 2))
        server = psutil.Process(proc.pid)
        tree = [server, *server.children(recursive=True)]
        seen["rss_mb"] = round(sum(_rss(p) for p in tree) / 2**20)
        cpu = sum(_cpu(p) for p in tree)
        time.sleep(1.0)
        seen["cpu_after_s"] = round(sum(_cpu(p) for p in tree) - cpu, 2)
        seen["sigint_exit_s"] = _stop(proc)
        seen["traceback"] = "Traceback" in log.read_text(errors="replace")
        return _serve_verdict(case, seen, answer, thread.is_alive()), seen
    finally:
        _kill(proc)


def _wait_url(proc, log: Path, timeout: float) -> str | None:
    deadline = time.monotonic() + timeout + 60  # torch import and the model's open
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("reap serve:") and " at http" in line:
                return line.split(" at ", 1)[1].split()[0]
        if proc.poll() is not None:
            return None
        time.sleep(0.1)
    return None


def _refused(case: Case, proc, log: Path, seen: dict) -> tuple[str, dict]:
    """The verdict on a server that did not start (or never said where it listens)."""
    if proc.poll() is None:
        seen["note"] = "no address printed"
        return "hang", seen
    r = Result(case.name + "/serve", proc.returncode, "", log.read_text(errors="replace"))
    seen.update(rc=proc.returncode, line=r.line())
    if case.valid and r.rc != 0:
        seen["note"] = "a valid input refused"
    return classify(Run(r.key, [], "any" if case.valid else "reject"), r), seen


def _chat(url: str, answer: dict, timeout: float) -> None:
    body = json.dumps({"model": "model", "max_tokens": 2, "temperature": 0,
                       "messages": [{"role": "user", "content": PROMPT}]}).encode()
    req = urllib.request.Request(url + "/chat/completions", body,
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            answer.update(status=r.status, body=r.read().decode(errors="replace")[:400])
    except urllib.error.HTTPError as e:
        answer.update(status=e.code, body=e.read().decode(errors="replace")[:400])
    except TimeoutError:
        answer.update(status=None, body="(no answer)")
    except OSError as e:  # closed without an answer, reset
        answer.update(status=None, body=f"dropped: {type(e).__name__}: {e}")


def _health(base: str) -> str:
    try:
        with urllib.request.urlopen(base + "/health", timeout=10) as r:
            return f"{r.status} while rendering"
    except OSError as e:
        return f"no answer ({type(e).__name__})"


def _serve_verdict(case: Case, seen: dict, answer: dict, alive: bool) -> str:
    if alive or answer.get("status") is None and "dropped" not in answer.get("body", ""):
        return "hang"
    if seen["health"].startswith("no answer") or seen["cpu_after_s"] > 0.5:
        return "hang"
    if seen["rss_mb"] << 20 > SERVE_MEM:
        return "memory"
    status = answer.get("status")
    if status is None or seen["traceback"] or (status >= 500 and status != 503):
        return "internal"
    try:
        error = json.loads(answer["body"]).get("error")
    except ValueError:
        return "internal"
    if status >= 400 and (not isinstance(error, dict) or "\n" in error.get("message", "")):
        return "internal"
    if status < 300:
        return "clean" if case.valid else "silent"
    return "clean"


def _rss(p) -> int:
    try:
        return p.memory_info().rss
    except Exception:  # noqa: BLE001 - gone meanwhile
        return 0


def _cpu(p) -> float:
    try:
        t = p.cpu_times()
        return t.user + t.system
    except Exception:  # noqa: BLE001
        return 0.0


def _stop(proc) -> float | None:
    start = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(30)
        return round(time.monotonic() - start, 2)
    except subprocess.TimeoutExpired:
        return None


def _kill(proc) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


# --- the harness ----------------------------------------------------------------------------------

def execute(cases: list[Case], work: Path, timeout: float = 60.0, commands=("run", "calibrate",
            "serve"), log=None, progress=None) -> list[dict]:
    """Build the base, then each case's model directory; run the commands; one record a run."""
    base = build_base(work / "base", log)
    dirs = {}
    for case in cases:
        d = work / "cases" / case.name.replace("/", "__") / "model"
        shutil.copytree(base, d)
        case.mutate(d)
        dirs[case.name] = d
    records: list[dict] = []

    def record(case: Case, command: str, verdict: str, seen: dict) -> None:
        rec = {"key": f"{case.name}/{command}", "case": case.name, "category": case.category,
               "command": command, "expect": "any" if case.valid else "reject",
               "verdict": verdict, **seen}
        rec = json.loads(json.dumps(rec).replace(str(work), "$WORK"))
        records.append(rec)
        if progress:
            progress(rec)

    by_key = {c.name: c for c in cases}
    runs = [r for c in cases for r in cli_runs(c, dirs[c.name], dirs[c.name].parent / "out")
            if r.command in commands]

    def on_result(run: Run, r: Result) -> None:
        record(by_key[run.key.rsplit("/", 1)[0]], run.command, classify(run, r),
               {"rc": r.rc, "line": r.line(), "seconds": round(r.seconds, 2)})

    run_batch(runs, timeout, log=log, on_result=on_result)
    for case in cases:
        if "serve" in case.commands and "serve" in commands:
            verdict, seen = serve_probe(case, dirs[case.name], timeout)
            record(case, "serve", verdict, seen)
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", help="case name prefix (repeatable)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per run or request")
    ap.add_argument("--out", default=str(REPO / "reports" / "reliability-tokenizers.json"))
    ap.add_argument("--keep", help="build the inputs here and keep them")
    args = ap.parse_args(argv)
    cases = [c for c in all_cases() if not args.only or any(c.name.startswith(p)
                                                               for p in args.only)]
    work = Path(args.keep or tempfile.mkdtemp(prefix="reap-fuzz-tok-"))
    start = time.time()

    def progress(rec):
        what = rec.get("line") or f"{rec.get('status')} {rec.get('body', '')[:100]}"
        print(f"{rec['verdict']:8} {rec['key']}: {what[:150]}", flush=True)

    try:
        records = execute(cases, work, args.timeout, log=sys.stderr, progress=progress)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print()
    write_table(count_table(records, "command"))
    print()
    write_table(count_table(records, "category"))
    if not args.only:
        report = {"cases": len(cases), "runs": len(records),
                  "seconds": round(time.time() - start, 1), "timeout_s": args.timeout,
                  "command": "OMP_NUM_THREADS=1 python -m experiments.fuzz_tokenizers",
                  "by_command": count_table(records, "command"),
                  "by_category": count_table(records, "category"), "results": records}
        Path(args.out).write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
