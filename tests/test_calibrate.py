"""Calibration: accumulation, spill store, streamed vs brute-force statistics, I/O, resume, merge,
bad input. Everything runs on k3-tiny checkpoints synthesized once per session (seconds)."""

from __future__ import annotations

import torch

from reap.calibrate.accumulate import StatsAccumulator
from reap.calibrate.spill import SpillStore, flatten, unflatten
from reap.models.base import MoERecord, State


# -- naive per-token reference for the accumulator ---------------------------------------------
def naive_rows(records, spans, seq_corpus, seq_len, E, n_corpora):
    """Per (layer, corpus) dict of statistics from plain Python loops over tokens."""
    local, sizes = [], [0] * n_corpora
    for c in seq_corpus:
        local.append(sizes[c])
        sizes[c] += 1
    out = {}
    for rec, (s0, s1) in zip(records, spans):
        for c in range(n_corpora):
            out.setdefault((rec.layer, c), {
                "count": [0] * E, "gate_sum": [0.0] * E, "reap_sum": [0.0] * E,
                "reap_latent_sum": [0.0] * E, "ean_sum": [0.0] * E, "ean_latent_sum": [0.0] * E,
                "max_act": [0.0] * E, "prob_mass": [0.0] * E,
                "coact": [[0] * E for _ in range(E)], "seq_count": [[0] * E for _ in range(sizes[c])]})
        for n in range(rec.ids.shape[0]):
            s = s0 + n // seq_len
            r = out[(rec.layer, seq_corpus[s])]
            ids = rec.ids[n].tolist()
            for k, e in enumerate(ids):
                w = float(rec.weights[n, k])
                mn, ln = float(rec.model_norm[n, k]), float(rec.latent_norm[n, k])
                r["count"][e] += 1
                r["gate_sum"][e] += w
                r["reap_sum"][e] += w * mn
                r["reap_latent_sum"][e] += w * ln
                r["ean_sum"][e] += mn
                r["ean_latent_sum"][e] += ln
                r["max_act"][e] = max(r["max_act"][e], float(rec.max_act[n, k]))
                r["seq_count"][local[s]][e] += 1
                for f in ids:
                    r["coact"][e][f] += 1
            for e in range(E):
                r["prob_mass"][e] += float(rec.probs[n, e])
    return out


def random_record(layer, n, E, K, gen):
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(n)])
    f = lambda *s: torch.rand(*s, generator=gen)  # noqa: E731
    return MoERecord(layer, ids, f(n, K), f(n, E), f(n, K), f(n, K), f(n, K) * 5)


def test_accumulator_matches_per_token_loops():
    gen = torch.Generator().manual_seed(1)
    E, K, T = 7, 3, 5
    seq_corpus = [0, 1, 1, 0, 2, 1]
    spans = [(0, 4), (4, 6), (0, 2), (2, 6)]
    records = [random_record(layer, (s1 - s0) * T, E, K, gen)
               for layer, (s0, s1) in zip([3, 3, 5, 5], spans)]
    acc = StatsAccumulator(E, K, seq_corpus, T, n_corpora=3)
    for rec, (s0, s1) in zip(records, spans):
        acc.span(s0, s1)
        acc.on_moe(rec)
    ref = naive_rows(records, spans, seq_corpus, T, E, 3)
    for (layer, c), want in ref.items():
        got = acc.layer(layer)[c].tensors()
        for name, v in want.items():
            exact = name in ("count", "coact", "seq_count")
            torch.testing.assert_close(got[name].double(), torch.tensor(v, dtype=torch.float64),
                                       rtol=0 if exact else 1e-6, atol=0 if exact else 1e-6,
                                       msg=f"{name} layer {layer} corpus {c}")
    # co-activation: diagonal = count, symmetric
    row = acc.layer(3)[1]
    assert torch.equal(row.coact.diagonal(), row.count) and torch.equal(row.coact, row.coact.T)


# -- spill store --------------------------------------------------------------------------------
def test_flatten_roundtrip_and_spill_generations(tmp_path):
    st = State(torch.randn(3, 4, 2), [torch.randn(3, 4, 2), torch.randn(3, 4, 2)])
    flat, spec = flatten(st)
    assert sorted(flat) == ["blocks.0", "blocks.1", "hidden"]
    back = unflatten(spec, flat)
    assert isinstance(back, State) and back.blocks[1] is st.blocks[1]

    store = SpillStore(str(tmp_path), n_seq=3)
    for k, v in flat.items():
        store.write(k, 0, v[:2], "g0")
        store.write(k, 2, v[2:], "g0")
    store.commit()
    for k, v in flat.items():
        assert torch.equal(store.read(k, 1, 3), v[1:3])
    new = torch.randn(3, 4, 2)
    store.write("hidden", 0, new, "g1")
    assert torch.equal(store.read("hidden", 0, 3), flat["hidden"])  # pending is invisible
    store.commit()
    man = store.manifest()
    store.cleanup()
    store.close()
    again = SpillStore.from_manifest(str(tmp_path), 3, man)
    assert torch.equal(again.read("hidden", 0, 3), new)
    assert torch.equal(again.read("blocks.1", 0, 3), flat["blocks.1"])
    assert len(list(tmp_path.glob("*.bin"))) == 3  # the superseded hidden file is gone
    again.close()
