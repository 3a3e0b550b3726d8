"""Architecture rules that review would otherwise have to catch: data flows one way
(corpora -> calibrate -> analyze -> prune -> engine -> eval, with serve on top of engine), the
shared layers import no stage, and no code outside reap/models names a model family."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "reap"
# serve (the OpenAI server) sits on the engine beside eval: neither engine nor eval imports it;
# distributed (Ray) runs calibrate and eval, so it sits above them all and none imports it
STAGES = ["corpora", "calibrate", "analyze", "prune", "engine", "eval", "serve", "distributed"]
SHARED = {"checkpoint", "quant", "models", "stats", "sizes", "tokenizer", "synth", "errors",
          "fileio", "provenance", "defaults", "cache", "units", "memstat"}
ENTRY = {"__init__", "cli", "info_cli"}  # the `reap` command and its table sit above everything


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


# ---- issue 13, prune/eval/experiments: single-job modules, CLIs in cli.py, studies as packages


SINGLE_JOB = ["prune", "eval"]  # stages whose modules already follow the rules below
REPO = ROOT.parent


def _modules(units: list[str]) -> list[pathlib.Path]:
    return sorted(p for u in units for p in (ROOT / u).rglob("*.py"))


def test_single_job_modules_are_small_documented_and_keep_argparse_in_cli():
    bad = []
    for path in _modules(SINGLE_JOB):
        rel, text = path.relative_to(ROOT), path.read_text()
        if len(text.splitlines()) >= 400:
            bad.append(f"{rel}: {len(text.splitlines())} lines (budget: under 400)")
        if ast.get_docstring(ast.parse(text)) is None:
            bad.append(f"{rel}: no module docstring")
        if path.name != "cli.py" and "argparse" in _imported_modules(path):
            bad.append(f"{rel}: parses arguments outside its package's cli.py")
    assert not bad, "\n".join(bad)


def _imported_modules(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _one_letter_aliases(path: pathlib.Path) -> list[str]:
    """What `import x as B` / `from x import y as B` rename: one-letter aliases clash with the
    shape letters of STYLE.md (B, L, E, K, D, F, H, T)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out += [a.name for a in node.names if a.asname and len(a.asname) == 1]
    return out


def test_no_one_letter_module_aliases_in_single_job_stages_and_studies():
    paths = _modules(SINGLE_JOB) + sorted((REPO / "experiments").rglob("*.py"))
    paths += sorted((REPO / "tools").rglob("*.py"))
    bad = [
        f"{p.relative_to(REPO)}: {name} imported under a one-letter alias"
        for p in paths
        for name in _one_letter_aliases(p)
    ]
    assert not bad, "\n".join(bad)


def test_studies_and_builds_are_importable_without_sys_path_edits():
    bad = [
        f"{p.relative_to(REPO)} edits sys.path"
        for folder in ("experiments", "tools")
        for p in sorted((REPO / folder).rglob("*.py"))
        if "sys.path" in p.read_text()
    ]
    assert not bad, "\n".join(bad)
    for package in ("experiments", "experiments/corpus_study", "tools"):
        assert (REPO / package / "__init__.py").is_file(), f"{package} is not a package"
    assert (REPO / "experiments/corpus_study/__main__.py").is_file()


def test_every_benchmark_records_its_code_version():
    benches = sorted((REPO / "experiments").glob("bench_*.py"))
    assert benches
    for path in benches:
        text = path.read_text()
        assert "from reap.provenance import code_version" in text, path.name
        assert '"code_version": code_version()' in text, path.name


def _code_strings_and_calls(path: pathlib.Path):
    """(string constants that are not docstrings, (callee dotted name, first string arg)) of a
    module, for the rules below."""
    tree = ast.parse(path.read_text())
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
               and isinstance(n.value, str) and id(n) not in docstrings]
    calls = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            owner = n.func.value.id if isinstance(n.func.value, ast.Name) else ""
            first = n.args[0].value if n.args and isinstance(n.args[0], ast.Constant) else None
            calls.append((f"{owner}.{n.func.attr}", first))
    return strings, calls


