"""The manual and the docstrings name only what exists, and the README stays a front page (issue 42).

Every module path named in the README, in a page of ``docs/`` or in a docstring of the product
(``tuner/**/*.py``) must exist: a file or folder path (``tuner/study/budget.py``, ``tuner/sim/``,
``tuner/data/flags-*.json``, and likewise ``tests/...``, ``configs/...``, ``systemd/...`` in the
README and the manual) on disk, a dotted name (``tuner.study.budget``,
``tuner.study.progress.Progress``) as a module, or a module and the attributes below it (a class,
a function, a field of a dataclass or pydantic model). The strict ``mkdocs build`` in ``.ci/run``
checks the manual's links and nav; this test checks the names in its text.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
import tomllib
from functools import cache
from pathlib import Path

import pytest

from tuner.config import parse_config

ROOT = Path(__file__).resolve().parents[1]

README_MAX_LINES = 250
"""The README is the front page (what it does, the two commands, a real-box quick start, the key
figures, links); everything else lives in ``docs/``."""

# `tuner.x.y` not preceded by a word character, a dot, a slash or a dash (so `sglang-tuner.x` and
# paths are not read as names); paths in the checkout (`tuner/...`, `tests/...`, `configs/...`,
# `systemd/...`) likewise.
DOTTED = re.compile(r"(?<![\w./-])tuner(?:\.[A-Za-z_]\w*)+")
SLASHED = re.compile(r"(?<![\w./-])(?:tuner|tests|configs|systemd)/[\w./*<>-]*")

FILE_SUFFIXES = {"toml", "json", "jsonl", "db", "html", "log", "prom", "lock", "service", "conf", "md", "py"}
"""A dotted name ending in one of these is a file name (``tuner.toml``), not a module."""


def user_attribute_keys() -> set[str]:
    """The keys the product stores in Optuna's study and trial user attributes (``RECORD_ATTR =
    "tuner.record"``, ``WARM_ATTR = "tuner.warm_start"``, ...: module-level ``*_ATTR`` constants in
    ``tuner/``): names such as "the user attribute `tuner.host`" are keys, not modules."""
    keys = set()
    for source in (ROOT / "tuner").glob("**/*.py"):
        for node in ast.parse(source.read_text()).body:
            if (
                isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id.endswith("_ATTR") and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                keys.add(node.value.value)
    return keys


def _texts() -> dict[str, str]:
    texts = {"README.md": (ROOT / "README.md").read_text()}
    for page in sorted((ROOT / "docs").glob("**/*.md")):
        texts[str(page.relative_to(ROOT))] = page.read_text()
    for source in sorted((ROOT / "tuner").glob("**/*.py")):
        tree = ast.parse(source.read_text())
        docs = [
            ast.get_docstring(node) or ""
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        ]
        texts[str(source.relative_to(ROOT))] = "\n".join(docs)
    return texts


def _has_attribute(owner: object, name: str) -> bool:
    if hasattr(owner, name):
        return True
    fields = getattr(owner, "model_fields", None) or {}
    if dataclasses.is_dataclass(owner):
        fields = {**fields, **{f.name: f for f in dataclasses.fields(owner)}}
    return name in fields or name in getattr(owner, "__annotations__", {})


@cache
def dotted_name_exists(name: str) -> bool:
    """Whether ``tuner.a.b.C.d`` is a module, or a module followed by attributes that exist."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            owner: object = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is not None and module_name.startswith(error.name) and error.name.startswith("tuner"):
                continue  # this prefix is no module: try a shorter one
            raise
        for attribute in parts[cut:]:
            if not _has_attribute(owner, attribute):
                return False
            owner = getattr(owner, attribute, None) if hasattr(owner, attribute) else None
            if owner is None:
                return attribute == parts[-1]
        return True
    return False


def path_exists(path: str) -> bool:
    """Whether ``tuner/...`` (or ``tests/``, ``configs/``, ``systemd/``) (a file, a folder, or a pattern such as ``tuner/data/flags-*.json`` or
    ``tuner/data/flags-<version>.json``) exists."""
    path = re.sub(r"<[^>]*>", "*", path.rstrip("."))
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


