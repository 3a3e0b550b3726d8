"""One rule for every output path (issue 34 part 1; `reap.fileio.claim_out`): reap replaces only
what it made (a checkpoint whose index it tagged, its plan, statistics and result files, its own
`.partial`), and only with --overwrite; anything else in the way (a foreign directory or file, a
FIFO, a socket, a link) is exit 2 naming the path, --overwrite or not, and stays as it was. A
prune killed before its first shard resumes. The slow sweep is experiments/fuzz_paths.py."""

import hashlib
import json
import os
import shutil
import socket
import stat
from pathlib import Path

import pytest

from reap.checkpoint import Checkpoint
from reap.cli import main
from reap.errors import ReapError
from reap.fileio import write_atomic
from reap.prune.plan import make_plan
from reap.prune.write import prune

SHARD = 100_000  # bytes: a k3-tiny prune writes about a dozen shards


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A k3-tiny checkpoint, a plan for it, its uninterrupted prune and a statistics file."""
    root = tmp_path_factory.mktemp("paths")
    src = root / "k3-tiny"
    argv = ["synth", "k3-tiny", "--out", str(src), "--dtype", "float32", "--shard-gb", "0.0002"]
    assert main(argv) == 0
    with Checkpoint.open(src) as ck:
        plan = make_plan(config=ck.config, model=ck.fingerprint(), criterion="random", keep=6)
    plan_path = plan.save(root / "plan.json")
    pruned = root / "pruned"
    prune(model=str(src), plan=plan_path, out=str(pruned), max_shard_bytes=SHARD)
    return {"root": root, "src": str(src), "plan": plan_path, "pruned": pruned}


def digest(d: Path, skip=()) -> dict[str, str]:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file() and p.name not in skip
    }


def build(d: Path) -> dict[str, str]:
    """A prune's files but its manifest (which records the command's arguments)."""
    return digest(d, skip=("reap_manifest.json",))


def refused(capsys, argv, *words) -> str:
    """Run argv; it must exit 2 with one `reap: error:` line holding `words`."""
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 2, argv
    err = capsys.readouterr().err.strip()
    assert err.startswith("reap: error: ") and len(err.splitlines()) == 1, err
    assert all(w in err for w in words), err
    return err


def _prune(env, out, *extra):
    return ["prune", env["src"], "--plan", env["plan"], "--out", str(out), "--no-progress",
            f"--max-shard-size={SHARD}B", *extra]


def test_prune_overwrite_keeps_a_directory_reap_did_not_make(env, tmp_path, capsys):
    """Before: `--out U --overwrite` exited 0 and U/thesis.txt was gone."""
    u = tmp_path / "U"
    u.mkdir()
    (u / "thesis.txt").write_text("x\n")
    refused(capsys, _prune(env, u, "--overwrite"), str(u), "not made by reap")
    assert digest(u) == {"thesis.txt": hashlib.sha256(b"x\n").hexdigest()}
    assert sorted(os.listdir(tmp_path)) == ["U"]


def test_prune_overwrite_replaces_its_own_build(env, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(env["pruned"], out)
    refused(capsys, _prune(env, out), "already exists", "--overwrite")
    assert main(_prune(env, out, "--overwrite")) == 0
    assert build(out) == build(env["pruned"])


def test_synth_overwrite_keeps_a_model_reap_did_not_make(env, tmp_path, capsys):
    """Before: `reap synth k3-tiny --out SP --overwrite` deleted the model in SP."""
    sp = tmp_path / "SP"
    shutil.copytree(env["src"], sp)
    index = sp / "model.safetensors.index.json"
    d = json.loads(index.read_text())
    del d["metadata"]["format"]  # as any other tool writes an index
    index.write_text(json.dumps(d))
    (sp / "notes.txt").write_text("mine")
    before = digest(sp)
    refused(capsys, ["synth", "k3-tiny", "--out", sp, "--overwrite"], str(sp), "not made by reap")
    assert digest(sp) == before
    own = tmp_path / "own"
    for _ in range(2):  # a previous synth output is reap's own: replaced with --overwrite
        assert main(["synth", "k3-tiny", "--out", str(own), "--overwrite", "--seed", "1"]) == 0
    assert not [p for p in os.listdir(tmp_path) if p not in ("SP", "own")]


def _fifo(path):
    os.mkfifo(path)
    return path


def _socket(path):
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()  # the socket file stays
    return path


def _link_to_fifo(path):
    os.symlink(_fifo(path.with_name("target-fifo")), path)
    return path


@pytest.mark.parametrize("make", [_fifo, _socket, _link_to_fifo])
def test_plan_out_that_is_not_a_regular_file_is_never_replaced(env, tmp_path, capsys, make):
    """Before: `reap plan ... --out FIFO` renamed a regular file over it (the /dev/null case)."""
    out = make(tmp_path / "out")
    mode = os.lstat(out).st_mode
    argv = ["plan", "--model", env["src"], "--criterion", "random", "--keep", "6", "--out", out]
    for extra in ([], ["--overwrite"]):
        refused(capsys, [*argv, *extra], str(out), "not a file")
        assert os.lstat(out).st_mode == mode


def test_write_atomic_never_renames_over_a_fifo(tmp_path):
    fifo = _fifo(tmp_path / "fifo")
    with pytest.raises(ReapError, match="FIFO"):
        write_atomic(fifo, "x")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.listdir(tmp_path) == ["fifo"]


def test_plan_out_file_needs_overwrite_and_must_be_reaps(env, tmp_path, capsys):
    """Before: an existing file was replaced without --overwrite, whatever it held."""
    out, thesis = tmp_path / "plan.json", tmp_path / "thesis.json"
    thesis.write_text('{"format": "mine"}')
    argv = ["plan", "--model", env["src"], "--criterion", "random", "--keep", "6", "--out"]
    assert main([*argv, str(out)]) == 0
    first = out.read_bytes()
    refused(capsys, [*argv, out, "--seed", "1"], "already exists", "--overwrite")
    assert out.read_bytes() == first
    assert main([*argv, str(out), "--seed", "1", "--overwrite"]) == 0
    assert out.read_bytes() != first
    refused(capsys, [*argv, thesis, "--overwrite"], str(thesis), "not made by reap")
    assert thesis.read_text() == '{"format": "mine"}'


def test_run_and_stats_out_files_follow_the_same_rule(env, tmp_path, capsys):
    stats = tmp_path / "s.safetensors"
    from reap.stats import ExpertStats

    ExpertStats.zeros([1, 2], 8, 2, meta={"model": "f" * 64, "corpus": "en"}).save(stats)
    run = ["run", env["src"], "--prompt-ids", "1,2", "--max-tokens", "1", "--quiet", "--out"]
    merge = ["stats", "merge", str(stats), str(stats), "--out"]
    for argv, name in ((run, "run.json"), (merge, "merged.safetensors")):
        out, foreign = tmp_path / name, tmp_path / f"foreign-{name}"
        foreign.write_bytes(b"keep me")
        refused(capsys, [*argv, foreign, "--overwrite"], str(foreign), "not made by reap")
        refused(capsys, [*argv, _fifo(tmp_path / f"fifo-{name}")], "FIFO")
        assert main([*argv, str(out)]) == 0
        refused(capsys, [*argv, out], "already exists")
        assert main([*argv, str(out), "--overwrite"]) == 0
        assert foreign.read_bytes() == b"keep me"


@pytest.mark.parametrize("left", [[], [".reap-plan.tmp"], [".reap-plan"],
                                  [".reap-plan", ".reap-prune-inputs.tmp"]])
@pytest.mark.parametrize("overwrite", [False, True])
def test_prune_killed_before_its_first_shard_resumes(env, tmp_path, capsys, left, overwrite):
    """Before: an empty `<out>.partial` was refused as not made by reap prune (--overwrite too);
    one holding only the writer's plan file asked for --overwrite."""
    out = tmp_path / "out"
    work = tmp_path / "out.partial"
    work.mkdir()
    for name in left:
        (work / name).write_text("0" * 64)
    assert main(_prune(env, out, *(["--overwrite"] if overwrite else []))) == 0
    assert build(out) == build(env["pruned"]) and not work.exists()


