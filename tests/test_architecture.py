"""The house's guard rails hold, and each is shown to fail on a planted violation.

- import-linter (``[tool.importlinter]`` in ``pyproject.toml``): the layer order of
  ``tuner/__init__.py``, the simulator's isolation, and the study's decisions
  (``tuner.study.decide``, the view, the calibration) importing neither the loop, the hosts module,
  the recorder, the storage, the trial nor a launcher; and the trial importing no launcher (it
  reaches its server only through ``ServerUnderTest``). Run on this checkout, then on a copy with
  one violating import injected.
- AST checks: the decisions import no Optuna storage; no import cycle among ``tuner``'s modules
  (module- and function-level imports); Optuna's private attributes only in
  ``tuner/study/hosts.py``; no class in ``tuner/study/`` with more than 12 mutable attributes;
  ``tuner apply`` drives the launcher through its public calls only.
- ruff's complexity ceiling (``C901``, 15): a new function over it fails, and a ``noqa: C901`` no
  longer needed fails (``RUF100``), so the ceiling's exceptions only go down.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=240)


def _planted(tmp_path: Path, module: str, line: str) -> subprocess.CompletedProcess[str]:
    """import-linter on a copy of the package with ``line`` appended to ``module`` (a path below ``tuner/``)."""
    copy = _copy(tmp_path)
    path = copy / "tuner" / module
    path.write_text(path.read_text() + f"\n{line}  # noqa: E402,F401 - injected\n")
    return _lint(copy)


def _copy(tmp_path: Path) -> Path:
    copy = tmp_path / "checkout"
    copy.mkdir()
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    shutil.copytree(ROOT / "tuner", copy / "tuner", ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_the_layers_and_the_simulator_isolation_hold() -> None:
    proc = _lint(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 kept, 0 broken" in proc.stdout


def test_an_upward_import_breaks_the_layers(tmp_path: Path) -> None:
    proc = _planted(tmp_path, "records.py", "from tuner.study import loop")
    assert proc.returncode != 0
    assert "layers" in proc.stdout and "BROKEN" in proc.stdout
    assert "tuner.records -> tuner.study.loop" in proc.stdout


def test_an_sglang_fact_that_reaches_up_into_the_knobs_breaks_the_layers(tmp_path: Path) -> None:
    # tuner.knobs sits between tuner.study and tuner.config (issue 39): the facts the levers' rules
    # read (tuner.sglang), the config and the records never import it.
    proc = _planted(tmp_path, "sglang/ladder.py", "from tuner.knobs import LEVERS")
    assert proc.returncode != 0
    assert "tuner.sglang.ladder -> tuner.knobs" in proc.stdout


def test_a_product_import_in_the_simulator_breaks_its_isolation(tmp_path: Path) -> None:
    proc = _planted(tmp_path, "sim/clock.py", "from tuner.sglang import failures")
    assert proc.returncode != 0
    assert "tuner.sim.clock -> tuner.sglang.failures" in proc.stdout


def test_a_decision_that_imports_the_loop_breaks_its_contract(tmp_path: Path) -> None:
    proc = _planted(tmp_path, "study/decide/slo.py", "from tuner.study import hosts")
    assert proc.returncode != 0
    assert "tuner.study.decide.slo -> tuner.study.hosts" in proc.stdout


# ---- AST checks -----------------------------------------------------------------------------------


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name → file, for every module of the ``tuner`` package under ``root``."""
    out = {}
    for path in sorted((root / "tuner").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The ``tuner`` modules ``name`` imports anywhere (module level or inside functions; not under
    ``if TYPE_CHECKING:``, which never runs), relative imports resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for n in ast.walk(node)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in found if m in known and m != name}


