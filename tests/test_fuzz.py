"""Fast subset of the input fuzz harness (experiments/fuzz_inputs.py): corrupt inputs must give a
documented exit code with a one-line message, never an internal error, a hang, unbounded memory,
or exit 0 (each input here is invalid by construction, except the unchanged control).

All runs go through the public CLI in one batch driver process (reap imported once), with a hard
per-run timeout and a 4 GB address-space cap, so the whole file takes well under a minute. A case
that still fails on main is marked xfail(strict=True) with its finding: when it is fixed the mark
makes the test fail, and the mark is removed.
"""

import pytest

from experiments import fuzz_inputs

TIMEOUT_S = 20.0  # per run; a valid run takes well under 2 s here

# (case/command) -> None when it holds on main, else the finding (the xfail reason).
CASES: dict[str, str | None] = {}


def _xfail(key: str, finding: str | None):
    if finding is None:
        return key
    return pytest.param(key, marks=pytest.mark.xfail(strict=True, reason=f"issue 18: {finding}"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    work = tmp_path_factory.mktemp("fuzz")
    _, records = fuzz_inputs.execute(fuzz_inputs.all_cases(seed=0, n_flips=3), work, seed=0,
                                     timeout=TIMEOUT_S, keys=set(CASES))
    return {r["key"]: r for r in records}


@pytest.mark.parametrize("key", [_xfail(k, v) for k, v in CASES.items()])
def test_bad_input_is_refused_cleanly(results, key):
    rec = results[key]
    assert rec["verdict"] == "clean", f"{key}: {rec['verdict']} (exit {rec['rc']}): {rec['line']} {rec['note']}"
