"""A real PostgreSQL server for tests: a private cluster made with ``initdb`` and run by ``pg_ctl``.

Debian's ``postgresql`` package provides the server binaries (``/usr/lib/postgresql/<v>/bin``).
:func:`boot_postgres` makes a cluster in a fresh folder under ``/tmp`` (``/tmp/pytest-of-root`` is
mode 0700, which the ``postgres`` user cannot enter), owned by ``postgres`` when the tests run as
root (``initdb`` refuses to run as root) or by the current user otherwise. The server listens on
127.0.0.1 on a free port and on a Unix socket in that folder, with password (SCRAM) authentication
over TCP so a test can try wrong credentials; it is stopped (``pg_ctl stop -m immediate``) and its
folder removed at the end. Durability is off (``fsync``, ``synchronous_commit``): a test cluster
never outlives its test run.

The fixtures are in ``tests/conftest.py``: ``postgres_cluster`` (one per session) and
``postgres_url`` (a fresh database per test, ``postgresql+psycopg://tuner:...@127.0.0.1:PORT/t_...``).
Without the package (no ``initdb``) or without ``psycopg`` they skip, saying which and the fix;
``.ci/run`` installs both. The cluster's folder is made in ``/tmp`` itself (the suite's private
``$TMPDIR`` is mode 0700, which the ``postgres`` user cannot enter) and removed at the end.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

__all__ = ["PASSWORD", "USER", "PostgresCluster", "boot_postgres", "find_bin_dir", "missing_reason"]

USER = "tuner"
"""The cluster's superuser (the tests' role)."""
PASSWORD = "tuner-test-pw"
"""Its password (SCRAM over TCP)."""


def find_bin_dir() -> Path | None:
    """The newest ``/usr/lib/postgresql/<v>/bin`` holding ``initdb`` and ``pg_ctl``, else one on PATH."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb and shutil.which("pg_ctl") else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PostgresCluster:
    """A running private cluster.

    Attributes:
        root: The cluster's folder (data directory ``root/data``, socket and log in ``root``).
        port: TCP port on 127.0.0.1.
        bin_dir: Where ``initdb``/``pg_ctl`` came from.
    """

    def __init__(self, root: Path, port: int, bin_dir: Path, run_as: str | None) -> None:
        self.root = root
        self.port = port
        self.bin_dir = bin_dir
        self._run_as = run_as

    def url(self, database: str = "postgres", *, user: str = USER, password: str = PASSWORD,
            port: int | None = None) -> str:
        """``postgresql+psycopg://user:password@127.0.0.1:port/database``."""
        return f"postgresql+psycopg://{user}:{password}@127.0.0.1:{port or self.port}/{database}"

    def create_database(self, name: str | None = None) -> str:
        """Create an empty database and return its URL."""
        import psycopg

        name = name or f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(host="127.0.0.1", port=self.port, user=USER, password=PASSWORD,
                             dbname="postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def sql(self, database: str, statement: str) -> None:
        """Run one statement in ``database`` (autocommit)."""
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=self.port, user=USER, password=PASSWORD,
                             dbname=database, autocommit=True) as conn:
            conn.execute(statement)

    def start(self) -> None:
        """Start the server (again) and wait until it accepts connections.

        Raises:
            RuntimeError: ``pg_ctl start`` failed (its output and the log's tail quoted).
        """
        options = (f"-c listen_addresses=127.0.0.1 -c port={self.port} -c unix_socket_directories={self.root} "
                   "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=300 "
                   "-c shared_buffers=32MB")
        start = self.run("pg_ctl", "-D", str(self.root / "data"), "-l", str(self.root / "server.log"), "-o", options,
                         "-w", "-t", "60", "start", timeout=90.0)
        if start.returncode != 0:
            log = (self.root / "server.log").read_text(errors="replace") if (self.root / "server.log").exists() else ""
            raise RuntimeError(f"pg_ctl start failed: {(start.stderr or start.stdout).strip()} {log[-400:]}")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``fast``: clients are disconnected, as in a restart or a failover)."""
        self.run("pg_ctl", "-D", str(self.root / "data"), "-m", mode, "-w", "stop", timeout=60.0)
        deadline = time.monotonic() + 10.0
        while (self.root / "data" / "postmaster.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.1)

    def run(self, *argv: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run a server binary as the cluster's owner."""
        return subprocess.run([str(self.bin_dir / argv[0]), *argv[1:]], capture_output=True, text=True,
                              timeout=timeout, check=False, user=self._run_as)


@contextlib.contextmanager
def boot_postgres(*, bin_dir: Path | None = None) -> Iterator[PostgresCluster]:
    """Make, start, and at the end stop and remove a private cluster.

    Raises:
        RuntimeError: ``initdb`` or ``pg_ctl start`` failed (its output quoted).
    """
    bin_dir = bin_dir or find_bin_dir()
    if bin_dir is None:
        raise RuntimeError("PostgreSQL server binaries not found")
    run_as = "postgres" if os.geteuid() == 0 else None
    root = Path(tempfile.mkdtemp(prefix="tuner-pg-", dir="/tmp"))
    os.chmod(root, 0o755)
    if run_as:
        shutil.chown(root, user=run_as, group=run_as)
    port = _free_port()
    cluster = PostgresCluster(root, port, bin_dir, run_as)
    pwfile = root / "pw"
    pwfile.write_text(PASSWORD + "\n")
    if run_as:
        shutil.chown(pwfile, user=run_as, group=run_as)
    started = False
    try:
        init = cluster.run("initdb", "-D", str(root / "data"), "-U", USER, f"--pwfile={pwfile}",
                           "--auth-host=scram-sha-256", "--auth-local=trust", "-E", "UTF8", "--no-sync",
                           timeout=120.0)
        if init.returncode != 0:
            raise RuntimeError(f"initdb failed: {(init.stderr or init.stdout).strip()[-400:]}")
        cluster.start()
        started = True
        yield cluster
    finally:
        if started:
            cluster.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


def missing_reason() -> str | None:
    """Why no cluster can be made here (the skip reason, naming the fix), or ``None``."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed: pip install -e '.[test]' (it pulls the postgres extra)"
    if find_bin_dir() is None:
        return "PostgreSQL is not installed (no initdb/pg_ctl): apt-get install postgresql"
    return None
