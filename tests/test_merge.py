"""Expert merging (HC-SMoE, M-SMoE): `reap calibrate --merge-stats` -> `reap plan --method` ->
`reap prune` -> `reap verify` -> engine, against a naive in-memory implementation of each paper's
equations on a tiny transformers-saved Qwen3-MoE (forward hooks, every expert on the full weight
tensors), and on a K3-layout model with MXFP4 experts."""

import json
from pathlib import Path

import family_runner as R
import numpy as np
import pytest
import torch

from reap.cli import main

QWEN, TOKENS, SEQ = R.MERGE_QWEN, R.MERGE_TOKENS, R.MERGE_SEQ
SAMPLE, KEEP = 32, 5


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(root, model path, transformers model, statistics dir, the calibration ids [S, T])."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from reap.corpora import calibration_sequences
    from reap.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("merge")
    path, hf = R.save_hf_tiny(Qwen3MoeForCausalLM, Qwen3MoeConfig, QWEN, root / "m", seed=3)
    spec = R.write_corpora(root / "corpora")
    stats = root / "stats"
    assert main([
        "calibrate", path, "--corpus", spec, "--tokens", str(TOKENS), "--seq-len", str(SEQ),
        "--out", str(stats), "--merge-stats", str(SAMPLE), "--no-progress",
    ]) == 0  # fmt: skip
    seqs = calibration_sequences(spec, load_tokenizer(path), TOKENS, SEQ, 0)
    return root, path, hf, stats, torch.tensor([s.ids for s in seqs])


def naive_layers(hf, ids) -> dict:
    """Per MoE layer, from one transformers forward with hooks: the experts module's input x
    [N, D], routed ids [N, K] and the softmax router probabilities [N, E]."""
    seen, handles = {}, []
    for layer, router, experts in R.moe_modules(hf):
        rec = seen.setdefault(layer, {"experts": experts})
        handles.append(router.register_forward_hook(
            lambda m, a, out, rec=rec: rec.update(probs=R.softmax_probs(out).double())))
        handles.append(experts.register_forward_pre_hook(
            lambda m, a, kw, rec=rec: rec.update(x=(list(a) + list(kw.values()))[0],
                                                 ids=(list(a) + list(kw.values()))[1]),
            with_kwargs=True))
    with torch.no_grad():
        hf(input_ids=ids)
    for h in handles:
        h.remove()
    return seen


def expert_weights(experts, e: int) -> dict:
    """Expert e's gate [F, D], up [F, D] and down [D, F] from the fused transformers module."""
    gate, up = experts.gate_up_proj[e].detach().double().chunk(2, dim=0)
    return {"gate_proj": gate, "up_proj": up, "down_proj": experts.down_proj[e].detach().double()}


def frequency_groups(labels, count) -> list[list]:
    """Groups [[expert, weight], ...]: the most frequent member first (ties: lowest id), then
    ascending; weights count / sum (equal if never routed)."""
    out = []
    for label in sorted(set(labels)):
        ids = [e for e, lab in enumerate(labels) if lab == label]
        dom = min(ids, key=lambda e: (-count[e], e))
        ids = [dom] + [e for e in ids if e != dom]
        total = sum(count[e] for e in ids)
        out.append([[e, count[e] / total if total else 1 / len(ids)] for e in ids])
    return sorted(out, key=lambda g: g[0][0])


def naive_hc_smoe(rec, n: int) -> list[list]:
    """HC-SMoE: each expert's mean output over the sampled tokens (every TOKENS // SAMPLE-th
    calibration token, routed or not), average-linkage Euclidean clustering into n groups."""
    from scipy.cluster.hierarchy import fcluster, linkage

    x = rec["x"].reshape(-1, rec["x"].shape[-1])
    stride = TOKENS // SAMPLE
    xs = x[torch.arange(0, x.shape[0], stride)]
    reps = []
    with torch.no_grad():
        for e in range(QWEN["num_experts"]):
            reps.append(R.expert_output(rec["experts"], xs, e).double().mean(0))
    tree = linkage(torch.stack(reps).numpy(), method="average", metric="euclidean")
    labels = fcluster(tree, t=n, criterion="maxclust")
    count = torch.bincount(rec["ids"].reshape(-1), minlength=QWEN["num_experts"]).tolist()
    return frequency_groups(labels.tolist(), count)