def test_only_checkpoint_knows_the_safetensors_header():
    """Building or parsing a safetensors header (its u64 length prefix, `__metadata__`,
    `data_offsets`) happens in reap/checkpoint/ only: everyone else asks it."""
    bad = []
    for path in ROOT.rglob("*.py"):
        if _unit(path) == "checkpoint":
            continue
        strings, calls = _code_strings_and_calls(path)
        for s in strings:
            if "__metadata__" in s or "data_offsets" in s:
                bad.append(f"{path.relative_to(ROOT)} names {s!r}")
        for name, first in calls:
            if name.startswith("struct.") and isinstance(first, str) and "Q" in first:
                bad.append(f"{path.relative_to(ROOT)} packs a u64 with {name}({first!r})")
    assert not bad, "\n".join(bad)


def test_files_are_renamed_into_place_only_by_fileio():
    """Every atomic write goes through reap/fileio.py: no os.replace / os.rename / .rename()
    elsewhere."""
    bad = []
    for path in ROOT.rglob("*.py"):
        if path == ROOT / "fileio.py":
            continue
        _, calls = _code_strings_and_calls(path)
        for name, _ in calls:
            if name in ("os.replace", "os.rename", "os.renames", "shutil.move") or (
                name.endswith(".rename")
            ):
                bad.append(f"{path.relative_to(ROOT)} calls {name}")
    assert not bad, "\n".join(bad)


# ---- issue 13, quant: one quantization package, no tensor impostor


def test_no_object_imitates_a_tensor():
    """Quantized weights are typed records (`reap.quant.matrix`) that `blocks.linear` applies,
    never stand-ins that intercept torch calls."""
    bad = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
           if "__torch_function__" in p.read_text()]
    assert not bad, "\n".join(bad)


def test_quant_stands_alone_and_the_expert_path_names_no_quantized_tensor():
    """`reap.quant` imports no stage and no model family; the engine's expert path asks the
    family (`expert_matrices`) which tensors form a quantized matrix instead of matching names."""
    bad = []
    for path in (ROOT / "quant").rglob("*.py"):
        bad += [f"{path.relative_to(ROOT)} imports reap.{d}" for d in _imports(path)
                if d in STAGES or d == "models"]
    for name in ("engine/experts.py", "engine/core.py"):
        text = (ROOT / name).read_text()
        bad += [f"{name} names {s}" for s in ("_packed", "_scale", "_blocks") if s in text]
    assert not bad, "\n".join(bad)


# -- the family contract (issue 13): stages ask the family, never read its config or names ------
# keys every family reads the same way, or that the contract itself declares (Config.torch_dtype)
GENERIC_KEYS = {"dtype", "torch_dtype", "model_type", "vocab_size"}
EXPERT_SUFFIXES = ("_packed", "_scale", "weight_scale_inv", "_blocks", "_scales")


def _family_keys() -> set[str]:
    import dataclasses
    import importlib

    from reap.models import FAMILIES

    keys = set()
    for module in set(FAMILIES.values()):
        keys |= {f.name for f in dataclasses.fields(importlib.import_module(module).Config)}
    return keys - GENERIC_KEYS


def _outside_families():
    """(relative path, parsed tree) of every module outside models/, checkpoint/ and quant/."""
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] not in {"models", "checkpoint", "quant"}:
            yield rel.as_posix(), ast.parse(path.read_text())


def _docstrings(tree) -> set[int]:
    kinds = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, kinds) and ast.get_docstring(node, clean=False) is not None
    }


def test_family_config_keys_and_expert_suffixes_stay_in_models():
    keys, bad = _family_keys(), []
    assert {"attn_res_block_size", "num_experts_per_token", "first_k_dense_replace"} <= keys
    for rel, tree in _outside_families():
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Attribute):
                name = node.attr
            elif isinstance(node, ast.keyword):
                name = node.arg
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                name = node.value
                suffix = id(node) not in docs and node.value.endswith(EXPERT_SUFFIXES)
                if suffix:
                    bad.append(f"{rel}:{node.lineno} names expert tensor suffix {node.value!r}")
            if name in keys:
                bad.append(f"{rel}:{node.lineno} reads family config key {name!r}")
    assert not bad, "\n".join(bad)


