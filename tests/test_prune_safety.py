"""`reap prune` and `reap verify` never lose or mix data (issue 18): the output may not be, hold
or lie inside the source or the plan; a resumed prune continues only the job of the same inputs
(another plan is refused, the same one resumes to the bytes of an uninterrupted run); verify
checks the index against the shards; bad plans and shard sizes are refused at load, exit 2."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from reap.checkpoint import Checkpoint, CheckpointWriter
from reap.cli import main
from reap.prune.plan import make_plan
from reap.prune.resume import INPUTS
from reap.prune.write import prune

SHARD = 100_000  # bytes: a k3-tiny prune writes about a dozen shards


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    out = tmp_path_factory.mktemp("src") / "k3-tiny"
    argv = ["synth", "k3-tiny", "--out", str(out), "--dtype", "float32", "--shard-gb", "0.0002"]
    assert main(argv) == 0
    return out


@pytest.fixture(scope="module")
def plans(src, tmp_path_factory):
    """Two plans of the same counts (the same shard layout) keeping different experts."""
    d = tmp_path_factory.mktemp("plans")
    with Checkpoint.open(src) as ck:
        made = [
            make_plan(config=ck.config, model=ck.fingerprint(), criterion="random", keep=6, seed=s)
            for s in (3, 4)
        ]
    assert made[0].counts == made[1].counts and made[0].keep != made[1].keep
    return [p.save(d / f"plan_{name}.json") for name, p in zip("ab", made)]


@pytest.fixture(scope="module")
def pruned(src, plans, tmp_path_factory):
    out = tmp_path_factory.mktemp("pruned") / "out"
    prune(model=str(src), plan=plans[0], out=str(out), max_shard_bytes=SHARD)
    return out


def digest(d: Path) -> dict[str, str]:
    """sha256 of every file under d, by relative path."""
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


def one_line_error(capsys, argv, code=2) -> str:
    capsys.readouterr()
    assert main(argv) == code, argv
    err = capsys.readouterr().err.strip()
    assert err.startswith("reap: error: ") and len(err.splitlines()) == 1, err
    return err


def test_out_may_not_be_hold_or_lie_inside_the_source(src, plans, tmp_path, capsys):
    """Before: --out PARENT_OF_SRC --overwrite exited 0 and deleted the source."""
    parent = tmp_path / "models"
    model = parent / "src"
    shutil.copytree(src, model)
    (tmp_path / "link").symlink_to(parent)
    plan_dir = tmp_path / "plans"
    plan_dir.mkdir()
    plan = shutil.copy(plans[0], plan_dir / "plan.json")
    before = digest(tmp_path)
    for out in (
        model,
        parent,
        model / "sub",
        tmp_path / "link",
        tmp_path / "link" / "src",
        plan_dir,
    ):
        argv = ["prune", str(model), "--plan", str(plan), "--out", str(out), "--overwrite"]
        err = one_line_error(capsys, [*argv, "--no-progress"])
        assert "choose an output directory outside" in err, err
        assert digest(tmp_path) == before, out  # nothing deleted, replaced or added
    assert not list(tmp_path.rglob("*.partial"))


def test_out_may_not_hold_the_files_a_source_links_to(src, plans, tmp_path, capsys):
    """A hub-cache layout: the model directory holds symlinks into a blob directory; an output
    that holds the blobs would delete the weights behind the links."""
    blobs, snapshot = tmp_path / "repo" / "blobs", tmp_path / "repo" / "snapshot"
    blobs.mkdir(parents=True)
    snapshot.mkdir()
    for f in src.iterdir():
        shutil.copy(f, blobs / hashlib.sha256(f.name.encode()).hexdigest())
        (snapshot / f.name).symlink_to(blobs / hashlib.sha256(f.name.encode()).hexdigest())
    before = digest(tmp_path)
    argv = ["prune", str(snapshot), "--plan", str(plans[0]), "--out", str(blobs), "--overwrite"]
    err = one_line_error(capsys, [*argv, "--no-progress"])
    assert "the output contains the input" in err and digest(tmp_path) == before, err


def test_work_dir_of_the_source_is_never_removed(src, plans, tmp_path, capsys):
    """`<out>.partial` is the writer's work directory: a source there is never resumed into or
    removed, even with --overwrite."""
    model = tmp_path / "x.partial"
    shutil.copytree(src, model)
    before = digest(model)
    argv = ["prune", str(model), "--plan", str(plans[0]), "--out", str(tmp_path / "x")]
    err = one_line_error(capsys, [*argv, "--overwrite", "--no-progress"])
    assert "the output is the input" in err and digest(model) == before


def interrupted(src, plan, out, monkeypatch, after=200):
    """Run a prune that dies (KeyboardInterrupt) at its `after`-th tensor write."""
    real_write, calls = CheckpointWriter.write, [0]

    def dying_write(self, name, data):
        calls[0] += 1
        if calls[0] == after:
            raise KeyboardInterrupt
        return real_write(self, name, data)

    monkeypatch.setattr(CheckpointWriter, "write", dying_write)
    with pytest.raises(KeyboardInterrupt):
        prune(model=str(src), plan=str(plan), out=str(out), max_shard_bytes=SHARD)
    monkeypatch.setattr(CheckpointWriter, "write", real_write)
    work = Path(f"{out}.partial")
    assert not out.exists() and list(work.glob("model-*.safetensors"))  # some shards complete
    return work


def test_resume_refuses_a_work_dir_of_another_plan(
    src, plans, pruned, tmp_path, monkeypatch, capsys
):
    """Before: resuming plan A's half-written output with plan B exited 0 with A's and B's
    shards mixed. Now B is refused (nothing touched); A resumes to the uninterrupted bytes."""
    out = tmp_path / "out"
    work = interrupted(src, plans[0], out, monkeypatch)
    before = digest(work)
    argv = ["prune", str(src), "--plan", str(plans[1]), "--out", str(out), "--no-progress"]
    err = one_line_error(capsys, [*argv, f"--max-shard-size={SHARD}B"])
    assert "plan_sha256" in err and "--overwrite" in err and "overwrite=True" not in err, err
    err = one_line_error(capsys, [*argv[:3], str(plans[0]), *argv[4:], "--max-shard-size=50KB"])
    assert "max_shard_bytes" in err, err  # another shard size would mix layouts too
    assert digest(work) == before and not out.exists()
    r = prune(model=str(src), plan=str(plans[0]), out=str(out), max_shard_bytes=SHARD)
    assert 0 < r.resumed_tensors < r.tensors
    assert digest(out) == digest(pruned) and not os.path.lexists(work)


def test_overwrite_restarts_a_work_dir_of_another_plan(src, plans, tmp_path, monkeypatch):
    """With overwrite, the half-written output of plan A is discarded: the result is exactly
    an uninterrupted prune of plan B."""
    out, clean = tmp_path / "out", tmp_path / "clean"
    interrupted(src, plans[0], out, monkeypatch)
    r = prune(
        model=str(src), plan=str(plans[1]), out=str(out), max_shard_bytes=SHARD, overwrite=True
    )
    assert r.resumed_tensors == 0
    prune(model=str(src), plan=str(plans[1]), out=str(clean), max_shard_bytes=SHARD)
    assert digest(out) == digest(clean)


def test_resume_refuses_a_work_dir_without_a_record(src, plans, tmp_path, monkeypatch, capsys):
    """A work directory whose inputs are not recorded (an older reap) is not resumed."""
    out = tmp_path / "out"
    work = interrupted(src, plans[0], out, monkeypatch)
    (work / INPUTS).unlink()  # the record is written when a prune starts
    argv = ["prune", str(src), "--plan", str(plans[0]), "--out", str(out), "--no-progress"]
    err = one_line_error(capsys, [*argv, f"--max-shard-size={SHARD}B"])
    assert "not recorded" in err and "--overwrite" in err, err


def test_a_foreign_work_dir_is_never_removed(src, plans, tmp_path, capsys):
    """`<out>.partial` that no prune made (no record, no writer marker) stays, even with
    --overwrite."""
    out = tmp_path / "out"
    work = tmp_path / "out.partial"
    work.mkdir()
    (work / "mine.txt").write_text("keep me")
    argv = ["prune", str(src), "--plan", str(plans[0]), "--out", str(out), "--overwrite"]
    err = one_line_error(capsys, [*argv, "--no-progress"])
    assert "not made by reap prune" in err and (work / "mine.txt").read_text() == "keep me"


def test_existing_output_message_names_the_flag(src, plans, pruned, capsys):
    argv = ["prune", str(src), "--plan", str(plans[0]), "--out", str(pruned), "--no-progress"]
    err = one_line_error(capsys, argv)
    assert "already exists" in err and "--overwrite" in err and "overwrite=True" not in err, err


def test_output_that_is_a_file_is_refused(src, plans, tmp_path, capsys):
    out = tmp_path / "notes.txt"
    out.write_text("keep me")
    argv = ["prune", str(src), "--plan", str(plans[0]), "--out", str(out), "--overwrite"]
    err = one_line_error(capsys, [*argv, "--no-progress"])
    assert "not a directory" in err and out.read_text() == "keep me", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def edit_index(d: Path, change) -> None:
    path = d / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    change(index["weight_map"])
    path.write_text(json.dumps(index))


def swap_files(d: Path, a: str, b: str) -> None:
    tmp = d / "swap.tmp"
    (d / a).rename(tmp)
    (d / b).rename(d / a)
    tmp.rename(d / b)


def test_verify_checks_the_index_against_the_shards(src, pruned, tmp_path, capsys):
    """Before: verify passed with an index naming a missing, wrong or outside shard, and with
    shard files renamed or swapped."""
    shards = sorted(p.name for p in pruned.glob("*.safetensors"))
    first = json.loads((pruned / "model.safetensors.index.json").read_text())["weight_map"]
    key = min(first)
    cases = {
        "missing": lambda d: edit_index(
            d, lambda m: m.update({key: "model-00099-of-00099.safetensors"})
        ),
        "wrong": lambda d: edit_index(
            d, lambda m: m.update({key: next(s for s in shards if s != m[key])})
        ),
        "escape": lambda d: edit_index(d, lambda m: m.update({key: f"../{pruned.name}/{m[key]}"})),
        "renamed": lambda d: (d / shards[-1]).rename(d / shards[-1].replace("model-", "model-9")),
        "swapped": lambda d: swap_files(d, shards[0], shards[1]),
        "no index": lambda d: (d / "model.safetensors.index.json").unlink(),
    }
    assert main(["verify", str(pruned), "--source", str(src)]) == 0
    for name, change in cases.items():
        copy = tmp_path / name.replace(" ", "_")
        shutil.copytree(pruned, copy)
        change(copy)
        err = one_line_error(capsys, ["verify", str(copy), "--source", str(src)])
        assert "model.safetensors.index.json" in err, (name, err)


def bad_plan(tmp_path: Path, plan: str, name: str, change) -> str:
    d = json.loads(Path(plan).read_text())
    change(d)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(d))
    return str(path)


def set_layer(layer: str, ids, top_k=None):
    def change(d):
        d["keep"][layer], d["counts"][layer] = ids, len(ids)
        if top_k is not None:
            d["top_k"] = top_k

    return change


def test_bad_plans_are_refused_naming_file_and_field(src, plans, tmp_path, capsys):
    """Before: a layer keeping 0 experts, a top_k lowered by hand (the pruned model's
    num_experts_per_token silently followed it) and float or bool ids all pruned with exit 0."""
    keep = json.loads(Path(plans[0]).read_text())["keep"]["2"]
    cases = {
        "zero": (set_layer("2", [], top_k=0), "top_k"),
        "zero_count": (set_layer("2", []), "counts: layer 2 keeps 0"),
        "top_k": (set_layer("2", keep[:2], top_k=2), "top_k: 2"),
        "floats": (set_layer("2", [float(e) for e in keep]), "keep: layer 2"),
        "bools": (set_layer("2", [True, *keep[1:]]), "keep: layer 2"),
        "unsorted": (set_layer("2", keep[::-1]), "keep: layer 2"),
        "range": (set_layer("2", [*keep[:-1], 16]), "keep: layer 2"),
        "n_experts": (lambda d: d.update(n_experts=17), "n_experts"),
    }
    for name, (change, field) in cases.items():
        path = bad_plan(tmp_path, plans[0], name, change)
        argv = ["prune", str(src), "--plan", path, "--out", str(tmp_path / f"o_{name}")]
        err = one_line_error(capsys, [*argv, "--no-progress"])
        assert f"{path}: " in err and field in err, (name, err)
        assert not (tmp_path / f"o_{name}").exists()


@pytest.mark.parametrize("size", ["-1GB", "0GB", "0.1B", "nanGB", "infGB", "1e400GB"])
def test_bad_max_shard_size_is_refused(src, plans, tmp_path, capsys, size):
    argv = ["prune", str(src), "--plan", str(plans[0]), "--out", str(tmp_path / "o")]
    err = one_line_error(capsys, [*argv, f"--max-shard-size={size}", "--no-progress"])
    assert "--max-shard-size" in err and not (tmp_path / "o").exists(), err
