"""Architecture rules that review would otherwise have to catch: data flows one way
(corpora -> calibrate -> analyze -> prune -> engine -> eval, with serve on top of engine), the
shared layers import no stage, and no code outside reap/models names a model family."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "reap"
# serve (the OpenAI server) sits on the engine beside eval: neither engine nor eval imports it
STAGES = ["corpora", "calibrate", "analyze", "prune", "engine", "eval", "serve"]
SHARED = {"checkpoint", "mxfp4", "models", "stats", "sizes", "tokenizer", "synth", "errors",
          "fileio", "provenance", "defaults"}


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {n.split(".")[1] for n in names if n.startswith("reap.") and n.count(".") >= 1}


def _unit(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0].removesuffix(".py")


def test_stages_never_import_later_stages():
    bad = []
    for path in ROOT.rglob("*.py"):
        unit = _unit(path)
        for dep in _imports(path):
            if unit in STAGES and dep in STAGES and STAGES.index(dep) > STAGES.index(unit):
                bad.append(f"{path.relative_to(ROOT)} imports reap.{dep}")
            if unit in SHARED and dep in STAGES:
                bad.append(f"{path.relative_to(ROOT)} (shared) imports stage reap.{dep}")
    assert not bad, "\n".join(bad)


def test_family_names_stay_in_models():
    bad = []
    for path in ROOT.rglob("*.py"):
        if _unit(path) in {"models", "synth", "cli"}:
            continue
        text = path.read_text()
        for needle in ("kimi_k3", "KimiK3", "block_sparse_moe"):
            if needle in text:
                bad.append(f"{path.relative_to(ROOT)} mentions {needle}")
    assert not bad, "\n".join(bad)


def test_engine_has_no_serving_code():
    """Serving lives in reap/serve: the engine neither runs an HTTP server nor formats chats,
    and chat markers are declared by the families (reap/models), never spelled elsewhere."""
    bad = []
    for path in (ROOT / "engine").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            bad += [f"{path.relative_to(ROOT)} imports {n}" for n in names
                    if n.split(".")[0] in {"socketserver", "wsgiref", "jinja2"}
                    or n == "http.server"]
    for path in ROOT.rglob("*.py"):
        if _unit(path) != "models" and "<|im_" in path.read_text():
            bad.append(f"{path.relative_to(ROOT)} spells a chat marker (<|im_...|>)")
    assert not bad, "\n".join(bad)