def stale_names(texts: dict[str, str]) -> dict[str, list[str]]:
    """``{name: [where it is named]}`` for every module path or dotted name that does not exist."""
    stale: dict[str, list[str]] = {}
    keys = user_attribute_keys()
    for where, text in texts.items():
        for name in DOTTED.findall(text):
            name = name.rstrip(".")
            if name in keys or name.rsplit(".", 1)[-1] in FILE_SUFFIXES:
                continue
            if not dotted_name_exists(name):
                stale.setdefault(name, []).append(where)
        for path in SLASHED.findall(text):
            if where.endswith(".py") and not path.startswith("tuner/"):
                continue  # a docstring's `configs/qwen3_next.py` is SGLang's source, not this checkout
            if not path_exists(path):
                stale.setdefault(path, []).append(where)
    return stale


def test_every_module_named_in_the_readme_the_manual_and_the_docstrings_exists() -> None:
    stale = stale_names(_texts())
    assert not stale, "names of modules that do not exist:\n" + "\n".join(
        f"  {name}: {', '.join(sorted(set(where)))}" for name, where in sorted(stale.items())
    )


@pytest.mark.parametrize(
    ("text", "stale"),
    [
        ("the planner (`tuner.study.planner`) aims", ["tuner.study.planner"]),
        ("see `tuner/study/planner.py`", ["tuner/study/planner.py"]),
        ("run `configs/nope.toml` (`tests/study/test_nope.py::test_x`)", ["configs/nope.toml", "tests/study/test_nope.py"]),
        ("`tuner.study.budget.prior_trial_cost_s` and `tuner.study.budget.no_such_rule`", ["tuner.study.budget.no_such_rule"]),
        ("`tuner/data/flags-*.json`, `tuner/sim/`, `tuner.records.TrialRecord.windows`, `-o tuner.toml`", []),
    ],
)
def test_the_check_names_a_stale_module_and_passes_what_exists(text: str, stale: list[str]) -> None:
    assert sorted(stale_names({"page.md": text})) == stale


def test_the_readme_s_links_into_the_checkout_exist() -> None:
    """The README is not part of the strict site build: its relative links (``docs/real-box.md``,
    ``docs/benchmarks.md#...``) are checked here, each to a file of the checkout."""
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    relative = [link for link in links if "://" not in link]
    assert relative, "the README links into the manual"
    assert [link for link in relative if not (ROOT / link).exists()] == []


def test_the_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move the detail into docs/"


def toml_examples() -> list[tuple[str, str]]:
    """``(where, text)`` of every ```toml block in the README and the manual."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
    return [(str(page.relative_to(ROOT)), block) for page in pages
            for block in re.findall(r"```toml\n(.*?)```", page.read_text(), re.S)]


def test_every_toml_example_of_the_readme_and_the_manual_is_a_valid_config_table() -> None:
    """A config example an operator copies (the hooks and window of the real-box quick start) is
    accepted by the config's own validation: each of its tables laid over ``configs/reference.toml``."""
    examples = toml_examples()
    assert len(examples) >= 2
    for where, block in examples:
        config = tomllib.loads((ROOT / "configs" / "reference.toml").read_text())
        for table, keys in tomllib.loads(block).items():
            config.setdefault(table, {}).update(keys)
        parse_config(config, source=where)


def _first_block_after(text: str, heading: str) -> str:
    """The first fenced code block after ``heading`` in a Markdown ``text``."""
    rest = text.split(heading, 1)[1]
    return rest.split("```", 2)[1].strip()


def test_the_readme_test_command_installs_first_and_is_what_ci_runs() -> None:
    """The README's test command works first on a fresh clone (it creates the venv it uses), and
    every step of it is a step of ``.ci/run`` (so CI runs what the README promises); the manual's
    getting-started page shows the same two commands."""
    readme = (ROOT / "README.md").read_text()
    tests_cmd = _first_block_after(readme, "## Run the tests")
    demo_cmd = _first_block_after(readme, "## Install and try it")
    install = "python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]'"
    assert tests_cmd.startswith(install) and demo_cmd.startswith(install), (tests_cmd, demo_cmd)
    ci = (ROOT / ".ci" / "run").read_text()
    ci_lines = {line.strip() for line in ci.splitlines()}
    steps = [s.strip() for s in tests_cmd[len(install):].split(" && ") if s.strip()]
    assert steps, tests_cmd
    for step in steps:
        assert any(step in line for line in ci_lines), f"README step {step!r} is not run by .ci/run"
    page = (ROOT / "docs" / "getting-started.md").read_text()
    assert tests_cmd in page and demo_cmd in page
