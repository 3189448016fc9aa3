"""Suite-wide pytest setup.

- Benchmarks (``tests/benchmarks``) run only with ``--run-benchmarks``.
- Hygiene: the suite runs with a private temp folder (``$TMPDIR``, inherited by every process it
  starts), a private default state dir (``$SGLANG_TUNER_STATE_DIR``, the launcher's default
  state/log folder) and a private unit-lock folder (``$SGLANG_TUNER_LOCK_DIR``); each
  ``pytest-xdist`` worker gets its own three inside them. At the end the run FAILS if anything
  but pytest's own ``tmp_path`` folders was left in a temp folder, if the checkout's ``studies/``
  gained entries, or if ``/var/lib/sglang-tuner`` gained entries (only a warning when another test run was seen on the machine meanwhile: its
  entries cannot be told from ours).
- Parallel runs (``-n 4 --dist loadgroup``, as ``.ci/run``): a test runs on the worker of its
  module, of the systemd sandbox's tests, or of the demo study's readers (:func:`_xdist_group`).
- Every test runs in its own ``tmp_path`` as the working directory (:func:`_private_cwd`), so a
  relative default (``studies/``, a config's storage) never reads or writes the checkout; the run
  FAILS if ``git status`` of the checkout (ignored files included) differs at the end from the start.
- Fixtures shared by several folders: ``tuner_cli`` (the CLI in-process), ``workdir``,
  ``systemd_sandbox`` (module-scoped), ``postgres_cluster`` (session) and ``postgres_url`` (a
  fresh database per test) on a real PostgreSQL server, ``demo_run`` (one real ``tuner run`` of
  ``configs/demo-sim.toml`` per session, read by the readers' and the end-to-end tests).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from tests.support.cli import CliResult, in_process_cli, run_tuner
from tests.support.configs import DemoRun, config_copy
from tests.support.postgres import PostgresCluster, boot_postgres, missing_reason
from tests.support.sandbox import SystemdSandbox, boot_sandbox

REAL_STATE_DIR = Path("/var/lib/sglang-tuner")
"""The launcher's default state dir for root: no test may write there."""
CHECKOUT_STUDIES = Path(__file__).resolve().parents[1] / "studies"
"""The checkout's own ``studies/`` (the default storage of a run started in the checkout): no test
may leave a study or an artifacts folder there."""

CHECKOUT = CHECKOUT_STUDIES.parent
_hygiene: dict[str, object] = {}
_CACHES = (".venv/", "__pycache__/", ".pytest_cache/", ".mypy_cache/", ".ruff_cache/", ".egg-info/", ".import_linter_cache/")


