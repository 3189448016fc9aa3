"""A systemd unit as the tuner drives it: ExecStart, drop-ins, systemctl verbs, properties, journal.

These are the low-level primitives shared by the trial launcher (:mod:`tuner.launch.systemd`, the
``90-tuner-trial.conf`` drop-in) and ``tuner apply`` (the persistent ``80-tuner.conf`` drop-in).
Nothing here holds a lock or restores anything; that is :mod:`tuner.launch.session`'s and :class:`tuner.launch.base.GuardedLauncher`'s job.

The ``systemctl`` and ``journalctl`` commands are argv prefixes taken from configuration, so tests
and unusual hosts point them elsewhere without code changes: ``["systemctl"]`` on a normal host,
``["nsenter", "-t", "4242", "-m", "-p", "systemctl"]`` for systemd booted in a private PID namespace
(``shared/systemd-sandbox.md`` §1), ``["systemctl3", "--root=/r/a/b", ...]`` for the
docker-systemctl-replacement emulator (§2). The drop-in folder is configuration too
(``/etc/systemd/system`` by default; the sandbox's ``SYSTEMD_UNIT_PATH`` in tests).

Quoting follows systemd's own rules (``systemd.service(5)``, "Command lines"; ``systemd.syntax(7)``):
a word is double-quoted when it needs it, with C escapes inside; ``%`` is written ``%%`` (specifiers)
and ``$`` is written ``$$`` (environment expansion), so no value can inject a second command or an
expansion. Reading goes the other way and refuses what it cannot read exactly (specifiers other
than ``%%``, ``$VAR`` references, several commands): the tuner never guesses a command line.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from tuner.errors import LaunchError

__all__ = [
    "DEFAULT_DROPIN_DIR",
    "DEFAULT_RUNTIME_DROPIN_DIR",
    "ExecCommand",
    "UnitProperties",
    "SystemdUnit",
    "quote_exec_word",
    "format_exec_command",
    "split_exec_command",
    "atomic_write_text",
    "disk_full",
    "MIN_FREE_BYTES",
]

log = logging.getLogger(__name__)

DEFAULT_DROPIN_DIR = Path("/etc/systemd/system")
"""Where drop-in folders ``<unit>.d/`` live on a normal host."""
DEFAULT_RUNTIME_DROPIN_DIR = Path("/run/systemd/system")
"""systemd's runtime unit folder (a tmpfs forgotten at boot): where a trial's drop-in goes, so a
reboot in the middle of a trial brings the unit up on its own command. systemd merges drop-ins of
every unit folder sorted by file name (``systemd.unit(5)``; a same-named file in ``/etc`` masks one
in ``/run``), so the operator's drop-ins in :data:`DEFAULT_DROPIN_DIR` still apply."""

_PLAIN_WORD = re.compile(r"[A-Za-z0-9_@+=:,./-]+")
_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"}
_UNESCAPES = {
    "a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
    "\\": "\\", '"': '"', "'": "'", "s": " ",
}
_EXEC_PREFIXES = "-:+!"
_SHOW_PROPS = ("LoadState", "ActiveState", "SubState", "Result", "MainPID", "ExecMainStatus",
               "NRestarts")
_FIX_SYSTEMCTL = (
    "install systemd, or set service.systemctl / service.journalctl to the commands that reach it "
    "(e.g. 'nsenter -t PID -m -p systemctl'), or use launcher = \"process\""
)


MIN_FREE_BYTES = 1 << 20
"""Free space below which a folder the tuner must write counts as full (1 MiB: a state file, a
drop-in, a lock and a trial's files need far less, so a refusal means the disk really is full)."""


def disk_full(folder: Path | str, *, min_free_bytes: int = MIN_FREE_BYTES) -> str:
    """Why the file system holding ``folder`` is too full to write on, or ``""`` when it is not.

    Changes nothing (``statvfs``). Space counts what this user may use (root may use the blocks
    reserved for it); a file system that reports no inode count (btrfs) is not judged on inodes.

    Args:
        folder: An existing path on the file system to judge.
        min_free_bytes: Free bytes below which it counts as full.

    Returns:
        ``""``, or e.g. ``"12 KiB free"`` / ``"no inode free"``. A path that cannot be examined,
        or on a file system without blocks (``/proc``, ``/sys``), gives ``""`` (the write itself
        will then say what is wrong).
    """
    try:
        st = os.statvfs(folder)
    except OSError:
        return ""
    if st.f_blocks == 0:  # no blocks at all: a virtual file system (proc, sysfs), not a full disk
        return ""
    blocks = st.f_bfree if os.geteuid() == 0 else st.f_bavail
    free = blocks * st.f_frsize
    if free < min_free_bytes:
        return f"{free // 1024} KiB free"
    if st.f_files and not (st.f_ffree if os.geteuid() == 0 else st.f_favail):
        return "no inode free"
    return ""


