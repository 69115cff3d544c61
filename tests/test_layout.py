"""The package's layout stays true: no import circle, layers import downwards, small files.

Imports are read with `ast` from every module of the package: at module level and inside
functions, absolute and relative, `TYPE_CHECKING` blocks included for the circle check. The
layers, bottom to top (docs/architecture.md):
store < spec < machine < run < judge < report < session < the pytest face (top-level modules,
integrations/). `workload/` and `engines/` are the reference jobs, run in their own processes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pytest_rlkernel_matrix

PKG = "pytest_rlkernel_matrix"
ROOT = Path(pytest_rlkernel_matrix.__file__).parent
LAYERS = ("store", "spec", "machine", "run", "judge", "report", "session")
MAX_TOP_LEVEL = 12
MAX_LINES = 700


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module(p): p for p in ROOT.rglob("*.py")}


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"))


def imports(module: str) -> list[tuple[str, bool]]:
    """(imported package module, only for type checking) for every import in `module`."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    typing_only = {id(sub) for node in ast.walk(tree) if _type_checking(node)
                   for stmt in node.body for sub in ast.walk(stmt)}
    out = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target, *(f"{target}.{a.name}" for a in node.names)]
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.append((name, id(node) in typing_only))
    return out


GRAPH = {m: imports(m) for m in MODULES}


def _circles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    adj = {m: sorted({d for d, _ in deps}) for m, deps in GRAPH.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for start in adj:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on.add(v)
            for j in range(i, len(adj[v])):
                w = adj[v][j]
                if w not in index:
                    work.append((v, j + 1))
                    work.append((w, 0))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[v])
    return out


def test_the_import_graph_is_read() -> None:
    # a sanity check of the reader itself: known edges, module level and inside functions
    assert ("pytest_rlkernel_matrix.judge.read.evidence", False) in GRAPH[f"{PKG}.report.record"]
    assert any(d == f"{PKG}.session" for d, _ in GRAPH[f"{PKG}.plugin"])  # inside a function
    assert (f"{PKG}.workload.weights", False) in GRAPH[f"{PKG}.workload.kernels.side"]


def test_no_import_circle() -> None:
    assert _circles() == []


def test_layers_import_downwards() -> None:
    """A layer imports only layers below it (type-only imports excepted); workload/engines never
    import the harness except the machine probe's helpers."""
    wrong = []
    for module, deps in GRAPH.items():
        layer = module.split(".")[1] if module.count(".") >= 1 else ""
        for dep, typing_only in deps:
            dep_layer = dep.split(".")[1] if dep.count(".") >= 1 else ""
            outside = dep_layer not in LAYERS and dep != PKG
            above = dep_layer in LAYERS and layer in LAYERS and (
                LAYERS.index(dep_layer) > LAYERS.index(layer))
            if layer in LAYERS and not typing_only and (outside or above):
                wrong.append(f"{module} -> {dep}")
            if layer in ("workload", "engines") and dep_layer not in (
                    "workload", "engines", "machine", ""):
                wrong.append(f"{module} -> {dep}")
    assert wrong == []


def test_top_level_is_small_and_files_are_short() -> None:
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, top
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}


def test_every_subpackage_says_what_it_owns() -> None:
    for init in sorted(ROOT.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        assert doc and len(doc) > 40, f"{init}: no docstring saying what it owns"
    for layer in LAYERS:
        doc = ast.get_docstring(ast.parse((ROOT / layer / "__init__.py").read_text()))
        assert doc is not None and "May import" in doc, layer


def test_old_import_paths_work_for_one_release_with_a_warning() -> None:
    import subprocess
    import sys

    code = ("import warnings; warnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    from pytest_rlkernel_matrix.report import analyze_run, write_json_atomic\n"
            "from pytest_rlkernel_matrix.store.atomic import write_json_atomic as w2\n"
            "assert write_json_atomic is w2\n"
            "print(sorted({str(w.message).split()[0] for w in seen\n"
            "              if w.category is DeprecationWarning}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == str(sorted([
        "pytest_rlkernel_matrix.report.analyze_run",
        "pytest_rlkernel_matrix.report.write_json_atomic"]))


JUDGE = f"{PKG}.judge"
VALIDITY = ("route", "semantic", "numeric", "performance", "reproducibility")