def _checkout_state() -> set[str] | None:
    """``git status --porcelain --ignored`` of the checkout less caches and the venv (None: no git)."""
    try:
        out = subprocess.run(["git", "-C", str(CHECKOUT), "status", "--porcelain", "--ignored", "-uall"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {line for line in out.splitlines() if not any(cache in line for cache in _CACHES)}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-benchmarks",
        action="store_true",
        default=False,
        help="run tests/benchmarks (speed and search-quality figures for the README)",
    )


def _other_test_runs() -> dict[int, str]:
    """pytest processes on this machine outside this run's process tree: PID → command line."""
    ours = {os.getpid(), *(c.pid for c in psutil.Process().children(recursive=True))}
    found = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if proc.info["pid"] not in ours and "pytest" in cmdline and "python" in cmdline:
            found[proc.info["pid"]] = cmdline[:160]
    return found


def _entries(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()} if folder.is_dir() else set()


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Point the temp folder and the default state dir of this process and its children at a
    private folder, before pytest or any test creates a temporary file."""
    if hasattr(config, "workerinput"):  # an xdist worker: a folder of its own inside the controller's
        _worker_folders(config.workerinput["workerid"])
        return
    private = Path(tempfile.mkdtemp(prefix="tuner-tests-"))
    (private / "tmp").mkdir()
    os.environ["TMPDIR"] = str(private / "tmp")
    tempfile.tempdir = str(private / "tmp")
    os.environ["SGLANG_TUNER_STATE_DIR"] = str(private / "state")
    os.environ["SGLANG_TUNER_LOCK_DIR"] = str(private / "locks")  # not the host's /run/lock/sglang-tuner
    _hygiene.update(private=private, state_before=_entries(REAL_STATE_DIR), others=_other_test_runs(), reports=0,
                    studies_before=_entries(CHECKOUT_STUDIES), checkout_before=_checkout_state())


_WORKER_PREFIX = "xdist-"
_PRIVATE_VARS = ("TMPDIR", "SGLANG_TUNER_STATE_DIR", "SGLANG_TUNER_LOCK_DIR")


def _worker_folders(worker: str) -> None:
    """Give an xdist worker its own temp, state and unit-lock folders under the controller's, so
    that workers never see each other's runs (a unit's lock, a run's temp folder)."""
    for var in _PRIVATE_VARS:
        folder = Path(os.environ[var]) / f"{_WORKER_PREFIX}{worker}"
        folder.mkdir(parents=True, exist_ok=True)
        os.environ[var] = str(folder)
    tempfile.tempdir = os.environ["TMPDIR"]


def pytest_runtest_logfinish() -> None:
    """Note other test runs now and then (they may write into /var/lib/sglang-tuner too)."""
    if "others" in _hygiene:
        _hygiene["reports"] = int(_hygiene["reports"]) + 1  # type: ignore[call-overload]
        if _hygiene["reports"] % 25 == 0:
            _hygiene["others"].update(_other_test_runs())  # type: ignore[union-attr]


def _pytest_owned(name: str) -> bool:
    return name.startswith("pytest-of-")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if the suite left files in the temp folder or wrote into /var/lib/sglang-tuner."""
    private = _hygiene.get("private")
    if not isinstance(private, Path):
        return
    problems = []
    tmp = private / "tmp"
    workers = [tmp / n for n in _entries(tmp) if n.startswith(_WORKER_PREFIX)]
    left = sorted([n for n in _entries(tmp) if not _pytest_owned(n) and tmp / n not in workers]
                  + [f"{w.name}/{n}" for w in workers for n in _entries(w)])
    if left:
        problems.append(f"left in the temp folder: {', '.join(left)}")
    studies = sorted(_entries(CHECKOUT_STUDIES) - _hygiene["studies_before"])  # type: ignore[operator]
    if studies:
        problems.append(f"left in the checkout's {CHECKOUT_STUDIES}: {', '.join(studies)} (run the test in tmp_path)")
    before, after = _hygiene["checkout_before"], _checkout_state()
    if isinstance(before, set) and after is not None and after != before:
        changed = sorted(after ^ before)
        problems.append(f"the checkout changed ({len(changed)} path(s), git status): {'; '.join(changed[:5])}")
    gained = sorted(_entries(REAL_STATE_DIR) - _hygiene["state_before"])  # type: ignore[operator]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    others: dict[int, str] = {**_hygiene["others"], **_other_test_runs()}  # type: ignore[dict-item]
    if gained and others:
        if reporter is not None:
            named = "; ".join(f"PID {pid}: {cmd}" for pid, cmd in sorted(others.items())[:3])
            reporter.write_line(f"hygiene: {REAL_STATE_DIR} gained {', '.join(gained)} while other test runs were "
                                f"running ({named}); not attributed to this run")
    elif gained:
        problems.append(f"written into {REAL_STATE_DIR}: {', '.join(gained)}")
    if problems:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if reporter is not None:
            reporter.write_sep("=", "test hygiene", red=True)
            for line in problems:
                reporter.write_line(f"FAILED hygiene: {line}")
            reporter.write_line(f"(kept for inspection: {private})")
        return
    if exitstatus != 0 and any(p for p in tmp.iterdir() if p not in workers):
        if reporter is not None:
            reporter.write_line(f"the failed run's tmp_path folders are kept for inspection: {private}")
        return
    shutil.rmtree(private, ignore_errors=True)


DEMO_RUN_TIMEOUT_S = 600
"""pytest-timeout's limit (s) for a test that reads the session's demo (its setup runs the demo)."""

_XDIST_GROUPS = {"demo_run": "demo-run"}
"""Fixture → ``pytest-xdist`` group, for fixtures shared beyond a module."""


def _xdist_group(item: pytest.Item) -> str:
    """The worker group of a test under ``--dist loadgroup``: one group runs on one worker.

    The readers of the session's demo study share one group (run once, not once per worker); a
    ``slow`` test that uses no module- or class-scoped fixture is a group of its own (the suite's
    length is its longest worker's: two ten-minute tests of one module ran one after the other);
    every other test runs with the rest of its module, whose module-scoped fixtures (servers,
    explained logs, a systemd sandbox: any number run at once) are then built once.
    """
    fixtures = getattr(item, "fixturenames", ())
    for fixture, group in _XDIST_GROUPS.items():
        if fixture in fixtures:
            return group
    if item.get_closest_marker("slow") and not _shares_a_fixture(item):
        return item.nodeid
    return item.nodeid.split("::", 1)[0]


def _shares_a_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` uses a fixture built once for its module, class or package."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return True
    return any(defs and defs[-1].scope in ("module", "class", "package") for defs in info.name2fixturedefs.values())


def _slow_groups_first(items: list[pytest.Item]) -> None:
    """Put the groups holding a ``slow`` test first (a stable sort: each group's tests keep their
    order). ``--dist loadgroup`` hands groups to workers in collection order (``pyproject.toml``
    sets ``--no-loadscope-reorder``, which would order them by test count): a module of two
    ten-minute tests starts at once instead of last, when it would alone set the run's length."""
    slow = {_xdist_group(i) for i in items if i.get_closest_marker("slow")}
    items.sort(key=lambda i: _xdist_group(i) not in slow)


@pytest.hookimpl(tryfirst=True)  # before xdist's worker hook reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_xdist_group(item)))
        if "demo_run" in getattr(item, "fixturenames", ()) and item.get_closest_marker("timeout") is None:
            # the first reader of the session's demo pays for the demo's run (about 290 s on a loaded
            # 2-core box, inside the default 300 s limit by too little)
            item.add_marker(pytest.mark.timeout(DEMO_RUN_TIMEOUT_S))
    _slow_groups_first(items)
    if config.getoption("--run-benchmarks"):
        return
    skip = pytest.mark.skip(reason="benchmark: run with `pytest tests/benchmarks --run-benchmarks`")
    for item in items:
        if "benchmarks" in item.path.parts:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _private_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run every test in its own ``tmp_path``: a default relative path (a config's ``studies/``
    storage, the demo's database) then never reads what a README run left in the checkout."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _sigint_kept() -> Iterator[None]:
    """Fail a test that leaves this worker's SIGINT handler changed: every process a later test
    starts inherits an ignored SIGINT (CI saw ``tuner load`` survive its Ctrl-C after an in-process
    ``tuner`` call had left ``SIG_IGN`` behind)."""
    import signal

    handler = signal.getsignal(signal.SIGINT)
    yield
    left = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, handler)
    assert left is handler, f"the test left SIGINT's handler changed ({left!r}, was {handler!r})"


@pytest.fixture()
def tuner_cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Callable[..., CliResult]:
    """Run ``tuner`` in this process: ``tuner_cli("trials", "--storage", url)`` → :class:`CliResult`."""
    return in_process_cli(capsys, monkeypatch)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A working directory for one tuner run (``studies/`` lands here)."""
    return tmp_path


@pytest.fixture(scope="module")
def systemd_sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SystemdSandbox]:
    """One sandboxed service manager per test module (``tests/support/sandbox.py``), beside any
    other module's (each in its own namespaces and cgroup folder)."""
    with boot_sandbox(tmp_path_factory.mktemp("sandbox")) as box:
        yield box


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[PostgresCluster]:
    """One private PostgreSQL cluster per session (``tests/support/postgres.py``): initdb/pg_ctl
    as the ``postgres`` user, 127.0.0.1 on a free port; skips with the fix when not installed."""
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    with boot_postgres() as cluster:
        yield cluster


@pytest.fixture
def postgres_url(postgres_cluster: PostgresCluster) -> str:
    """A fresh, empty database on the session's cluster: ``postgresql+psycopg://...``."""
    return postgres_cluster.create_database()


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """The README's demo (``configs/demo-sim.toml``: the simulator under the process launcher),
    with 4 s / 2 s load phases and three trials (the cap stops it; the 6-minute budget leaves a loaded 2-core box room for them), run once per session."""
    work = tmp_path_factory.mktemp("demo-run")
    config = config_copy("demo-sim.toml", work, phases={"measure_s": 4, "stress_s": 2}, storage=True)
    proc = run_tuner("run", "--config", str(config), "--budget", "6m", "--trials", "3", cwd=work, timeout_s=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return DemoRun(config, work, f"sqlite:///{work / 'studies' / 'demo-sim.db'}", proc)