def test_no_getattr_on_a_family_outside_models():
    bad = []
    for rel, tree in _outside_families():
        for node in ast.walk(tree):
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            if call and node.func.id in {"getattr", "hasattr"} and node.args:
                target = ast.unparse(node.args[0])
                last = target.split(".")[-1]  # the model's hooks are the family's contract too
                if last in {"fam", "family", "cfg", "model"} or "family(" in target:
                    bad.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    assert not bad, "\n".join(bad)


def test_family_modules_are_checked_against_the_contract_once():
    """Every registered family implements the contract; a module missing a hook, or taking other
    arguments, or whose Model is not a LayerModel (the compiled-decode hooks `native_layer` and
    `native_head` among its members), is refused when `family()` first loads it."""
    import sys
    import types

    import pytest

    from reap.models import FAMILIES, family, load_family
    from reap.models.base import family_hooks

    assert {"layout", "expert_tensor_names", "top_k", "state_bytes", "calibration_widths"} <= set(
        family_hooks()
    )
    for module in set(FAMILIES.values()):
        assert load_family(module).__name__ == module
    from reap.models import qwen3_moe

    broken = types.ModuleType("reap_test_broken_family")
    broken.__dict__.update({k: v for k, v in vars(qwen3_moe).items() if not k.startswith("__")})
    del broken.state_bytes
    broken.top_k = lambda: 1
    sys.modules[broken.__name__] = broken
    FAMILIES["reap_test_broken"] = broken.__name__
    try:
        with pytest.raises(TypeError, match=r"top_k\(\) cannot be called") as refused:
            family({"model_type": "reap_test_broken"})
        assert "state_bytes() is missing" in str(refused.value)
        broken.Model, broken.top_k = object, vars(qwen3_moe)["top_k"]  # no LayerModel hooks
        with pytest.raises(TypeError, match="Model is missing or not a LayerModel"):
            family({"model_type": "reap_test_broken"})
    finally:
        del FAMILIES["reap_test_broken"], sys.modules[broken.__name__]


# ---- issue 13, names: shared helpers, the corpus builder apart, one definition per name