def _judge_part(module: str) -> str | None:
    """The judge's part a module belongs to: read, a layer, localise, findings, decide, None."""
    if not module.startswith(JUDGE + "."):
        return None
    return module[len(JUDGE) + 1:].split(".")[0]


def test_the_judge_is_organised_by_the_five_validity_layers() -> None:
    for part in ("read", *VALIDITY, "localise"):
        doc = ast.get_docstring(ast.parse((ROOT / "judge" / part / "__init__.py").read_text()))
        assert doc is not None and "May import" in doc and "Owns" in doc, part
    assert sorted(p.name for p in (ROOT / "judge").glob("*.py")) == [
        "__init__.py", "decide.py", "findings.py"]


def test_judge_imports_run_one_way() -> None:
    """read/ imports no layer; a layer (and localise/) imports only read/, findings and its own
    modules of the judge, never another layer; findings imports nothing of the package;
    decide imports the layers."""
    wrong = []
    for module, deps in GRAPH.items():
        part = _judge_part(module)
        if part is None or module == JUDGE:
            continue
        for dep, _typing_only in deps:
            dep_part = _judge_part(dep)
            if part == "findings" and dep.startswith(PKG + "."):
                wrong.append(f"{module} -> {dep}")
            if dep_part is None or dep_part == part:
                continue
            if part == "read" or (part in (*VALIDITY, "localise")
                                  and dep_part not in ("read", "findings")):
                wrong.append(f"{module} -> {dep}")
    assert wrong == []
    decide = {d for d, _ in GRAPH[f"{JUDGE}.decide"]}
    assert all(any(d.startswith(f"{JUDGE}.{layer}.") for d in decide) for layer in
               ("route", "semantic", "numeric", "performance", "reproducibility"))


def test_decide_reads_no_file() -> None:
    source = (ROOT / "judge" / "decide.py").read_text()
    assert "open(" not in source and "read_bytes" not in source and "read_text" not in source
    assert not any(d.startswith(f"{PKG}.store") for d, _ in GRAPH[f"{JUDGE}.decide"])


def test_the_bootstrap_of_steps_draws_as_stats_does() -> None:
    from pytest_rlkernel_matrix.judge.performance import stats
    from pytest_rlkernel_matrix.judge.reproducibility import steps

    assert (steps.RESAMPLES, steps.SEED) == (stats.RESAMPLES, stats.SEED)


@pytest.mark.parametrize("gone", ["verdict", "evidence"])
def test_the_top_level_shims_are_gone(gone: str) -> None:
    assert not (ROOT / f"{gone}.py").exists()
    with pytest.raises(ModuleNotFoundError):
        __import__(f"{PKG}.{gone}")


# What reads a file or looks at the file system: a validity layer and decide take typed objects
# from `judge.read` and return findings; they never call any of these.
_FILE_CALLS = {"open", "read_text", "read_bytes", "write_text", "write_bytes", "load", "iterdir",
               "glob", "rglob", "exists", "is_file", "is_dir", "is_symlink", "stat", "lstat",
               "samefile", "resolve", "readlink", "scandir", "listdir", "walk", "fromfile",
               "memmap", "loadtxt", "genfromtxt", "read_measurement"}
_FILE_MODULES = ("os", "io", "shutil", "glob", "pickle", "mmap", "pathlib", f"{PKG}.store")


