"""``tuner explain``: why a server (or a log) sized its memory as it did."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tuner.cli.common import ConfigOpt, StorageOpt, StudyOpt, app, console, non_empty_text, open_stored_study
from tuner.knobs import LEVERS


def _explain_trial(number: int, study: str | None, storage: str | None, config: Path | None, *, given: list[str]):  # noqa: ANN202 - (Explanation, StoredStudy)
    """Trial ``number``'s server log (its artifact) explained, with its study.

    Raises:
        ConfigError: ``--trial`` with another input.
        StudyError: No such study or trial, or the trial kept no server log.
    """
    from tuner.errors import ConfigError, StudyError
    from tuner.sglang.explain import explain_from

    if given:
        raise ConfigError(f"--trial {number} and {' '.join(given)} both name what to explain",
                          hint="pass --trial N (with --study/--storage/--config) or a log, unit or URL")
    stored = open_stored_study(study, storage, config)
    view = stored.trial(number)
    path = stored.artifact_paths(view).get("server_log")
    if path is None or not path.is_file():
        where = "none was stored" if path is None else f"{path} is missing"
        raise StudyError(f"trial {number} of study {stored.name!r} has no server log to explain ({where})",
                         hint="pick a launched trial (`tuner trials`), or pass the log with --log FILE")
    return explain_from(log=str(path), structural=LEVERS), stored


def _device_free_gib(url: str) -> tuple[float, str] | None:
    """The GPU memory free now on the server's tightest GPU (GiB) and where it was read: the
    simulator's ledger when ``url`` serves one, else NVML's GPUs that hold memory; ``None`` when
    neither can be read (``explain`` then predicts headroom from SGLang's own reserve rule)."""
    from tuner.errors import TunerError
    from tuner.gpu import NvmlBackend, SimBackend

    try:
        sim = SimBackend(url).memory()
    except TunerError:
        sim = []
    if sim:
        return min(g.free_mib for g in sim) / 1024, "the simulator's device ledger"
    try:
        backend = NvmlBackend()
    except (TunerError, ImportError, OSError):
        return None
    try:
        held = [g for g in backend.memory() if g.used_mib > 1024]
    except TunerError:
        return None
    finally:
        backend.close()
    if not held:
        return None
    tightest = min(held, key=lambda g: g.free_mib)
    return tightest.free_mib / 1024, f"NVML, GPU {tightest.index}"


def _check_options(*, trial: int | None, mem_fraction_static: float | None, gpu: str | None,
                   model_config: str | None) -> None:
    """Refuse, before any reading, an option ``explain`` would ignore or could not use: the start's
    own options beside ``--trial`` (a stored trial states its fraction, GPU and model), and a
    ``--gpu`` the ladder's table does not know (its cells would all read "unknown").

    Raises:
        ConfigError: Naming the option and the fix.
    """
    from tuner.errors import ConfigError
    from tuner.sglang.levers import gpu_arch

    if trial is not None:
        given = [flag for flag, value in (("--mem-fraction-static", mem_fraction_static), ("--gpu", gpu),
                                          ("--model-config", model_config)) if value is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} is for --log, --unit or --url; --trial {trial} reads its "
                              "fraction, GPU and model from its study", hint=f"drop {', '.join(given)}, or explain the log instead")
    if gpu is not None and gpu_arch(gpu) is None:
        raise ConfigError(f"--gpu {gpu!r} is not a GPU the ladder's table knows",
                          hint="give its architecture (sm80, sm90, sm100, sm120) or a name such as H100, H200, "
                               "B200, L4 or 'RTX PRO 6000'")


@app.command("explain", short_help="Where a server's GPU memory went and what limits capacity.")
def explain_cmd(
    log: Annotated[str | None, typer.Option("--log", parser=non_empty_text, help="SGLang log file (plain or .gz; journalctl -o short / short-iso), or - for stdin.")] = None,
    unit: Annotated[str | None, typer.Option("--unit", parser=non_empty_text, help="systemd unit whose journal to read.")] = None,
    url: Annotated[str | None, typer.Option("--url", parser=non_empty_text, help="running server, e.g. http://127.0.0.1:30000.")] = None,
    model_config: Annotated[str | None, typer.Option("--model-config", parser=non_empty_text, help="the model's Hugging Face config.json (or its directory).")] = None,
    journalctl: Annotated[str, typer.Option("--journalctl", parser=non_empty_text, help="journalctl command, e.g. 'nsenter -t PID -m -p journalctl'.")] = "journalctl",
    mem_fraction_static: Annotated[float | None, typer.Option("--mem-fraction-static", help="the server's fraction in (0, 1), used only when the input does not state it (a stated value wins; a different one here is reported).")] = None,
    gpu: Annotated[str | None, typer.Option("--gpu", parser=non_empty_text, help="the GPU's name or architecture (e.g. 'RTX PRO 6000', sm120) for the ladder's feasibility cells; unknown without it.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the explanation as JSON (docs/explain-schema.md).")] = False,
    trial: Annotated[int | None, typer.Option("--trial", min=0, help="a stored trial: its server log, bounded by what its study measured (with --study, --storage or --config).")] = None,
    study: StudyOpt = None,
    storage: StorageOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Where the GPU memory went, what limits capacity, predictions at other fractions, traps, and the
    structural levers (fp8 KV, DP attention, DCP, speculative decoding off) priced on this start."""
    from tuner.report.explain import bound_by_study, renderables
    from tuner.sglang.explain import explain_from

    _check_options(trial=trial, mem_fraction_static=mem_fraction_static, gpu=gpu, model_config=model_config)
    if trial is not None:
        result = _explain_trial(trial, study, storage, config, given=[f for f, v in (("--log", log), ("--unit", unit), ("--url", url)) if v])
        result = bound_by_study(result[0], result[1], trial)
    else:
        if study or storage or config:
            from tuner.errors import ConfigError

            raise ConfigError("--study, --storage and --config name the study of --trial",
                              hint="pass --trial N with them, or drop them to explain --log, --unit or --url")
        result = explain_from(log=log, unit=unit, url=url, model_config=model_config, journalctl=journalctl,
                              mem_fraction_static=mem_fraction_static, gpu=gpu, device_free=_device_free_gib,
                              structural=LEVERS)
    if as_json:
        print(result.model_dump_json(indent=2))
    else:
        console.print(renderables(result))
