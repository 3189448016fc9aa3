"""The one error tree of sglang-tuner.

Every error a user can cause or meet is a :class:`TunerError`. Its message is one line that names
the flag, key, file or URL, the bad value, and the fix. The CLI prints ``str(err)`` on stderr and
exits with :attr:`TunerError.exit_code`; it never shows a traceback for these. Foreign exceptions
(aiohttp, requests, SQLAlchemy, subprocess, OSError) are mapped where those libraries are called,
with ``raise ... from``.

Tree::

    TunerError
    ├── ConfigError            malformed or invalid TOML config, bad CLI option value
    ├── ModelConfigError       a Hugging Face config.json that is missing, unreadable or lacks a field
    ├── LogError               a log that is empty, binary, or not SGLang's
    ├── FlagError              a flag unknown to, or forbidden by, the installed SGLang version
    ├── ServerError            an SGLang server that is unreachable or answers wrongly
    ├── LaunchError            service control: unit missing, systemctl missing, no permission
    │   └── LockHeldError      another tuner holds the unit's lock
    ├── LoadError              the load generator could not run
    ├── StudyError             study storage, budget, resume, environment mismatch
    ├── ApplyError             apply / rollback / undo
    └── GPUError               NVML unavailable or a foreign process holds a GPU
"""

from __future__ import annotations

__all__ = [
    "TunerError",
    "ConfigError",
    "ModelConfigError",
    "LogError",
    "FlagError",
    "ServerError",
    "LaunchError",
    "ServiceControlError",
    "LockHeldError",
    "LoadError",
    "StudyError",
    "ApplyError",
    "GPUError",
    "first_line",
]


class TunerError(Exception):
    """Base of every error the CLI turns into one line on stderr and a non-zero exit.

    Args:
        message: What is wrong, naming the key/flag/file/URL and the bad value.
        hint: How to fix it (appended after " — "), optional.
    """

    exit_code: int = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(f"{message} — {hint}" if hint else message)


class ConfigError(TunerError):
    """A config file or CLI option is malformed or invalid."""


class ModelConfigError(TunerError):
    """A Hugging Face ``config.json`` is missing, unreadable, or lacks a field the KV model needs."""


class LogError(TunerError):
    """A log is empty, binary, or holds no SGLang line."""


class FlagError(TunerError):
    """A flag or flag combination the SGLang version does not accept (unknown, removed, forbidden)."""


class ServerError(TunerError):
    """An SGLang server is unreachable, not ready in time, or answered unexpectedly."""


class LaunchError(TunerError):
    """Service control failed: unknown unit, unreadable ExecStart, systemctl missing, no permission."""


class ServiceControlError(LaunchError):
    """The tuner cannot change the service as a trial needs (its drop-in folder became read-only or
    unwritable): not the candidate's failure, so the run stops instead of recording a crash."""


class HookError(ServiceControlError):
    """A ``[service]`` hook (``pre_restart``, ``post_ready``) failed: exited non-zero, was killed
    by a signal, timed out or could not be run (:func:`tuner.launch.hooks.run_hook`).

    Attributes:
        hook: ``pre_restart`` or ``post_ready``.
    """

    def __init__(self, message: str, *, hook: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.hook = hook


class LockHeldError(LaunchError):
    """Another tuner process holds the lock of this unit."""


class LoadError(TunerError):
    """The load generator could not run (bad workload, server down before the start)."""


class StudyError(TunerError):
    """Study storage, budget, resume, or environment problems."""


class QualityError(TunerError):
    """The quality probe cannot run (the server returns no logprobs) or its input is malformed (an
    evaluation JSONL)."""


class ApplyError(TunerError):
    """Applying a trial's config, its verification, rollback or undo failed."""


class GPUError(TunerError):
    """NVML is unavailable, or a foreign process holds GPU memory."""


def first_line(err: BaseException) -> str:
    """The first line of an exception's text (SQLAlchemy appends SQL and a link on more lines;
    the type's name when the text is empty)."""
    return (str(err).splitlines() or [type(err).__name__])[0]