def file_reads(module: str) -> list[str]:
    """Where `module` reads a file: calls named in `_FILE_CALLS` (`open(`, `x.read_text(`,
    `json.load(`, `torch.load(`, `np.load(`, `Path(...).open(` ...), and imports of the
    package's file readers (`store.safeio`, `store.*`) or the standard library's file modules."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else (
                fn.attr if isinstance(fn, ast.Attribute) else "")
            if name in _FILE_CALLS:
                found.append(f"{module}:{node.lineno}: {name}(")
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""])
            found += [f"{module}:{node.lineno}: import {n}" for n in names
                      if n.split(".")[0] in _FILE_MODULES or n.startswith(_FILE_MODULES[-1])]
    return found


def test_the_file_scan_sees_reads() -> None:
    # a sanity check of the scan: the readers below the layers are seen reading
    assert any("read_bytes(" in f for f in file_reads(f"{JUDGE}.read.steps"))
    assert any("import " in f for f in file_reads(f"{JUDGE}.read.evidence"))
    assert any("read_text(" in f for f in file_reads(f"{PKG}.run.contamination"))


def test_no_validity_layer_nor_decide_reads_a_file() -> None:
    """Reading is one layer below the five layers: route, semantic, numeric, performance,
    reproducibility and decide take typed objects (`judge.read`) and return findings."""
    wrong = [hit for module in sorted(MODULES)
             if _judge_part(module) in (*VALIDITY, "decide")
             for hit in file_reads(module)]
    assert wrong == []


# Issue 51: every read and write under a matrix root goes through `store/` (regular files only,
# no link leaving the root, writes opened without following links, reads bounded). In report/,
# run/ and cli.py no call opens a file itself; the few that open a file that is not under a
# matrix root are named here with why.
_OPEN_CALLS = {"open", "read_text", "read_bytes", "write_text", "write_bytes", "load", "fromfile",
               "memmap", "loadtxt", "genfromtxt"}
OPENS_OUTSIDE_A_ROOT = {
    (f"{PKG}.run.procs", "open"): "/proc/<pid>/stat and /proc/<pid>/environ: the kernel's",
    (f"{PKG}.run.contamination", "read_text"): "/proc/stat, /proc/loadavg and /proc/<pid>/stat",
    (f"{PKG}.report.cache", "read_bytes"): "the installed package's own source (code_digest)",
    (f"{PKG}.cli", "read_text"): "the package's matrix.toml templates (importlib.resources)",
    (f"{PKG}.cli", "open"): "os.devnull, for stdout after a reader closed the pipe (table | head)",
}


def file_opens(module: str) -> list[tuple[str, int]]:
    """(call name, line) of every call in `module` that opens a file by itself, through the
    standard library or a path's own methods; `store.safeio`'s functions are imported by name
    (`read_text(path, root, ...)`), so a call of one of them is told apart by its arguments:
    a method call (`x.read_text(`) or a bare `open(` is the module's own."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    store_names = {a.asname or a.name for node in ast.walk(tree)
                   if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                       f"{PKG}.store") for a in node.names}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        if isinstance(fn, ast.Name) and fn.id in _OPEN_CALLS and fn.id not in store_names:
            found.append((fn.id, node.lineno))
        elif isinstance(fn, ast.Attribute) and fn.attr in _OPEN_CALLS:
            owner = fn.value
            if isinstance(owner, ast.Name) and owner.id in ("json", "pickle", "yaml", "tomllib"):
                continue  # json.load(fh) of a handle that store opened is judged at the open
            found.append((fn.attr, node.lineno))
    return found


def test_the_open_scan_sees_opens() -> None:
    assert any(name == "open" for name, _ in file_opens(f"{PKG}.run.procs"))
    assert file_opens(f"{PKG}.run.rootlock") == []


def test_report_run_session_and_the_pytest_face_open_files_only_through_store() -> None:
    wrong = []
    for module in sorted(MODULES):
        rest = module[len(PKG) + 1:]
        if not (rest.startswith(("report.", "run.", "session.")) or rest in ("cli", "plugin")):
            continue
        for name, line in file_opens(module):
            if (module, name) not in OPENS_OUTSIDE_A_ROOT:
                wrong.append(f"{module}:{line}: {name}(")
    assert wrong == [], "open files under a matrix root through store/ (store/safeio.py)"


def test_every_exception_to_the_store_rule_is_still_used() -> None:
    used = {(m, name) for m in MODULES for name, _ in file_opens(m)}
    assert set(OPENS_OUTSIDE_A_ROOT) <= used


SESSION = f"{PKG}.session"
# The session's pipeline, in the order a cell goes down it: each room imports only rooms before it.
SESSION_ROOMS = ("plan", "runner", "recorder", "scheduler", "coordinator")


def test_the_session_is_a_pipeline_that_imports_one_way() -> None:
    """plan < runner < recorder < scheduler < coordinator: a room imports no room after it (the
    scheduler sits beside the runner and never imports the coordinator); nothing of the
    session imports the pytest face; the plan opens no file."""
    assert sorted(p.stem for p in (ROOT / "session").glob("*.py")) == sorted(
        ["__init__", *SESSION_ROOMS])
    wrong = []
    for room in SESSION_ROOMS:
        for dep, typing_only in GRAPH[f"{SESSION}.{room}"]:
            if dep.startswith(SESSION + "."):
                if SESSION_ROOMS.index(dep.rsplit(".", 1)[1]) >= SESSION_ROOMS.index(room):
                    wrong.append(f"{room} -> {dep}")
            elif dep.count(".") >= 1 and dep.split(".")[1] not in LAYERS and not typing_only:
                wrong.append(f"{room} -> {dep}")
    assert wrong == []
    assert file_opens(f"{SESSION}.plan") == []
    assert not any(d.startswith(f"{PKG}.store") for d, _ in GRAPH[f"{SESSION}.plan"])