def naive_m_smoe(rec, n: int) -> list[list]:
    """M-SMoE: the n most frequent experts dominant; each other expert to the dominant one whose
    router-score column over all tokens has the largest cosine with its own."""
    E = QWEN["num_experts"]
    count = torch.bincount(rec["ids"].reshape(-1), minlength=E).tolist()
    dominant = sorted(sorted(range(E), key=lambda e: (-count[e], e))[:n])
    p = rec["probs"]
    labels = []
    for e in range(E):
        if e in dominant:
            labels.append(e)
            continue
        cos = [float(torch.nn.functional.cosine_similarity(p[:, e], p[:, d], dim=0))
               for d in dominant]
        labels.append(dominant[int(np.argmax(cos))])
    return frequency_groups(labels, count)


def naive_merge(experts, group, align: bool) -> dict:
    """Frequency-weighted average of the group's weights; with `align`, each member's neurons
    first permuted to the first (dominant) member's by linear assignment on the squared
    distances of [gate row, up row, down column]."""
    from scipy.optimize import linear_sum_assignment

    dom = expert_weights(experts, group[0][0])
    out = {k: v * group[0][1] for k, v in dom.items()}
    for e, w in group[1:]:
        m = expert_weights(experts, e)
        if align:
            feats = lambda t: torch.cat([t["gate_proj"], t["up_proj"], t["down_proj"].T], 1)
            cost = torch.cdist(feats(m), feats(dom)) ** 2
            rows, cols = linear_sum_assignment(cost.numpy())
            perm = np.empty_like(cols)
            perm[cols] = rows  # dominant neuron j <- member neuron perm[j]
            m = {"gate_proj": m["gate_proj"][perm], "up_proj": m["up_proj"][perm],
                 "down_proj": m["down_proj"][:, perm]}
        out = {k: out[k] + m[k] * w for k in out}
    return out


def build(qwen, method: str, name: str):
    """plan -> prune -> verify of `method`; returns (plan dict, build path)."""
    root, path, _, stats, _ = qwen
    plan, out = root / f"{name}.json", root / name
    assert main(["plan", str(stats), "--model", path, "--method", method, "--keep", str(KEEP),
                 "--out", str(plan)]) == 0
    assert main(["prune", path, "--plan", str(plan), "--out", str(out), "--no-progress"]) == 0
    from reap.prune.verify import verify

    assert main(["verify", str(out), "--source", path]) == 0
    man = json.loads((out / "reap_manifest.json").read_text())
    groups = [g for v in man["experts"].values() for g in v["sources"]]
    r = verify(pruned=str(out), source=path)  # merged experts are counted apart from kept ones
    assert r.experts == len(groups) and r.merged == sum(len(g) > 1 for g in groups) > 0
    from reap.checkpoint.hub import model_card

    card = model_card(str(out))  # what --push-to uploads says what was merged
    assert f"Experts merged ({method})" in card and "tags: [reap, moe, merged]" in card
    return json.loads(plan.read_text()), out