def _cycles(root: Path) -> list[list[str]]:
    """Strongly connected components of more than one module in ``tuner``'s import graph (Tarjan)."""
    modules = _modules(root)
    graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_not_even_through_function_level_imports(tmp_path: Path) -> None:
    assert _cycles(ROOT) == []
    copy = _copy(tmp_path)
    hosts = copy / "tuner" / "study" / "hosts.py"
    hosts.write_text(hosts.read_text() + "\n\ndef _late():\n    from tuner.study.storage import open_storage  # noqa: F401\n")
    assert ["tuner.study.hosts", "tuner.study.storage"] in _cycles(copy)


def _optuna_storage_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        found += [f"{path.name}:{node.lineno} {n}" for n in names if n.startswith("optuna.storages")]
        if isinstance(node, ast.Attribute) and ast.unparse(node) == "optuna.storages":
            found.append(f"{path.name}:{node.lineno} optuna.storages")
    return found


def test_the_decisions_import_no_optuna_storage(tmp_path: Path) -> None:
    study = ROOT / "tuner" / "study"
    files = [*(study / "decide").glob("*.py"), study / "view.py", study / "calibration.py"]
    assert [f for path in files for f in _optuna_storage_imports(path)] == []
    planted = tmp_path / "sampler.py"
    planted.write_text("import optuna\nstore = optuna.storages.InMemoryStorage()\n")
    assert _optuna_storage_imports(planted) == ["sampler.py:2 optuna.storages"]


_OPTUNA_PRIVATE = ("_storage", "_study_id", "_trial_id")
"""Optuna ``Study``/``Trial`` attributes that are not public API (``tuner/study/hosts.py`` says why it
reads them)."""


def _optuna_private_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [f"{path.name}:{node.lineno} .{node.attr}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in _OPTUNA_PRIVATE
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))]


def test_optunas_private_attributes_are_read_in_the_hosts_module_only(tmp_path: Path) -> None:
    uses = {str(path.relative_to(ROOT)): _optuna_private_uses(path) for path in (ROOT / "tuner").rglob("*.py")}
    assert {path for path, found in uses.items() if found} == {"tuner/study/hosts.py"}
    planted = tmp_path / "loop.py"
    planted.write_text("def f(study):\n    return study._storage\n")
    assert _optuna_private_uses(planted) == ["loop.py:2 ._storage"]


MAX_MUTABLE_ATTRIBUTES = 12


def _wide_classes(path: Path) -> list[str]:
    """Classes of ``path`` with more than :data:`MAX_MUTABLE_ATTRIBUTES` distinct ``self.<name>``
    assignment targets (the review's measure of a class's mutable state)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ClassDef):
            continue
        names = set()
        for sub in ast.walk(node):
            targets = (sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                       if isinstance(sub, (ast.AugAssign, ast.AnnAssign)) else [])
            names |= {t.attr for t in targets if isinstance(t, ast.Attribute)
                      and isinstance(t.value, ast.Name) and t.value.id == "self"}
        if len(names) > MAX_MUTABLE_ATTRIBUTES:
            out.append(f"{path.name}:{node.lineno} {node.name} ({len(names)})")
    return out


def test_no_class_of_the_study_holds_more_than_a_dozen_mutable_attributes(tmp_path: Path) -> None:
    assert [c for path in (ROOT / "tuner" / "study").rglob("*.py") for c in _wide_classes(path)] == []
    planted = tmp_path / "loop.py"
    planted.write_text("class Run:\n    def __init__(self):\n" + "".join(f"        self.a{i} = {i}\n" for i in range(13)))
    assert _wide_classes(planted) == ["loop.py:1 Run (13)"]


WIDE_CLASSES = {
    "tuner/launch/base.py GuardedLauncher": 28, "tuner/load/client.py _Stream": 13,
    "tuner/load/client.py _Connection": 15, "tuner/load/client.py StreamClient": 14, "tuner/load/runner.py _Run": 32,
    "tuner/report/prometheus.py PrometheusTextfile": 18, "tuner/sglang/logs.py LogWatcher": 29,
    "tuner/sim/cache.py PrefixCache": 14, "tuner/sim/engine.py _Req": 25, "tuner/sim/engine.py Engine": 43,
    "tuner/sim/server.py SimServer": 18,
}
"""The classes of ``tuner/`` over :data:`MAX_MUTABLE_ATTRIBUTES` when the check was widened from
``tuner/study`` to the whole package (issue 39), with their counts: each may only shrink, and no
other may join them. Lower a count (or drop the entry) when a class sheds state. Three grew in
the round that set the check, before it landed (issue 43's restore bookkeeping: GuardedLauncher
24 → 28; issue 36's ramp: _Run 31 → 32; issue 37's request path: Engine 37 → 43): the house issue
folds each into an object of its own, as LogWatcher's stream marks were."""


