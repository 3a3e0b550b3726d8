"""`reap prune` and `reap verify` on a synthesized k3-tiny: the pruned checkpoint equals a naive
in-memory pruning read with the safetensors library, the pruned model's logits equal the original
model's with the dropped experts masked out of routing, verify catches flipped bytes, an
interrupted prune resumes to identical files, and the size model predicts the bytes written."""

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from reap.checkpoint import Checkpoint, CheckpointWriter
from reap.cli import main
from reap.models import builtin_config, family
from reap.models.base import dict_weights
from reap.prune.plan import make_plan
from reap.prune.plan_file import Plan
from reap.prune.verify import VerifyError, verify
from reap.prune.write import MANIFEST, prune

EXPERT = re.compile(r"^(language_model\.)?model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.")
ROUTER = re.compile(r"^(language_model\.)?model\.layers\.(\d+)\.block_sparse_moe\.gate\.")


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    out = tmp_path_factory.mktemp("src") / "k3-tiny"
    assert (
        main(["synth", "k3-tiny", "--out", str(out), "--dtype", "float32", "--shard-gb", "0.0002"])
        == 0
    )
    return out


@pytest.fixture(scope="module")
def plan(src, tmp_path_factory):
    with Checkpoint.open(src) as ck:
        p = make_plan(config=ck.config, model=ck.fingerprint(), criterion="random", keep=6, seed=3)
    return p.save(tmp_path_factory.mktemp("plan") / "plan.json")


@pytest.fixture(scope="module")
def pruned(src, plan, tmp_path_factory):
    out = tmp_path_factory.mktemp("pruned") / "out"
    assert main(["prune", str(src), "--plan", str(plan), "--out", str(out), "--no-progress"]) == 0
    return out