def test_the_coordinator_is_thin() -> None:
    lines = (ROOT / "session" / "coordinator.py").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 250


# Issue 54: the reference workload is laid out like the matrix it serves. Its rooms, and what each
# may import of the workload (docs/architecture.md, "The reference workload"): the kernels sit at
# the bottom (each module's P and R side by side), rollout and training beside each other above
# them, the evidence writers above those, and the job on top.
WL = f"{PKG}.workload"
WORKLOAD_ROOMS = ("kernels", "rollout", "training", "evidence")
WORKLOAD_MAY_IMPORT = {
    "kernels": ("kernels", "weights", "parallel"),
    "rollout": ("kernels", "rollout", "model", "weights", "env", "parallel"),
    "training": ("kernels", "training", "model", "weights", "env", "parallel"),
    "evidence": ("kernels", "evidence", "env", "parallel", "weights"),
}


def _room(module: str) -> str | None:
    """The workload room a module lives in (`kernels`, `rollout`...), its top-level module's name
    (`job`, `model`...), or None outside the workload."""
    if not module.startswith(WL + "."):
        return None
    return module[len(WL) + 1:].split(".")[0]


def test_the_workload_is_laid_out_like_the_matrix() -> None:
    for room in WORKLOAD_ROOMS:
        doc = ast.get_docstring(ast.parse((ROOT / "workload" / room / "__init__.py").read_text()))
        assert doc is not None and "May import" in doc, room
    # each module's P and R side by side: one dispatch, P's and R's backends in one folder each
    kernels = ROOT / "workload" / "kernels"
    assert {p.name for p in kernels.iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        "p", "r"}
    assert {p.stem for p in kernels.glob("*.py")} == {
        "__init__", "base", "side", "attention", "ffn", "logp", "comm"}
    for backend in ("p", "r"):
        doc = ast.get_docstring(ast.parse(
            (ROOT / "workload" / "kernels" / backend / "__init__.py").read_text()))
        assert doc is not None and "May import" in doc, backend
    top = sorted(p.name for p in (ROOT / "workload").glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "env.py", "factors.py", "job.py", "model.py",
                   "parallel.py", "weights.py"]


def test_workload_imports_run_one_way() -> None:
    """kernels import no model, rollout, training, evidence or job; rollout and training never
    import each other; evidence writers import no kernel backend (`kernels.p`, `kernels.r`
    except the R kernels' declared identity); nothing below the job imports it."""
    wrong = []
    for module, deps in GRAPH.items():
        room = _room(module)
        if room is None:
            continue
        for dep, typing_only in deps:
            dep_room = _room(dep)
            if dep_room is None or dep_room == room or typing_only:
                continue
            if room in WORKLOAD_MAY_IMPORT and dep_room not in WORKLOAD_MAY_IMPORT[room]:
                wrong.append(f"{module} -> {dep}")
            if dep_room == "job" and room != "__main__":
                wrong.append(f"{module} -> {dep}")
            if room == "evidence" and dep.startswith((f"{WL}.kernels.p", f"{WL}.kernels.r")) \
                    and dep != f"{WL}.kernels.r.identity":
                wrong.append(f"{module} -> {dep}")
        if module.startswith(f"{WL}.kernels.p"):  # P's backends stand alone
            wrong += [f"{module} -> {d}" for d, _ in deps
                      if d.startswith(WL) and not d.startswith(f"{WL}.kernels.p")]
    assert wrong == []


def test_the_workload_layout_check_sees_a_wrong_import() -> None:
    # a sanity check of the rule's reader: known edges of each room are in the graph
    assert (f"{WL}.kernels.p.native", False) in GRAPH[f"{WL}.rollout.sampling"]
    assert (f"{WL}.kernels.side", False) in GRAPH[f"{WL}.evidence.artifacts"]
    assert (f"{WL}.model", False) in GRAPH[f"{WL}.training.budget"]
    assert _room(f"{WL}.kernels.r.autograd") == "kernels" and _room(f"{PKG}.run.procs") is None