@pytest.mark.parametrize("method, naive", [("hc-smoe", naive_hc_smoe), ("m-smoe", naive_m_smoe)])
def test_merged_build_equals_the_naive_equations(qwen, method, naive):
    """Same groups and weights as the in-memory reference; every merged expert's tensors equal
    the reference merge within float tolerance; transformers loads the build and gives our
    engine's logits."""
    from reap.checkpoint import Checkpoint

    root, path, hf, _, ids = qwen
    plan, out = build(qwen, method, method)
    recs = naive_layers(hf, ids)
    with Checkpoint.open(str(out)) as ck:
        for layer, rec in recs.items():
            want = naive(rec, KEEP)
            got = plan["merge"]["groups"][str(layer)]
            assert [[e for e, _ in g] for g in got] == [[e for e, _ in g] for g in want]
            np.testing.assert_allclose([w for g in got for _, w in g],
                                       [w for g in want for _, w in g], rtol=1e-9)
            for j, group in enumerate(want):
                ref = naive_merge(rec["experts"], group, align=method == "m-smoe")
                for k, v in ref.items():
                    t = ck.read(f"model.layers.{layer}.mlp.experts.{j}.{k}.weight")
                    torch.testing.assert_close(t.double(), v, rtol=1e-5, atol=1e-6)
    ids12 = [3, 100, 7, 200, 55, 9, 1, 250, 17, 42, 11, 300]
    from reap.engine import Engine

    with torch.no_grad():
        ref = R.load_hf(out)(input_ids=torch.tensor([ids12])).logits[0].numpy()
    with Engine.open(str(out), preset="ultra", context=64, dtype="float32") as eng:
        got = eng.logits([ids12])[0].numpy()
    assert float(np.abs(got - ref).max()) < R.ATOL


def test_manifest_maps_every_output_expert_and_verify_catches_a_tampered_merge(qwen):
    """The manifest names every output expert's sources and weights (the plan's groups, each
    source once) with a re-encoding error (0 for a copied expert); one flipped byte in a merged
    expert fails `verify` naming the tensor (exit 2)."""
    import shutil

    from reap.checkpoint import Checkpoint

    root, path, *_ = qwen
    plan, out = build(qwen, "hc-smoe", "tamper")
    man = json.loads((out / "reap_manifest.json").read_text())
    assert man["merge"]["method"] == "hc-smoe" and "router" in man["merge"]
    merged = None
    for layer, rec in man["experts"].items():
        groups = plan["merge"]["groups"][layer]
        assert rec["sources"] == [[e for e, _ in g] for g in groups]
        assert rec["weights"] == [[w for _, w in g] for g in groups]
        assert rec["original"] == [g[0] for g in rec["sources"]]
        assert sorted(e for g in rec["sources"] for e in g) == list(range(8))
        for j, (src, err) in enumerate(zip(rec["sources"], rec["reencode_error"])):
            assert (err == 0) if len(src) == 1 else (0 <= err < 1e-6)  # float32 stays float32
            merged = merged or (len(src) > 1 and (int(layer), j))
    bad = root / "tampered"
    shutil.copytree(out, bad)
    name = f"model.layers.{merged[0]}.mlp.experts.{merged[1]}.up_proj.weight"
    with Checkpoint.open(str(bad)) as ck:
        info = ck.tensors[name]
        file, start = Path(ck.path) / info.file, info.start
    with open(file, "r+b") as f:
        f.seek(start + 1)
        byte = f.read(1)
        f.seek(start + 1)
        f.write(bytes([byte[0] ^ 0x10]))
    assert main(["verify", str(bad), "--source", path]) == 2


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    """The shipped k3-mini (K3 layout, MXFP4 experts) calibrated with merge statistics."""
    from reap.calibrate.pipeline import calibrate
    from reap.defaults import BUNDLED as K3MINI_DIR

    root = tmp_path_factory.mktemp("k3merge")
    calibrate(model=str(K3MINI_DIR), corpus="code", tokens=128, seq_len=32, out=str(root / "s"),
              merge_stats=16, progress=False)
    return root, str(K3MINI_DIR)