def load_safetensors(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a directory, read by the safetensors library (not our reader)."""
    from safetensors import safe_open

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})  # noqa: SIM118
    return out


def naive_prune(tensors: dict, keep: dict[int, list[int]]) -> dict[str, torch.Tensor]:
    """The pruned tensors by the obvious in-memory rules (K3 names spelled out)."""
    out = {}
    for k, t in tensors.items():
        m, r = EXPERT.match(k), ROUTER.match(k)
        if m:
            layer, e = int(m.group(2)), int(m.group(3))
            if e in keep[layer]:
                new = keep[layer].index(e)
                out[k.replace(f".experts.{e}.", f".experts.{new}.")] = t
        elif r:
            out[k] = t[keep[int(r.group(2))]]
        else:
            out[k] = t
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
        )
    )


def test_pruned_checkpoint_equals_naive_pruning(src, plan, pruned):
    p = Plan.load(plan)
    got, want = load_safetensors(pruned), naive_prune(load_safetensors(src), p.keep)
    assert sorted(got) == sorted(want)
    bad = [k for k in want if not same_bytes(got[k], want[k])]
    assert not bad, bad[:3]
    config = json.loads((pruned / "config.json").read_text())
    assert config["text_config"]["num_experts"] == 6
    assert config == family(config).with_experts(json.loads((src / "config.json").read_text()), 6)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (pruned / name).read_bytes() == (src / name).read_bytes()
    man = json.loads((pruned / MANIFEST).read_text())
    src_t = load_safetensors(src)
    for layer, ids in p.keep.items():
        assert man["experts"][str(layer)]["original"] == ids
        for j, e in enumerate(ids):  # sha256 over the six tensors, in w1, w2, w3 file order
            pre = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{e}."
            h = hashlib.sha256()
            for w in ("w1", "w2", "w3"):
                for part in ("weight_packed", "weight_scale"):
                    h.update(src_t[pre + f"{w}.{part}"].numpy().tobytes())
            assert man["experts"][str(layer)]["sha256"][j] == h.hexdigest()
    assert not list(pruned.parent.glob("*.partial"))


class Recorder:
    wants_norms = False

    def __init__(self):
        self.records = []

    def on_moe(self, record):
        self.records.append(record)


def masked(get, keep: dict[int, list[int]], n_experts: int):
    """The original weights with dropped experts' selection bias at -inf: routing restricted to
    the kept experts, routing weights (raw sigmoid scores) untouched."""

    def g(name):
        t = get(name)
        m = re.match(
            r"model\.layers\.(\d+)\.block_sparse_moe\.gate\.e_score_correction_bias$", name
        )
        if m:
            drop = torch.ones(n_experts, dtype=torch.bool)
            drop[keep[int(m.group(1))]] = False
            t = t.masked_fill(drop, float("-inf"))
        return t

    return g


def test_pruned_model_equals_original_with_dropped_experts_masked(src, plan, pruned):
    p = Plan.load(plan)
    runs = {}
    for name, d in (("src", src), ("pruned", pruned)):
        with Checkpoint.open(d) as ck:
            fam = family(ck.config)
            runs[name] = (
                fam.Model(fam.Config.from_dict(ck.config)),
                dict_weights({n: ck.read(n) for n in ck.tensors}),
            )
    ids = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(0))
    (m0, w0), (m1, w1) = runs["src"], runs["pruned"]
    r_masked, r_pruned = Recorder(), Recorder()
    with torch.no_grad():
        full = m0.forward(w0, ids)
        want = m0.forward(masked(w0, p.keep, p.n_experts), ids, observer=r_masked)
        got = m1.forward(w1, ids, observer=r_pruned)
    # the router matmul has fewer rows in the pruned model: the same arithmetic up to float32
    # rounding (bit-equal on some CPUs, a few ulps apart on others), never a different choice
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (full - want).abs().max() > 100 * 1e-4  # the dropped experts did matter
    for a, b in zip(r_masked.records, r_pruned.records):  # same choices, renumbered
        original = torch.tensor(p.keep[b.layer])
        assert torch.equal(a.ids, original[b.ids])
        torch.testing.assert_close(a.weights, b.weights, rtol=1e-5, atol=1e-6)


def test_global_plan_prunes_to_per_layer_counts(src, tmp_path):
    """A global-scope plan keeps different counts per layer: the config records them
    (num_experts_per_layer), verify passes, and logits equal the masked original."""
    with Checkpoint.open(src) as ck:
        p = make_plan(config=ck.config, model=ck.fingerprint(), criterion="random", ratio=0.4,
                      scope="global", seed=5)
    assert len(set(p.counts.values())) > 1
    out = tmp_path / "global"
    prune(model=str(src), plan=p, out=str(out))
    assert verify(pruned=str(out), source=str(src)).experts == sum(p.counts.values())
    config = json.loads((out / "config.json").read_text())
    per = config["text_config"]["num_experts_per_layer"]
    assert {int(k): v for k, v in per.items()} == {int(k): v for k, v in p.counts.items()}
    models = []
    for d in (src, out):
        with Checkpoint.open(d) as ck:
            fam = family(ck.config)
            models.append((fam.Model(fam.Config.from_dict(ck.config)),
                           dict_weights({n: ck.read(n) for n in ck.tensors})))
    ids = torch.randint(0, 384, (1, 12), generator=torch.Generator().manual_seed(1))
    (m0, w0), (m1, w1) = models
    r0, r1 = Recorder(), Recorder()
    with torch.no_grad():
        got = m1.forward(w1, ids, observer=r1)
        want = m0.forward(masked(w0, p.keep, p.n_experts), ids, observer=r0)
    for a, b in zip(r0.records, r1.records):  # the same routing choices, renumbered
        assert torch.equal(a.ids, torch.tensor(p.keep[b.layer])[b.ids])
    # router matmuls of different widths may round differently in the last bit
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    from reap.engine import Engine  # the streaming engine runs per-layer counts too

    with Engine.open(str(out), budget="2GB", dtype="float32") as engine:
        # its prefill products run the compiled tiles (another fp32 summation order than the
        # forward's torch matmuls, whose own order depends on the CPU: 3.7e-5 of 3.9 measured
        # here); a routing or renumbering mistake moves logits by far more
        tol = 1e-4 * float(got[0].abs().max())
        torch.testing.assert_close(engine.logits([ids[0].tolist()])[0], got[0], rtol=0, atol=tol)


def test_verify_passes_and_catches_flipped_bytes(src, pruned, tmp_path, capsys):
    assert main(["verify", str(pruned), "--source", str(src)]) == 0
    r = verify(pruned=str(pruned), source=str(src))
    assert r.experts == 30 and r.tensors == len(load_safetensors(pruned))
    with Checkpoint.open(pruned) as ck:
        names = list(ck.tensors)
    expert = next(n for n in names if ".experts.2.w2.weight_packed" in n)
    cases = {
        expert: expert,
        "model.norm.weight": "model.norm.weight",
        "model.layers.3.block_sparse_moe.gate.weight": "router tensor",
    }
    for i, (name, message) in enumerate(cases.items()):
        copy = tmp_path / f"copy{i}"
        shutil.copytree(pruned, copy)
        with Checkpoint.open(copy) as ck:
            info = ck.tensors[name]
        with open(info.file, "r+b") as f:
            f.seek(info.start + 5)
            byte = f.read(1)
            f.seek(info.start + 5)
            f.write(bytes([byte[0] ^ 0x10]))
        capsys.readouterr()
        assert main(["verify", str(copy), "--source", str(src)]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def test_verify_catches_manifest_and_config_tampering(src, pruned, tmp_path):
    copy = tmp_path / "m"
    shutil.copytree(pruned, copy)
    man = json.loads((copy / MANIFEST).read_text())
    man["experts"]["2"]["sha256"][4] = "0" * 64
    (copy / MANIFEST).write_text(json.dumps(man))
    with pytest.raises(VerifyError, match="layer 2 expert 4 .* sha256 differs"):
        verify(pruned=str(copy), source=str(src))
    copy = tmp_path / "c"
    shutil.copytree(pruned, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["text_config"]["num_experts_per_token"] = 3
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(VerifyError, match="num_experts_per_token"):
        verify(pruned=str(copy), source=str(src))


def test_interrupted_prune_resumes_to_identical_files(src, plan, tmp_path, monkeypatch):
    clean = prune(
        model=str(src), plan=str(plan), out=str(tmp_path / "clean"), max_shard_bytes=100_000
    )
    assert clean.resumed_tensors == 0
    real_write, calls = CheckpointWriter.write, [0]

    def dying_write(self, name, data):
        calls[0] += 1
        if calls[0] == 200:
            raise KeyboardInterrupt
        return real_write(self, name, data)

    monkeypatch.setattr(CheckpointWriter, "write", dying_write)
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        prune(model=str(src), plan=str(plan), out=str(out), max_shard_bytes=100_000)
    assert not out.exists() and (tmp_path / "resumed.partial").is_dir()
    monkeypatch.setattr(CheckpointWriter, "write", real_write)
    r = prune(model=str(src), plan=str(plan), out=str(out), max_shard_bytes=100_000)
    assert 0 < r.resumed_tensors < r.tensors
    files = sorted(p.name for p in (tmp_path / "clean").iterdir())
    assert files == sorted(p.name for p in out.iterdir()) and len(files) > 6
    for f in files:
        assert (out / f).read_bytes() == (tmp_path / "clean" / f).read_bytes(), f


def test_bad_input_is_one_line_exit_2(src, plan, pruned, tmp_path, capsys):
    p = json.loads(Path(plan).read_text())
    wrong_model = tmp_path / "wrong_model.json"
    wrong_model.write_text(json.dumps({**p, "model": "0" * 64}))
    cases = [
        (
            ["prune", str(src), "--plan", str(wrong_model), "--out", str(tmp_path / "a")],
            "the plan was made for model",
        ),
        (["prune", str(src), "--plan", str(plan), "--out", str(pruned)], "already exists"),
        (
            ["prune", str(tmp_path / "nope"), "--plan", str(plan), "--out", str(tmp_path / "c")],
            "nope",
        ),
        (["verify", str(src), "--source", str(src)], "reap_manifest.json"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def test_predicted_size_equals_bytes_written(tmp_path):
    """A header-light variant of k3-tiny (wide experts), random bytes: prune writes what the size
    model predicts, tensor data exactly and files within 0.1 %."""
    from reap.sizes import SizeModel

    config = builtin_config("k3-tiny", layers=3)
    config["text_config"]["moe_intermediate_size"] = 2048
    fam = family(config)
    specs = fam.layout(config)
    w = CheckpointWriter(
        tmp_path / "wide", specs, max_shard_bytes=4_000_000, prefix="language_model."
    )
    g = torch.Generator().manual_seed(0)
    for s in specs:  # random bytes; E8M0 scales of trained-size weights (prune checks kept experts)
        data = torch.randint(0, 256, (s.nbytes,), dtype=torch.uint8, generator=g)
        w.write(s.name, (data % 8 + 120 if s.name.endswith("weight_scale") else data).numpy())
    src = w.close(config)
    p = make_plan(config=config, criterion="random", keep=5)
    r = prune(model=src, plan=p, out=str(tmp_path / "out"))
    size = SizeModel.from_config(config)
    assert r.predicted_bytes == size.predict_bytes(5)
    assert abs(r.file_bytes - r.predicted_bytes) <= 0.001 * r.predicted_bytes
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    data = size.fixed_bytes + sum(size.expert_bytes[la] * 5 for la in size.moe_layers)
    assert index["metadata"]["total_size"] == data


def test_prune_knows_no_family_and_imports_no_later_stage():
    import ast

    later = ("reap.engine", "reap.eval", "reap.models.kimi_k3.family", "reap.models.shared.blocks")
    pattern = re.compile(r"block_sparse_moe|e_score|weight_packed|language_model|kimi|\.experts\.")
    for f in sorted((Path(__file__).parent.parent / "reap" / "prune").glob("*.py")):
        text = f.read_text()
        assert not pattern.search(text), f
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                )
                assert not [m for m in mods if m.startswith(later)], (f, mods)