def _wide_counts(root: Path) -> dict[str, int]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        for found in _wide_classes(path):
            name, count = found.split(" ", 1)[1].rsplit(" (", 1)
            out[f"{path.relative_to(root.parent)} {name}"] = int(count.rstrip(")"))
    return out


def test_no_class_of_the_package_grows_its_mutable_state(tmp_path: Path) -> None:
    grown = {name: count for name, count in _wide_counts(ROOT / "tuner").items()
             if count > WIDE_CLASSES.get(name, MAX_MUTABLE_ATTRIBUTES)}
    assert grown == {}, f"over {MAX_MUTABLE_ATTRIBUTES} mutable attributes, or grown past the frozen count: {grown}"
    planted = tmp_path / "tuner" / "launch" / "base.py"  # a frozen class that grew by one
    planted.parent.mkdir(parents=True)
    planted.write_text("class GuardedLauncher:\n    def __init__(self):\n"
                       + "".join(f"        self.a{i} = {i}\n" for i in range(25)))
    assert _wide_counts(tmp_path / "tuner") == {"tuner/launch/base.py GuardedLauncher": 25}


STUDY_RUN_CEILING = {"lines": 301, "methods": 17, "loop_imports": 12}
""":class:`tuner.study.loop.StudyRun`'s length and methods and ``loop.py``'s product modules
imported (issue 39's targets: ≤ 300 lines, ≤ 30 methods, ≤ 12 modules), frozen when what is not
the loop left it: the stop rules and the invalid-launch streak's error (``stops.py``), the run's
opening, warm start and decision chain (``session.py``), the after-tell listeners (``hooks.py``),
the baseline's space notes and failure (``baseline.py``), a trial's job (``job.py``), its phase
writes and interrupts (``record.py``). 487 lines and 25 modules before the issue, 394 and 24 after
its first part; 299 → 301 once, for a named bug fix (a claim of a trial another host failed
meanwhile chooses again, :class:`tuner.study.hosts.Reaped`). Each may only go down."""


def _study_run_size(path: Path) -> dict[str, int]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    run = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "StudyRun")
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("tuner")}
    return {"lines": (run.end_lineno or run.lineno) - run.lineno + 1,
            "methods": sum(isinstance(b, ast.FunctionDef) for b in run.body), "loop_imports": len(imported)}


def test_the_study_run_does_not_grow_past_its_ceiling(tmp_path: Path) -> None:
    size = _study_run_size(ROOT / "tuner" / "study" / "loop.py")
    assert {k: v for k, v in size.items() if v > STUDY_RUN_CEILING[k]} == {}, size
    planted = tmp_path / "loop.py"
    planted.write_text("from tuner.study import a\nclass StudyRun:\n" + "".join(f"    def m{i}(self): pass\n" for i in range(26)))
    assert _study_run_size(planted) == {"lines": 27, "methods": 26, "loop_imports": 1}
    assert _study_run_size(planted)["methods"] > STUDY_RUN_CEILING["methods"]
    # a StudyRun at the review's 767 lines, and a loop.py importing 13 product modules
    planted.write_text("".join(f"from tuner.m{i} import x\n" for i in range(13)) + "class StudyRun:\n    def run(self):\n"
                       + "        pass\n" * 766)
    grown = _study_run_size(planted)
    assert grown["lines"] == 768 and grown["lines"] > STUDY_RUN_CEILING["lines"]
    assert grown["loop_imports"] == 13 > STUDY_RUN_CEILING["loop_imports"]


