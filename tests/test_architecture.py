"""The layer order of ``tuner/__init__.py`` holds, and an import against it fails the check.

Runs import-linter (``[tool.importlinter]`` in ``pyproject.toml``) on this checkout, then on a copy
of the package with one upward import injected, which must be reported as broken; likewise a
launcher import in the trial, which reaches its server only through ``ServerUnderTest``. And ``tuner apply``
drives the launcher through its public calls only: no private attribute, no launcher subclass (an AST
check, shown to catch the old ``_PersistentDropinLauncher`` shape).
"""

from __future__ import annotations

import os
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


def _copy(tmp_path: Path) -> Path:
    copy = tmp_path / "checkout"
    copy.mkdir()
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    shutil.copytree(ROOT / "tuner", copy / "tuner", ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_the_layers_and_the_simulator_isolation_hold() -> None:
    proc = _lint(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 kept, 0 broken" in proc.stdout


def test_an_upward_import_breaks_the_layers(tmp_path: Path) -> None:
    copy = _copy(tmp_path)
    records = copy / "tuner" / "records.py"
    records.write_text(records.read_text() + "\nfrom tuner.study import loop  # noqa: E402,F401 - injected\n")
    proc = _lint(copy)
    assert proc.returncode != 0
    assert "layers" in proc.stdout and "BROKEN" in proc.stdout
    assert "tuner.records -> tuner.study.loop" in proc.stdout


def test_a_product_import_in_the_simulator_breaks_its_isolation(tmp_path: Path) -> None:
    copy = _copy(tmp_path)
    clock = copy / "tuner" / "sim" / "clock.py"
    clock.write_text(clock.read_text() + "\nfrom tuner.sglang import failures  # noqa: E402,F401 - injected\n")
    proc = _lint(copy)
    assert proc.returncode != 0
    assert "tuner.sim.clock -> tuner.sglang.failures" in proc.stdout


def test_a_launcher_import_in_the_trial_breaks_its_seam(tmp_path: Path) -> None:
    copy = _copy(tmp_path)
    trial = copy / "tuner" / "trial.py"
    trial.write_text(trial.read_text() + "\nfrom tuner.launch import base  # noqa: E402,F401 - injected\n")
    proc = _lint(copy)
    assert proc.returncode != 0
    assert "tuner.trial does not import tuner.launch" in " ".join(proc.stdout.split()) and "BROKEN" in proc.stdout
    assert "tuner.trial -> tuner.launch.base" in proc.stdout


def _private_uses(path: Path) -> list[str]:
    """``obj._name`` on anything but ``self``/``cls``, and classes that extend a launcher, in ``path``."""
    import ast

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
