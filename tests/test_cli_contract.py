"""The exit-code contract of the README on bad input: every case here once ended in "internal
error" (exit 1), ran on with a silently truncated value (exit 0), or named the wrong cause.
Bad input is exit 2 with one line naming the flag or the file and field; an output that cannot be
written is exit 3. In-process through `reap.cli.main` on one k3-tiny checkpoint per session."""

import json
import os
import struct

import pytest
import torch

from reap.cli import main
from reap.stats import ExpertStats

BIG = str(2**70)


@pytest.fixture(scope="session")
def env(tmp_path_factory):
    """A float32 k3-tiny checkpoint, a small jsonl corpus, a statistics file and a plain file."""
    from reap.synth import synth

    root = tmp_path_factory.mktemp("contract")
    model = synth("k3-tiny", root / "model", seed=3, dtype="float32")
    corpus = root / "zh.jsonl"
    with open(corpus, "w") as f:
        for i in range(12):
            f.write(json.dumps({"id": f"d{i}", "text": "abc def " * 40 + str(i)}) + "\n")
    stats = _stats(root / "stats" / "en.safetensors", corpus="en", model_path="/m/a")
    (root / "afile").write_text("not a directory\n")
    return {"root": root, "model": str(model), "corpus": str(corpus), "stats": stats,
            "file": str(root / "afile")}


def _stats(path, corpus="en", model_path="/m/a", fingerprint="f" * 64, layers=(1, 2, 3, 4)):
    """A small valid statistics file: 8 experts, top-2, every expert routed."""
    s = ExpertStats.zeros(list(layers), 8, 2, meta={
        "model": fingerprint, "corpus": corpus, "arguments": {"model": model_path}})
    s.count += torch.arange(1, 9)
    s.reap_sum += torch.arange(1, 9).double()
    s.tokens = int(s.count[0].sum()) // 2
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return s.save(path)


def _reap(capsys, *argv) -> tuple[int, str]:
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's own usage errors (exit 2, usage line above)
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert "internal error" not in err, err
    return rc, err


def _one_line(err: str, *words) -> None:
    last = err.splitlines()[-1]
    assert last.startswith("reap: error:") or "error:" in last, err
    for w in words:
        assert w in last, err


def _calibrate(env, out, *extra):
    return ("calibrate", env["model"], "--corpus", env["corpus"], "--tokens", "32",
            "--seq-len", "16", "--no-progress", "--out", out, *extra)


def _run(env, *extra):
    return ("run", env["model"], "--prompt-ids", "1,2", "--max-tokens", "1", "--quiet", *extra)


# -- integers: seeds and 64-bit overflow ----------------------------------------------------------
@pytest.mark.parametrize("seed", [BIG, "-1"])
@pytest.mark.parametrize("command", ["run", "calibrate", "plan"])
def test_seed_outside_32_bits_is_exit_2(env, capsys, tmp_path, command, seed):
    argv = {"run": _run(env, "--seed", seed),
            "calibrate": _calibrate(env, tmp_path / "cal", "--seed", seed),
            "plan": ("plan", env["stats"], "--keep", "4", "--criterion", "random",
                     "--out", tmp_path / "plan.json", "--seed", seed)}[command]
    rc, err = _reap(capsys, *argv)
    assert rc == 2, err
    _one_line(err, "--seed", seed)


@pytest.mark.parametrize("extra", [("--threads", BIG), ("--threads", str(2**40))])
def test_run_threads_out_of_range_is_exit_2(env, capsys, extra):
    rc, err = _reap(capsys, *_run(env, *extra))
    assert rc == 2, err
    _one_line(err, "--threads")


@pytest.mark.parametrize("extra", [("--batch", "0"), ("--batch", "-1"),
                                   ("--shard", f"{BIG}/{BIG}")])
def test_calibrate_numbers_out_of_range_are_exit_2(env, capsys, tmp_path, extra):
    rc, err = _reap(capsys, *_calibrate(env, tmp_path / "cal", *extra))
    assert rc == 2, err
    _one_line(err, extra[0])


@pytest.mark.parametrize("extra, flag", [
    (("--top-m", "inf"), "--top-m"), (("--top-m", "nan"), "--top-m"),
    (("--bootstrap", BIG), "--bootstrap"), (("--community-nulls", "1000000000"), "--community-nulls"),
    (("--specialist-ratio", "nan"), "--specialist-ratio"), (("--min-load", "-1"), "--min-load"),
    (("--seed", BIG), "--seed"),
])
def test_analyze_number_arguments_are_exit_2(env, capsys, tmp_path, extra, flag):
    other = _stats(tmp_path / "zh.safetensors", corpus="zh")
    rc, err = _reap(capsys, "analyze", env["stats"], other, "--out", tmp_path / "an",
                    "--no-plots", "--quiet", "--permutations", "0", *extra)
    assert rc == 2, err
    _one_line(err, flag)