@pytest.mark.parametrize("method", ["hc-smoe", "m-smoe"])
def test_k3_layout_mxfp4_experts_are_merged_in_float32_and_reencoded(k3, method):
    """Merged MXFP4 experts are the MXFP4 encoding of the frequency-weighted average of the
    decoded sources (neurons aligned for m-smoe), within the manifest's re-encoding error; the
    build verifies and the engine runs it."""
    from reap.checkpoint import Checkpoint
    from reap.quant import mxfp4

    root, src = k3
    plan, out = root / f"{method}.json", root / method
    assert main(["plan", str(root / "s"), "--model", src, "--method", method, "--keep", "16",
                 "--out", str(plan)]) == 0
    assert main(["prune", src, "--plan", str(plan), "--out", str(out), "--no-progress"]) == 0
    assert main(["verify", str(out), "--source", src]) == 0
    man = json.loads((out / "reap_manifest.json").read_text())
    layer, rec = next(iter(man["experts"].items()))
    j = next(j for j, s in enumerate(rec["sources"]) if len(s) > 1)
    assert 0 < rec["reencode_error"][j] < 0.2
    prefix = lambda e: f"model.layers.{layer}.block_sparse_moe.experts.{e}.w1.weight_"
    with Checkpoint.open(src) as a, Checkpoint.open(str(out)) as b:
        got = mxfp4.dequantize(b.read(prefix(j) + "packed"), b.read(prefix(j) + "scale"))
        if method == "hc-smoe":  # no alignment: the plain average
            want = sum(w * mxfp4.dequantize(a.read(prefix(e) + "packed"),
                                            a.read(prefix(e) + "scale"))
                       for e, w in zip(rec["sources"][j], rec["weights"][j]))
            assert torch.equal(got, mxfp4.qdq(want))
    assert main(["run", str(out), "--prompt-ids", "1,2,3", "--max-tokens", "4"]) == 0


@pytest.mark.parametrize("block", [[128, 128], [24, 24]])
def test_fp8_experts_are_merged_with_the_configs_block_and_reencoded(tmp_path, block):
    """A DeepSeek-V3 release config (FP8 experts; its 128 x 128 blocks, and 24 x 24 ones that
    split the 32 x 64 expert matrices unevenly), shrunk and synthesized: the merged expert is the
    FP8 encoding, at the config's block, of the weighted average of the decoded sources; the
    build verifies and the engine runs it."""
    from test_synth_releases import RELEASES, _synth, shrink

    from reap.calibrate.pipeline import calibrate
    from reap.checkpoint import Checkpoint
    from reap.quant import fp8

    config = shrink(json.loads((RELEASES / "deepseek-v3" / "config.json").read_text()))
    config["quantization_config"]["weight_block_size"] = block
    block = tuple(block)
    src = _synth(config, tmp_path)
    calibrate(model=src, corpus="code", tokens=128, seq_len=32, out=str(tmp_path / "s"),
              merge_stats=16, progress=False)
    plan, out = tmp_path / "hc.json", tmp_path / "hc"
    assert main(["plan", str(tmp_path / "s"), "--model", src, "--method", "hc-smoe", "--keep",
                 "8", "--out", str(plan)]) == 0
    assert main(["prune", src, "--plan", str(plan), "--out", str(out), "--no-progress"]) == 0
    assert main(["verify", str(out), "--source", src]) == 0
    man = json.loads((out / "reap_manifest.json").read_text())
    layer, rec = next(iter(man["experts"].items()))
    j = next(j for j, s in enumerate(rec["sources"]) if len(s) > 1)
    assert 0 < rec["reencode_error"][j] < 0.2
    name = lambda e: f"model.layers.{layer}.mlp.experts.{e}.gate_proj.weight"
    with Checkpoint.open(src) as a, Checkpoint.open(str(out)) as b:
        got = b.read(name(j)), b.read(name(j) + "_scale_inv")
        want = sum(w * fp8.dequantize(a.read(name(e)), a.read(name(e) + "_scale_inv"), block)
                   for e, w in zip(rec["sources"][j], rec["weights"][j]))
        q, s = fp8.quantize(want, block)
        assert torch.equal(got[0].view(torch.uint8), q.to(got[0].dtype).view(torch.uint8))
        assert torch.equal(got[1], s.to(got[1].dtype))
    assert main(["run", str(out), "--prompt-ids", "1,2,3", "--max-tokens", "4"]) == 0