def atomic_write_text(path: Path, text: str, *, mode: int = 0o644) -> None:
    """Write ``text`` to ``path`` atomically (temp file in the same folder, fsync, rename).

    Args:
        path: Destination; its folder must exist.
        text: Content (UTF-8).
        mode: Permission bits of the new file.

    Raises:
        OSError: The folder is missing or not writable (callers map it to a TunerError).
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def quote_exec_word(word: str) -> str:
    """Quote one argv word for an ``ExecStart=`` line by systemd's rules.

    Plain words (letters, digits, ``_@+=:,./-``) stay as they are; anything else is double-quoted
    with C escapes. ``%`` becomes ``%%`` and ``$`` becomes ``$$`` in every word, so a value never
    expands a specifier or an environment variable, and a ``;`` inside quotes is data, not a
    command separator.

    Args:
        word: One argument, any text.

    Returns:
        The word as it must appear in the unit file.
    """
    word = word.replace("%", "%%").replace("$", "$$")
    if _PLAIN_WORD.fullmatch(word):
        return word
    out = []
    for ch in word:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def format_exec_command(argv: Sequence[str], prefix: str = "") -> str:
    """The value of an ``ExecStart=`` line running ``argv`` (see :func:`quote_exec_word`).

    Args:
        argv: The command; ``argv[0]`` must be an absolute path.
        prefix: systemd's executable prefixes (``-``, ``:``, ``+``, ``!``) kept from the original.

    Raises:
        LaunchError: ``argv`` is empty or ``argv[0]`` is not absolute.
    """
    if not argv:
        raise LaunchError("empty command for ExecStart", hint="pass the full server command line")
    if not argv[0].startswith("/"):
        raise LaunchError(
            f"ExecStart executable {argv[0]!r} is not an absolute path",
            hint="use the absolute path of the server's python (e.g. /opt/venv/bin/python)",
        )
    return prefix + " ".join(quote_exec_word(w) for w in argv)


class ExecCommand(BaseModel):
    """One parsed ``ExecStart=`` command.

    Attributes:
        argv: The words as the process receives them.
        prefix: systemd's executable prefix characters (``-``, ``:``, ``+``, ``!``), usually empty.
    """

    model_config = ConfigDict(frozen=True)

    argv: list[str]
    prefix: str = ""


def _unescape(text: str, i: int) -> tuple[str, int]:
    """Decode the C escape starting after the backslash at ``text[i]``; return (char, next i)."""
    c = text[i] if i < len(text) else ""
    if c in _UNESCAPES:
        return _UNESCAPES[c], i + 1
    if c == "x" and re.fullmatch(r"[0-9a-fA-F]{2}", text[i + 1 : i + 3]):
        return chr(int(text[i + 1 : i + 3], 16)), i + 3
    if c in "uU":
        n = 4 if c == "u" else 8
        digits = text[i + 1 : i + 1 + n]
        if re.fullmatch(rf"[0-9a-fA-F]{{{n}}}", digits):
            return chr(int(digits, 16)), i + 1 + n
    if re.fullmatch(r"[0-7]{3}", text[i : i + 3]):
        return chr(int(text[i : i + 3], 8)), i + 3
    raise ValueError(f"unknown escape '\\{c}'")


def _split_words(value: str) -> list[tuple[str, bool]]:
    """Split like systemd's ``extract_first_word(UNQUOTE|CUNESCAPE)``: (word, was_quoted) pairs."""
    words: list[tuple[str, bool]] = []
    i, n = 0, len(value)
    while True:
        while i < n and value[i] in " \t\n\r":
            i += 1
        if i >= n:
            return words
        buf: list[str] = []
        quoted = False
        quote = ""
        while i < n:
            ch = value[i]
            if quote:
                if ch == quote:
                    quote = ""
                    i += 1
                elif ch == "\\":
                    decoded, i = _unescape(value, i + 1)
                    buf.append(decoded)
                else:
                    buf.append(ch)
                    i += 1
            elif ch in "'\"":
                quote, quoted = ch, True
                i += 1
            elif ch == "\\":
                decoded, i = _unescape(value, i + 1)
                buf.append(decoded)
                quoted = True
            elif ch in " \t\n\r":
                break
            else:
                buf.append(ch)
                i += 1
        if quote:
            raise ValueError("unterminated quote")
        words.append(("".join(buf), quoted))