def test_budget_beyond_64_bits_is_exit_2_and_small_budget_named_in_its_unit(env, capsys, tmp_path):
    rc, err = _reap(capsys, *_calibrate(env, tmp_path / "cal", "--budget", "9" * 30 + "TB"))
    assert rc == 2, err
    _one_line(err, "2^63")
    rc, err = _reap(capsys, *_run(env, "--budget", "1KB"))
    assert rc == 2, err
    _one_line(err, "1.00 KB")
    assert "0.00 GB" not in err


# -- --out: unusable as given (2) or not writable (3) --------------------------------------------
def _out_commands(env, tmp_path, out):
    other = _stats(tmp_path / "zh.safetensors", corpus="zh")
    return {
        "calibrate": _calibrate(env, out),
        "analyze": ("analyze", env["stats"], other, "--out", out, "--no-plots", "--quiet",
                    "--bootstrap", "0", "--permutations", "0"),
        "eval": ("eval", env["model"], "--reference", env["model"], "--corpus", env["corpus"],
                 "--max-docs", "1", "--gen-tokens", "0", "--bootstrap", "0", "--no-plots",
                 "--quiet", "--out", out),
        "corpora": ("corpora", "build", "en", "--out", out),
        "run": _run(env, "--out", out),
        "stats": ("stats", "merge", env["stats"], env["stats"], "--out", out),
    }


@pytest.fixture
def no_corpus_build(monkeypatch):
    """`corpora build` must refuse its --out before it downloads anything."""
    def build(*args, **kw):
        raise AssertionError("build started before --out was checked")

    monkeypatch.setattr("reap.corpora.builder.pipeline.build", build)


@pytest.mark.parametrize("command", ["calibrate", "analyze", "eval", "corpora", "run", "stats"])
@pytest.mark.parametrize("where", ["file", "under a file"])
def test_out_at_or_under_a_file_is_exit_2(env, capsys, tmp_path, no_corpus_build, command, where):
    if command in ("run", "stats") and where == "file":  # a file output may replace a file
        out = tmp_path  # ... but not a directory
    else:
        out = env["file"] if where == "file" else os.path.join(env["file"], "sub")
    rc, err = _reap(capsys, *_out_commands(env, tmp_path, str(out))[command])
    assert rc == 2, err
    _one_line(err, str(out))


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
@pytest.mark.parametrize("command", ["calibrate", "analyze", "eval", "run", "stats"])
def test_out_in_proc_is_exit_3(env, capsys, tmp_path, command):
    out = "/proc/reap-contract-test"
    rc, err = _reap(capsys, *_out_commands(env, tmp_path, out)[command])
    assert rc == 3, err
    _one_line(err, out)