def _reap_imports(path: pathlib.Path) -> set[str]:
    """Full names of the reap modules a file imports (anywhere in it, lazily or not)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return {n for n in names if n.startswith("reap.")}


def test_byte_units_and_memory_readings_import_no_stage():
    bad = [f"{name} imports {dep}" for name in ("units.py", "memstat.py")
           for dep in _reap_imports(ROOT / name) if dep.split(".")[1] in STAGES]
    assert not bad, "\n".join(bad)


def test_corpus_builder_stays_out_of_runtime_code():
    """Sampling, calibration and evaluation never import the Debian/PyPI corpus builder; only
    the builder itself and the `reap corpora` CLI do."""
    bad = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("corpora/builder/") or rel == "corpora/cli.py":
            continue
        bad += [f"{rel} imports {m}" for m in _reap_imports(path)
                if m.startswith("reap.corpora.builder")]
    assert not bad, "\n".join(bad)


def test_colliding_names_are_defined_once():
    """Names that two modules used to define differently (memory plans, sequences, corpus
    records, code versions, byte parsers and formatters, RSS readers) have one definition."""
    names = {"MemoryPlan", "BatchPlan", "plan_memory", "make_plan", "Sequence", "SequenceState",
             "SampledSequence", "CorpusInfo", "InputCorpus", "code_version", "parse_bytes",
             "parse_size", "format_bytes", "fmt_bytes", "current_rss", "peak_rss", "rss_bytes"}
    where: dict[str, list[str]] = {}
    for path in ROOT.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in names:
                where.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twice, twice
    assert not {p.stem for p in ROOT.rglob("metrics.py")}, "a module named just `metrics`"


def test_statistics_fields_are_declared_once():
    """The expert statistics fields are declared in `reap.stats.ExpertSums` only: no other class
    lists them as fields and no dict spells them out."""
    fields = {"gate_sum", "reap_sum", "reap_latent_sum", "ean_sum", "ean_latent_sum",
              "prob_mass", "coact"}
    bad = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                declared = {s.target.id for s in node.body
                            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
                if len(declared & fields) > 2 and not (rel == "stats/__init__.py"
                                                       and node.name == "ExpertSums"):
                    bad.append(f"{rel}: class {node.name} declares statistics fields")
            elif isinstance(node, ast.Dict):
                keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
                if len(keys & fields) > 2:
                    bad.append(f"{rel}:{node.lineno}: a dict lists statistics fields")
    assert not bad, "\n".join(bad)


def test_classes_declare_their_fields():
    """No class fills its attributes from `**kw` (`self.__dict__.update`): fields are declared."""
    bad = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
           if "self.__dict__.update(" in p.read_text()]
    assert not bad, bad


# ---- issue 30: every unit placed, no import circle, no private reach-in, sizes


def test_every_unit_is_placed_in_the_rules():
    units = {_unit(p) for p in ROOT.rglob("*.py")}
    assert not units - set(STAGES) - SHARED - ENTRY, units - set(STAGES) - SHARED - ENTRY


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """reap module -> the reap modules it imports, anywhere in it (lazily too), except under
    `if TYPE_CHECKING:`; `from reap.p import m` counts as importing module reap.p.m when it is
    one, else reap.p (a package's own parents, imported implicitly, do not count)."""
    mods = {_module_name(p): p for p in ROOT.rglob("*.py")}

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in mods.items():
        tree, deps = ast.parse(path.read_text()), set()
        typing_only = {id(x) for n in ast.walk(tree) if isinstance(n, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(n.test)
                       for b in n.body for x in ast.walk(b)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                deps |= {owner(a.name) for a in node.names if a.name.startswith("reap")}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("reap"):
                assert node.level == 0, f"{path}: relative import"
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods
                         else owner(node.module) for a in node.names}
        graph[name] = deps - {None, name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while not comp or comp[-1] != v:
                    comp.append(stack.pop())
                    on.discard(comp[-1])
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circles():
    """No module reaches itself through imports, lazy ones included: a circle means two modules
    are one design split in two, and which one finishes importing first depends on the caller."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = _import_graph()
    circles = [f"{' <-> '.join(c)}: " + "; ".join(
        f"{m} imports {', '.join(sorted(graph[m] & set(c)))}" for m in c)
        for c in _circles(graph)]
    assert not circles, "\n".join(circles)


def test_no_private_names_across_packages():
    """`from reap.X import _name` and `module._name` stay inside X's own package: what another
    package needs is public (and typed)."""
    bad = []
    for path in ROOT.rglob("*.py"):
        unit, rel, modules = _unit(path), path.relative_to(ROOT), {}
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("reap."):
                for a in node.names:
                    modules[a.asname or a.name] = f"{node.module}.{a.name}"
                    if a.name.startswith("_") and node.module.split(".")[1] != unit:
                        bad.append(f"{rel}:{node.lineno} imports {node.module}.{a.name}")
            elif isinstance(node, ast.Import):
                modules |= {a.asname or a.name: a.name for a in node.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not (
                    node.attr.startswith("__")):
                full = modules.get(ast.unparse(node.value), "")
                if full.startswith("reap.") and full.split(".")[1] != unit:
                    bad.append(f"{rel}:{node.lineno} reads {full}.{node.attr}")
    assert not bad, "\n".join(bad)


def test_text_config_stays_in_models():
    """The multimodal releases' `text_config` wrapper is a release-format detail: the families
    answer it (`reap.models.validate.text_of`), nobody else spells it."""
    bad = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
           if _unit(p) != "models" and "text_config" in p.read_text()]
    assert not bad, bad


def test_files_and_functions_are_small():
    """Every library file under 400 lines, every function at most 60."""
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel, text = path.relative_to(ROOT), path.read_text()
        if len(text.splitlines()) >= 400:
            bad.append(f"{rel}: {len(text.splitlines())} lines")
        functions = [n for n in ast.walk(ast.parse(text))
                     if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        bad += [f"{rel}:{n.lineno} {n.name}: {n.end_lineno - n.lineno + 1} lines"
                for n in functions if n.end_lineno - n.lineno + 1 > 60]
    assert not bad, "\n".join(bad)