def test_calibrate_keeps_a_work_directory_it_did_not_make(env, tmp_path, capsys):
    """Before: calibrate deleted OUT/.work (a user's directory) when it started afresh."""
    out = tmp_path / "U"
    (out / ".work").mkdir(parents=True)
    (out / ".work" / "notes.txt").write_text("mine")
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "text": "ab " * 40}) + "\n"
                              for i in range(40)))
    argv = ["calibrate", env["src"], "--corpus", corpus, "--tokens", "32", "--seq-len", "16",
            "--no-progress", "--out", out]
    refused(capsys, argv, "notes.txt", "did not write")
    assert (out / ".work" / "notes.txt").read_text() == "mine"
    from reap.calibrate.pipeline import calibrate  # the library call keeps it too

    with pytest.raises(ReapError, match="notes.txt, which calibration did not write"):
        calibrate(model=env["src"], corpus=str(corpus), tokens=32, seq_len=16, out=str(out),
                  progress=False)
    assert (out / ".work" / "notes.txt").read_text() == "mine"


# the fast subset of experiments/fuzz_paths.py: one batch driver, one killed-at-start prune
FUZZ_ONLY = ["plan/fifo", "plan/socket", "plan/link_to_fifo", "plan/foreign_json", "plan/own",
             "prune/foreign_dir", "prune/foreign_model", "prune/foreign_partial",
             "prune/early_partial_plan", "synth/foreign_model", "synth/own/overwrite",
             "stats/own"]


def test_fuzz_paths_subset_loses_nothing(tmp_path):
    from experiments import fuzz_paths

    records = fuzz_paths.execute(tmp_path, timeout=60.0, kills=1, only=FUZZ_ONLY)
    bad = [(r["key"], r["verdict"], r["note"], r["line"]) for r in records if r["verdict"] != "clean"]
    assert not bad, bad
    assert {r["obstacle"] for r in records} >= {"fifo", "foreign_dir", "killed_at_start"}
    assert len(records) >= 20