# -- statistics files: types, ranges, nesting ------------------------------------------------------
def _rewrite_header(src: str, dst, edit) -> str:
    """Copy a statistics file with its `reap` header JSON replaced by edit(header_dict_or_text)."""
    with open(src, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        data = f.read()
    reap = edit(json.loads(head["__metadata__"]["reap"]))
    head["__metadata__"]["reap"] = reap if isinstance(reap, str) else json.dumps(reap)
    raw = json.dumps(head).encode()
    raw += b" " * (-len(raw) % 8)
    with open(dst, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)
    return str(dst)


def _set(key, value):
    return lambda h: {**h, key: value}


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("edit, field", [
    (_set("tokens", 1.5), "tokens"), (_set("tokens", True), "tokens"),
    (_set("tokens", -1), "tokens"), (_set("n_experts", "8"), "n_experts"),
    (_set("n_experts", 8.0), "n_experts"), (_set("top_k", 0), "top_k"),
    (_set("top_k", False), "top_k"), (_set("layers", [1.0, 2.0, 3.0, 4.0]), "layers"),
    (_set("layers", [1, 1, 2, 3]), "layers"), (_set("layers", [1, 2, 3]), "count"),
    (_set("n_experts", 9), "count"), (_set("meta", [1]), "meta"),
    (_set("meta", json.loads("[" * 500 + "]" * 500)), "meta"),
    (lambda h: json.dumps(h)[:-1] + ', "x": ' + DEEP + "}", "statistics"),
])
def test_bad_statistics_header_is_exit_2_naming_file_and_field(env, capsys, tmp_path, edit, field):
    bad = _rewrite_header(env["stats"], tmp_path / "bad.safetensors", edit)
    for argv in (("stats", "show", bad),
                 ("stats", "merge", bad, env["stats"], "--out", tmp_path / "m.safetensors")):
        rc, err = _reap(capsys, *argv)
        assert rc == 2, err
        _one_line(err, bad, field)


def test_negative_counts_in_statistics_are_exit_2(env, capsys, tmp_path):
    s = ExpertStats.load(env["stats"])
    s.count[0, 0] = -5
    bad = s.save(tmp_path / "neg.safetensors")
    rc, err = _reap(capsys, "stats", "show", bad)
    assert rc == 2, err
    _one_line(err, bad, "count", "negative")


def test_corrupt_calibration_progress_is_exit_2(env, capsys, tmp_path):
    out = tmp_path / "cal"
    os.makedirs(out / ".work")
    (out / ".work" / "progress.json").write_text(DEEP)
    rc, err = _reap(capsys, *_calibrate(env, out))
    assert rc == 2, err
    _one_line(err, "progress.json")


@pytest.mark.parametrize("line, field", [
    ({"ids": [1, 2], "max_tokens": 1.5}, "max_tokens"),
    ({"ids": [1, 2], "max_tokens": True}, "max_tokens"),
    ({"ids": [1, 2], "seed": 2**70}, "seed"),
    ({"ids": [1, 2], "seed": -1}, "seed"),
    ({"ids": [1.0, 2.0]}, "ids"),
    ({"ids": [1, 2], "temperature": "hot"}, "temperature"),
    ({"ids": [1, 2], "stop": 3}, "stop"),
    ('{"ids": ' + DEEP + "}", "JSON"),
])
def test_bad_prompt_lines_are_exit_2(env, capsys, tmp_path, line, field):
    path = tmp_path / "prompts.jsonl"
    path.write_text((line if isinstance(line, str) else json.dumps(line)) + "\n")
    rc, err = _reap(capsys, "run", env["model"], "--prompts", path, "--max-tokens", "1",
                    "--quiet")
    assert rc == 2, err
    _one_line(err, str(path), field)


# -- messages: the real cause, and where lists differ ---------------------------------------------
def test_stats_of_two_models_are_a_model_mismatch_not_a_repeated_corpus(env, capsys, tmp_path):
    """Same corpus, same architecture (so the same fingerprint), two checkpoints: the files sit
    in directories of the same name, which once made it 'corpus given twice'."""
    a = _stats(tmp_path / "a" / "stats" / "en.safetensors", model_path="/models/a")
    b = _stats(tmp_path / "b" / "stats" / "en.safetensors", model_path="/models/b")
    rc, err = _reap(capsys, "analyze", a, b, "--out", tmp_path / "an", "--no-plots", "--quiet")
    assert rc == 2, err
    _one_line(err, a, b, "different models", "/models/a", "/models/b", "f" * 64)
    assert "given twice" not in err


def test_different_fingerprints_are_named_with_both_files(env, capsys, tmp_path):
    a = _stats(tmp_path / "a" / "en.safetensors", fingerprint="a" * 64)
    b = _stats(tmp_path / "b" / "en.safetensors", fingerprint="b" * 64)
    rc, err = _reap(capsys, "analyze", a, b, "--out", tmp_path / "an", "--no-plots", "--quiet")
    assert rc == 2, err
    _one_line(err, a, b, "a" * 64, "b" * 64)
    rc, err = _reap(capsys, "stats", "merge", a, b, "--out", tmp_path / "m.safetensors")
    assert rc == 2, err
    _one_line(err, "a" * 64, "b" * 64)


def test_layer_mismatch_names_the_first_differing_layer(env, capsys, tmp_path):
    a = _stats(tmp_path / "en.safetensors", layers=(1, 2, 3, 4, 5, 6))
    b = _stats(tmp_path / "zh.safetensors", corpus="zh", layers=(1, 2, 3, 4, 5, 7))
    rc, err = _reap(capsys, "analyze", a, b, "--out", tmp_path / "an", "--no-plots", "--quiet")
    assert rc == 2, err
    _one_line(err, "position 5: 6 vs 7")
    rc, err = _reap(capsys, "stats", "merge", a, b, "--out", tmp_path / "m.safetensors")
    assert rc == 2, err
    _one_line(err, "position 5: 6 vs 7")