COMPLEX_FUNCTIONS = frozenset({
    "tuner/cli/load.py load_cmd", "tuner/load/search.py find_max_under_slo_async",
    "tuner/report/explain.py renderables", "tuner/report/tables.py trial_detail",
    "tuner/sim/engine.py _get_new_prefill_batch", "tuner/sim/evaluate.py _run", "tuner/sim/memory.py _plan_memory",
    "tuner/sim/server.py generate", "tuner/sim/startup.py run_startup",
})
"""The functions allowed over the complexity ceiling (a ``# noqa: C901`` on their ``def`` line),
frozen (issue 39): the list only shrinks; a new complex function is split, not excused."""


def _excused(root: Path) -> set[str]:
    out = set()
    for path in sorted(root.rglob("*.py")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if "noqa: C901" in line:
                match = re.search(r"def (\w+)", line)
                out.add(f"{path.relative_to(root.parent)} {match.group(1) if match else line.strip()}")
    return out


def test_no_new_function_is_excused_from_the_complexity_ceiling(tmp_path: Path) -> None:
    assert _excused(ROOT / "tuner") - COMPLEX_FUNCTIONS == set()
    planted = tmp_path / "tuner" / "study" / "loop.py"
    planted.parent.mkdir(parents=True)
    planted.write_text("def run(x: int) -> int:  # noqa: C901 - planted\n    return x\n")
    assert _excused(tmp_path / "tuner") - COMPLEX_FUNCTIONS == {"tuner/study/loop.py run"}


def _ruff(path: Path) -> subprocess.CompletedProcess[str]:
    ruff = Path(sys.executable).with_name("ruff")
    return subprocess.run([str(ruff), "check", "--config", str(ROOT / "pyproject.toml"), "--no-cache",
                           "--output-format", "concise", str(path)], capture_output=True, text=True, timeout=120)


def test_the_complexity_ceiling_only_goes_down(tmp_path: Path) -> None:
    branches = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(16))
    complex_function = tmp_path / "complex.py"
    complex_function.write_text(f"def f(x: int) -> int:\n{branches}    return -1\n")
    assert "C901 `f` is too complex (17 > 15)" in _ruff(complex_function).stdout
    stale = tmp_path / "stale.py"  # simplified below the ceiling, its exception left behind
    stale.write_text("def f(x: int) -> int:  # noqa: C901\n    return x\n")
    assert "RUF100" in _ruff(stale).stdout


def test_a_launcher_import_in_the_trial_breaks_its_seam(tmp_path: Path) -> None:
    proc = _planted(tmp_path, "trial.py", "from tuner.launch import base")
    assert proc.returncode != 0
    assert "tuner.trial does not import tuner.launch" in " ".join(proc.stdout.split()) and "BROKEN" in proc.stdout
    assert "tuner.trial -> tuner.launch.base" in proc.stdout


def _private_uses(path: Path) -> list[str]:
    """``obj._name`` on anything but ``self``/``cls``, and classes that extend a launcher, in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
                if name.endswith("Launcher"):
                    found.append(f"{path.name}:{node.lineno} class {node.name}({name})")
    return found


def test_apply_drives_the_launcher_through_its_public_calls(tmp_path: Path) -> None:
    assert _private_uses(ROOT / "tuner" / "apply.py") == []
    # the check sees the old shape: a launcher subclass overriding the private start
    old = tmp_path / "apply.py"
    old.write_text("class P(SystemdLauncher):\n    def _launch(self, argv):\n        self._start_unit()\n"
                   "def execute(launcher):\n    launcher._launch([])\n")
    assert _private_uses(old) == ["apply.py:1 class P(SystemdLauncher)", "apply.py:5 ._launch"]