def split_exec_command(value: str) -> ExecCommand:
    """Parse the value of an ``ExecStart=`` line into the argv systemd would run.

    Args:
        value: Text after ``ExecStart=`` (line continuations already joined).

    Returns:
        The command with its prefix.

    Raises:
        ValueError: Something the tuner cannot read exactly: a specifier other than ``%%``, an
            environment reference (``$VAR``), several commands, the ``@`` prefix, bad quoting.
    """
    if re.search(r"%[^%]", value.replace("%%", "")):
        raise ValueError("it uses systemd specifiers (%i, %n, ...)")
    value = value.replace("%%", "%")
    pairs = _split_words(value)
    if not pairs:
        raise ValueError("it is empty")
    if any(word == ";" and not quoted for word, quoted in pairs):
        raise ValueError("it holds several commands separated by ';'")
    argv = []
    for word, _ in pairs:
        if re.search(r"\$(?!\$)", word.replace("$$", "")):
            raise ValueError(f"it uses an environment variable ({word!r})")
        argv.append(word.replace("$$", "$"))
    first = argv[0]
    prefix = ""
    while first and first[0] in _EXEC_PREFIXES + "@":
        if first[0] == "@":
            raise ValueError("it uses the '@' prefix (argv[0] differs from the executable)")
        prefix += first[0]
        first = first[1:]
    argv[0] = first
    return ExecCommand(argv=argv, prefix=prefix)


def _exec_start_values(texts: Sequence[str]) -> list[str]:
    """The ``ExecStart=`` values in effect after reading unit files in order (resets honoured)."""
    values: list[str] = []
    for text in texts:
        section = ""
        lines = text.splitlines()
        i = 0
        while i < len(lines):
            line = lines[i].strip()
            i += 1
            while line.endswith("\\") and i < len(lines):
                line = line[:-1] + " " + lines[i].strip()
                i += 1
            if not line or line[0] in "#;":
                continue
            if line.startswith("[") and line.endswith("]"):
                section = line[1:-1]
                continue
            key, sep, val = line.partition("=")
            if section == "Service" and sep and key.strip() == "ExecStart":
                val = val.strip()
                if val:
                    values.append(val)
                else:
                    values.clear()
    return values


class UnitProperties(BaseModel):
    """What ``systemctl show`` says about a service (the fields the launcher polls).

    Attributes:
        load_state: ``loaded`` or ``not-found`` ...
        active_state: ``active``, ``activating``, ``deactivating``, ``inactive``, ``failed``.
        sub_state: ``running``, ``auto-restart``, ``dead``, ``failed`` ...
        result: ``success``, ``exit-code``, ``signal``, ``start-limit-hit`` ... (empty if unknown).
        main_pid: MainPID as seen inside systemd's PID namespace; ``None`` when not running.
        exec_main_status: Exit status of the last main process (``None`` when unknown).
        n_restarts: systemd's ``NRestarts`` (``None`` when the manager does not report it).
    """

    model_config = ConfigDict(frozen=True)

    load_state: str = ""
    active_state: str = ""
    sub_state: str = ""
    result: str = ""
    main_pid: int | None = None
    exec_main_status: int | None = None
    n_restarts: int | None = None


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text not in (None, "") else None
    except ValueError:
        return None


