"""``tuner explain``: why a server (or a log) sized its memory as it did."""

from __future__ import annotations

from typing import Annotated

import typer

from tuner.cli.common import app, console


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


@app.command("explain", short_help="Where a server's GPU memory went and what limits capacity.")
def explain_cmd(
    log: Annotated[str | None, typer.Option("--log", help="SGLang log file (plain or .gz; journalctl -o short / short-iso), or - for stdin.")] = None,
    unit: Annotated[str | None, typer.Option("--unit", help="systemd unit whose journal to read.")] = None,
    url: Annotated[str | None, typer.Option("--url", help="running server, e.g. http://127.0.0.1:30000.")] = None,
    model_config: Annotated[str | None, typer.Option("--model-config", help="the model's Hugging Face config.json (or its directory).")] = None,
    journalctl: Annotated[str, typer.Option("--journalctl", help="journalctl command, e.g. 'nsenter -t PID -m -p journalctl'.")] = "journalctl",
    mem_fraction_static: Annotated[float | None, typer.Option("--mem-fraction-static", help="the server's fraction in (0, 1), used only when the input does not state it (a stated value wins; a different one here is reported).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the explanation as JSON (docs/explain-schema.md).")] = False,
) -> None:
    """Where the GPU memory went, what limits capacity, predictions at other fractions, and traps."""
    from tuner.report.explain import renderables
    from tuner.sglang.explain import explain_from

    result = explain_from(log=log, unit=unit, url=url, model_config=model_config, journalctl=journalctl,
                          mem_fraction_static=mem_fraction_static, device_free=_device_free_gib)
    if as_json:
        print(result.model_dump_json(indent=2))
    else:
        console.print(renderables(result))