class SystemdUnit:
    """One systemd service, driven through configurable ``systemctl`` / ``journalctl`` commands.

    Args:
        name: Unit name; ``.service`` is appended when it has no suffix.
        systemctl: argv prefix of systemctl (``["systemctl"]``, or with ``nsenter ...``).
        journalctl: argv prefix of journalctl.
        dropin_dir: Folder holding ``<unit>.d/`` drop-in folders (``/etc/systemd/system``).
        runtime_dropin_dir: systemd's runtime unit folder (``/run/systemd/system``, emptied at
            boot): the ``runtime=True`` drop-in methods work in ``<runtime_dropin_dir>/<unit>.d``.
        command_timeout_s: Limit for one systemctl/journalctl call (``stop`` gets 3x).

    .. note:: :meth:`write_dropin`, :meth:`remove_dropin`, :meth:`daemon_reload`, :meth:`start`,
       :meth:`restart`, :meth:`stop` and :meth:`kill` change the production service.
    """

    def __init__(
        self,
        name: str,
        *,
        systemctl: Sequence[str] = ("systemctl",),
        journalctl: Sequence[str] = ("journalctl",),
        dropin_dir: Path | str = DEFAULT_DROPIN_DIR,
        runtime_dropin_dir: Path | str = DEFAULT_RUNTIME_DROPIN_DIR,
        command_timeout_s: float = 60.0,
    ) -> None:
        if not name or "/" in name or name.startswith("-"):
            raise LaunchError(f"bad unit name {name!r}", hint="pass a unit name like sglang.service")
        self.name = name if "." in name else f"{name}.service"
        self.systemctl = list(systemctl)
        self.journalctl = list(journalctl)
        self.dropin_dir = Path(dropin_dir)
        self.runtime_dropin_dir = Path(runtime_dropin_dir)
        self.command_timeout_s = command_timeout_s
        self._journal_line_mode = False

    def __repr__(self) -> str:
        return f"SystemdUnit({self.name!r}, dropin_dir={str(self.dropin_dir)!r})"

    # ---- running commands ---------------------------------------------------------------

    def _run(
        self, prefix: list[str], args: Sequence[str], *, timeout_s: float | None = None,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        cmd = [*prefix, *args]
        timeout_s = timeout_s or self.command_timeout_s
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
            )
        except FileNotFoundError as err:
            raise LaunchError(f"command not found: {cmd[0]!r} (running {' '.join(cmd)})",
                              hint=_FIX_SYSTEMCTL) from err
        except PermissionError as err:
            raise LaunchError(f"no permission to run {cmd[0]!r}",
                              hint="run the tuner as root or with sudo rights for systemctl") from err
        except subprocess.TimeoutExpired as err:
            raise LaunchError(f"'{' '.join(cmd)}' did not answer within {timeout_s:.0f} s",
                              hint="check that the service manager is responsive") from err
        if check and proc.returncode != 0:
            detail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
            tool = "journalctl" if prefix is self.journalctl else "systemctl"
            if "System has not been booted with systemd" in proc.stderr:
                raise LaunchError(f"{tool} cannot reach systemd: {detail}", hint=_FIX_SYSTEMCTL)
            if "Access denied" in proc.stderr or "Interactive authentication" in proc.stderr:
                raise LaunchError(f"no permission for '{tool} {' '.join(args)}': {detail}",
                                  hint="run the tuner as root or grant it polkit rights for the unit")
            hint = ("check journald: systemctl status systemd-journald" if tool == "journalctl"
                    else f"see 'journalctl -u {self.name}'")
            raise LaunchError(f"'{tool} {' '.join(args)}' failed: {detail}", hint=hint)
        return proc

    def systemctl_run(self, *args: str, timeout_s: float | None = None) -> str:
        """Run ``systemctl ARGS`` and return its stdout.

        Raises:
            LaunchError: systemctl is missing, not permitted, timed out, or failed.
        """
        return self._run(self.systemctl, args, timeout_s=timeout_s).stdout

    # ---- properties -----------------------------------------------------------------------

    def show(self, *props: str) -> dict[str, str]:
        """``systemctl show -p A,B unit`` as a dict (missing properties are absent).

        Raises:
            LaunchError: systemctl failed.
        """
        out = self.systemctl_run("show", "-p", ",".join(props), self.name)
        result: dict[str, str] = {}
        for line in out.splitlines():
            key, sep, val = line.partition("=")
            if sep:
                result[key] = val
        return result

    def properties(self) -> UnitProperties:
        """The polled state: LoadState, ActiveState, SubState, Result, MainPID, ExecMainStatus,
        NRestarts.

        Raises:
            LaunchError: systemctl failed.
        """
        p = self.show(*_SHOW_PROPS)
        pid = _int_or_none(p.get("MainPID"))
        return UnitProperties(
            load_state=p.get("LoadState", ""),
            active_state=p.get("ActiveState", ""),
            sub_state=p.get("SubState", ""),
            result=p.get("Result", ""),
            main_pid=pid or None,
            exec_main_status=_int_or_none(p.get("ExecMainStatus")),
            n_restarts=_int_or_none(p.get("NRestarts")),
        )

    def check_exists(self) -> None:
        """Raise unless systemd knows the unit.

        Raises:
            LaunchError: ``LoadState`` is not ``loaded`` (unknown unit, bad unit file), or
                systemctl failed.
        """
        state = self.show("LoadState").get("LoadState", "")
        if state != "loaded":
            raise LaunchError(
                f"unit {self.name} is unknown to systemd (LoadState={state or 'n/a'})",
                hint="check the name with 'systemctl list-units --type=service' or set service.unit",
            )

    # ---- unit files ------------------------------------------------------------------------

    @property
    def dropin_folder(self) -> Path:
        """``<dropin_dir>/<unit>.d`` — the persistent drop-ins (the operator's, ``tuner apply``'s)."""
        return self.dropin_dir / f"{self.name}.d"

    @property
    def runtime_dropin_folder(self) -> Path:
        """``<runtime_dropin_dir>/<unit>.d`` — drop-ins systemd forgets at boot (a trial's)."""
        return self.runtime_dropin_dir / f"{self.name}.d"

    def folder(self, *, runtime: bool = False) -> Path:
        """:attr:`runtime_dropin_folder` when ``runtime``, else :attr:`dropin_folder`."""
        return self.runtime_dropin_folder if runtime else self.dropin_folder

    def unit_files(self) -> list[Path]:
        """The unit file then its drop-ins, in the order systemd reads them.

        Uses ``FragmentPath`` / ``DropInPaths`` when the manager reports them, else the unit file
        and ``*.conf`` under :attr:`dropin_dir` (the docker-systemctl-replacement case).

        Raises:
            LaunchError: The unit is unknown, or systemctl failed.
        """
        self.check_exists()
        p = self.show("FragmentPath", "DropInPaths")
        fragment = p.get("FragmentPath") or str(self.dropin_dir / self.name)
        if "DropInPaths" in p and p.get("FragmentPath"):
            dropins = [Path(x) for x in p["DropInPaths"].split()]
        else:  # merged by file name; a persistent file masks a runtime one of the same name
            by_name = {x.name: x for x in sorted(self.runtime_dropin_folder.glob("*.conf"))}
            by_name.update({x.name: x for x in sorted(self.dropin_folder.glob("*.conf"))})
            dropins = [by_name[n] for n in sorted(by_name)]
        return [Path(fragment), *dropins]

    def exec_command(self, *, ignore_dropins: Sequence[str] = ()) -> ExecCommand:
        """The command the unit runs, read from its unit file and drop-ins.

        Args:
            ignore_dropins: Names of drop-ins in :attr:`dropin_folder` or
                :attr:`runtime_dropin_folder` to leave out (what the command is without the
                tuner's trial drop-in).

        Returns:
            The parsed ``ExecStart=`` in effect.

        Raises:
            LaunchError: Unknown unit; a unit file cannot be read; no ``ExecStart=``, several, or
                one the tuner cannot read exactly (specifiers, ``$VAR``, ``;``).
        """
        texts = []
        for path in self.unit_files():
            if path.parent in (self.dropin_folder, self.runtime_dropin_folder) and path.name in ignore_dropins:
                continue
            try:
                texts.append(path.read_text(encoding="utf-8"))
            except OSError as err:
                raise LaunchError(f"cannot read {path} of unit {self.name}: {err.strerror}",
                                  hint="run the tuner as a user that can read the unit files") from err
        values = _exec_start_values(texts)
        if len(values) != 1:
            raise LaunchError(
                f"unit {self.name} has {len(values)} ExecStart= commands; the tuner needs exactly one",
                hint="give the unit a single ExecStart= running the SGLang server",
            )
        try:
            return split_exec_command(values[0])
        except ValueError as err:
            raise LaunchError(
                f"cannot read the ExecStart= of {self.name} exactly: {err}",
                hint="write the server command with literal values in ExecStart=, "
                "or use launcher = \"process\" with the command",
            ) from err

    def read_dropin(self, filename: str, *, runtime: bool = False) -> str | None:
        """Content of ``<unit>.d/<filename>`` (in :attr:`runtime_dropin_folder` when ``runtime``),
        or ``None`` when absent.

        Raises:
            LaunchError: The file exists but cannot be read.
        """
        path = self.folder(runtime=runtime) / filename
        try:
            return path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except OSError as err:
            raise LaunchError(f"cannot read drop-in {path}: {err.strerror}",
                              hint="run the tuner as root") from err

    def dropins(self) -> dict[str, str]:
        """Every ``*.conf`` in :attr:`dropin_folder`: file name → content (empty when no folder).

        Raises:
            LaunchError: A drop-in cannot be read.
        """
        if not self.dropin_folder.is_dir():
            return {}
        return {p.name: self.read_dropin(p.name) or "" for p in sorted(self.dropin_folder.glob("*.conf"))}

    def check_writable(self, *, runtime: bool = False) -> None:
        """Raise unless the tuner may create, replace and remove files in :attr:`dropin_folder`
        (:attr:`runtime_dropin_folder` when ``runtime``).

        Changes nothing (``os.access``, and ``statvfs`` for a read-only mount and free space).

        Raises:
            LaunchError: The folder (or its parent, when it does not exist yet) is missing, on a
                read-only file system, on a full one (under 64 KiB or no inode free), or not
                writable by this user; the message names it.
        """
        folder = self.folder(runtime=runtime)
        setting = "service.runtime_dropin_dir" if runtime else "service.dropin_dir"
        target = folder if folder.exists() else folder.parent
        if not target.is_dir():
            default = DEFAULT_RUNTIME_DROPIN_DIR if runtime else DEFAULT_DROPIN_DIR
            raise LaunchError(f"the drop-in folder {target} does not exist",
                              hint=f"set {setting} to the folder systemd reads ({default})")
        if os.access(target, os.W_OK | os.X_OK):
            full = disk_full(target)
            if full:
                raise LaunchError(f"the disk holding the drop-in folder {target} is full ({full})",
                                  hint=f"free space on the file system holding {target}")
            return
        try:
            read_only = bool(os.statvfs(target).f_flag & os.ST_RDONLY)
        except OSError:
            read_only = False
        if read_only:
            raise LaunchError(f"cannot write drop-ins in {target}: read-only file system",
                              hint=f"remount it read-write (mount -o remount,rw on the mount holding {target})")
        raise LaunchError(
            f"no permission to write drop-ins in {target}",
            hint=f"run the tuner as root, or set {setting} to the folder systemd reads",
        )

    def check_read_by_manager(self, *, runtime: bool = False) -> None:
        """Refuse a drop-in folder systemd does not read units from (a drop-in there would not apply).

        Compares :attr:`runtime_dropin_dir` (or :attr:`dropin_dir`) with the manager's ``UnitPath``
        (``systemctl show -p UnitPath``); a manager that does not report it (the emulator) passes.
        Changes nothing.

        Raises:
            LaunchError: The folder is not in the manager's unit path (the message lists it), or
                systemctl is missing or timed out.
        """
        folder = self.runtime_dropin_dir if runtime else self.dropin_dir
        proc = self._run(self.systemctl, ["show", "-p", "UnitPath"], check=False)
        paths = proc.stdout.partition("UnitPath=")[2].split() if proc.returncode == 0 else []
        if not paths:
            return
        if os.path.realpath(folder) not in {os.path.realpath(p) for p in paths}:
            setting = "service.runtime_dropin_dir" if runtime else "service.dropin_dir"
            default = DEFAULT_RUNTIME_DROPIN_DIR if runtime else DEFAULT_DROPIN_DIR
            raise LaunchError(
                f"systemd does not read units from {folder} (its unit path: {' '.join(paths)}): "
                f"a drop-in written there would not change {self.name}",
                hint=f"set {setting} to a folder of that path (usually {default})",
            )

    def write_dropin(self, filename: str, text: str, *, runtime: bool = False) -> Path:
        """Write ``<unit>.d/<filename>`` atomically (in :attr:`runtime_dropin_folder` when
        ``runtime``), creating the folder if needed.

        Raises:
            LaunchError: No permission, the folder cannot be created, or the disk is full (named
                as such).
        """
        folder = self.folder(runtime=runtime)
        path = folder / filename
        try:
            folder.mkdir(mode=0o755, parents=False, exist_ok=True)
            atomic_write_text(path, text)
        except OSError as err:
            if err.errno == errno.ENOSPC:
                raise LaunchError(f"the disk holding {path} is full",
                                  hint=f"free space on the file system holding {folder}") from err
            setting = "service.runtime_dropin_dir" if runtime else "service.dropin_dir"
            raise LaunchError(f"cannot write drop-in {path}: {err.strerror}",
                              hint=f"run the tuner as root, or set {setting}") from err
        return path

    def remove_dropin(self, filename: str, *, runtime: bool = False) -> bool:
        """Remove ``<unit>.d/<filename>`` (in :attr:`runtime_dropin_folder` when ``runtime``);
        return whether it existed. Removes the folder if empty.

        Raises:
            LaunchError: No permission.
        """
        folder = self.folder(runtime=runtime)
        path = folder / filename
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        except OSError as err:
            raise LaunchError(f"cannot remove drop-in {path}: {err.strerror}",
                              hint="run the tuner as root") from err
        with contextlib.suppress(OSError):
            folder.rmdir()
        return True

    @staticmethod
    def exec_start_dropin(argv: Sequence[str], *, prefix: str = "", header: str = "") -> str:
        """Text of a drop-in replacing the unit's command: ``ExecStart=`` then the new one.

        Args:
            argv: The full command.
            prefix: Executable prefix kept from the original (see :class:`ExecCommand`).
            header: Comment lines (without ``#``) put on top.

        Raises:
            LaunchError: ``argv`` is empty or its executable is not absolute.
        """
        comments = "".join(f"# {line}\n" for line in header.splitlines())
        return f"{comments}[Service]\nExecStart=\nExecStart={format_exec_command(argv, prefix)}\n"

    # ---- verbs -----------------------------------------------------------------------------

    def daemon_reload(self) -> None:
        """``systemctl daemon-reload``. Raises LaunchError on failure."""
        self.systemctl_run("daemon-reload")

    def start(self) -> None:
        """``systemctl start``; its exit code says only that the start was issued (§ sandbox doc)."""
        self.systemctl_run("start", self.name)

    def restart(self) -> None:
        """``systemctl restart`` (see :meth:`start` on what its exit code means)."""
        self.systemctl_run("restart", self.name)

    def stop(self, timeout_s: float | None = None) -> None:
        """``systemctl stop``: returns when systemd considers the unit stopped."""
        self.systemctl_run("stop", self.name, timeout_s=timeout_s or 3 * self.command_timeout_s)

    def reset_failed(self) -> None:
        """``systemctl reset-failed`` (clears the start-limit counter); failures are ignored."""
        self._run(self.systemctl, ["reset-failed", self.name], check=False)

    def kill(self, signal_name: str = "SIGTERM") -> None:
        """``systemctl kill -s SIG`` — signal the service inside its PID namespace."""
        self.systemctl_run("kill", "-s", signal_name, self.name)

    # ---- journal ---------------------------------------------------------------------------

    def journal_cursor(self) -> str:
        """A cursor at the current end of the journal; pass it to :meth:`journal_after`.

        Returns ``"line:N"`` with managers whose journalctl has no cursors (the emulator), and
        ``""`` when the journal is empty (then everything of the unit counts as new).
        """
        if not self._journal_line_mode:
            proc = self._run(self.journalctl, ["-n", "1", "--show-cursor", "-o", "cat", "--no-pager"],
                             check=False)
            if proc.returncode == 0:
                return _last_cursor(proc.stdout) or ""
            self._journal_line_mode = True
            log.info("journalctl has no cursors (%s); counting lines instead",
                     proc.stderr.strip().splitlines()[-1:] or proc.returncode)
        return f"line:{len(self._unit_lines_plain())}"

    def _unit_lines_plain(self) -> list[str]:
        return self._run(self.journalctl, ["-u", self.name, "--no-pager"]).stdout.splitlines()

    def check_journal(self) -> None:
        """Refuse, changing nothing, a journal the tuner could not read a trial's log from.

        Runs ``journalctl -n 1 --show-cursor`` (real journald; then ``systemd-journald`` must be
        active, or no line reaches the journal) or, for managers without cursors (the emulator),
        ``journalctl -u UNIT``.

        Raises:
            LaunchError: journalctl is missing, exits non-zero, or journald is not running.
        """
        cmd = " ".join(self.journalctl)
        fix = "set service.journalctl to a working journalctl (e.g. [\"journalctl\"]) and check journald"
        try:
            proc = self._run(self.journalctl, ["-n", "1", "--show-cursor", "-o", "cat", "--no-pager"], check=False)
            if proc.returncode == 0 and _last_cursor(proc.stdout):
                state = self.show_unit("systemd-journald.service", "ActiveState").get("ActiveState", "")
                if state not in ("active", "reloading"):
                    raise LaunchError(f"journald is not running (systemd-journald.service is {state or 'unknown'}): "
                                      f"no log line of {self.name} would reach the tuner",
                                      hint="start it: systemctl start systemd-journald")
                return
            self._run(self.journalctl, ["-u", self.name, "-n", "1", "--no-pager"])
        except LaunchError as err:
            if "journald is not running" in str(err):
                raise
            raise LaunchError(f"the journal of {self.name} cannot be read with {cmd!r}: {err.message}",
                              hint=fix) from err

    @property
    def journal_has_cursors(self) -> bool:
        """Whether journalctl answered with cursors (real journald; not the emulator's plain log)."""
        return not self._journal_line_mode

    def journald_instance(self) -> str:
        """Which journald runs now: ``"<InvocationID>/<MainPID>"`` of ``systemd-journald.service``
        while it is active, ``""`` while it is not. A journald that was stopped (and started again,
        e.g. by its socket) is another instance: the lines logged meanwhile are lost, and a
        service's stdout connected to the old one is cut.

        Raises:
            LaunchError: systemctl failed.
        """
        p = self.show_unit("systemd-journald.service", "ActiveState", "InvocationID", "MainPID")
        if p.get("ActiveState") not in ("active", "reloading"):
            return ""
        return f"{p.get('InvocationID', '')}/{p.get('MainPID', '')}"

    def show_unit(self, unit: str, *props: str) -> dict[str, str]:
        """``systemctl show -p A,B UNIT`` for another unit (e.g. journald) as a dict.

        Raises:
            LaunchError: systemctl failed.
        """
        out = self.systemctl_run("show", "-p", ",".join(props), unit)
        return {k: v for k, sep, v in (line.partition("=") for line in out.splitlines()) if sep}

    def journal_after(self, cursor: str) -> tuple[list[str], str]:
        """The unit's journal lines after ``cursor`` (message text only), and the new cursor.

        Reads ``journalctl -u UNIT -o json --cursor C`` and drops the entry at ``C`` itself:
        ``--after-cursor`` with a ``-u`` match skips the first matching entry when the cursor's
        own entry does not match (it belongs to another unit), losing a line.

        Raises:
            LaunchError: journalctl is missing or failed.
        """
        if cursor.startswith("line:"):
            lines = self._unit_lines_plain()
            seen = int(cursor[5:])
            return lines[seen:], f"line:{max(seen, len(lines))}"
        args = ["-u", self.name, "-o", "json", "--no-pager"]
        args += ["--cursor", cursor] if cursor else []
        proc = self._run(self.journalctl, args)
        lines = []
        new_cursor = cursor
        for raw in proc.stdout.splitlines():
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(entry, dict) or entry.get("__CURSOR") == cursor:
                continue
            new_cursor = entry.get("__CURSOR", new_cursor)
            lines.extend(_message_text(entry.get("MESSAGE")).splitlines() or [""])
        return lines, new_cursor


def _message_text(message: object) -> str:
    """A journal MESSAGE field as text (journalctl writes non-UTF-8 ones as byte arrays)."""
    if isinstance(message, list):
        return bytes(int(b) & 0xFF for b in message).decode("utf-8", "replace")
    return "" if message is None else str(message)


def _last_cursor(text: str) -> str | None:
    for line in reversed(text.splitlines()):
        if line.startswith("-- cursor: "):
            return line[len("-- cursor: ") :].strip()
    return None
