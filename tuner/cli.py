"""The ``tuner`` command line (typer). Thin: parse, validate into a model, call one entry point, print.

Every :class:`tuner.errors.TunerError` becomes one line on stderr and exit status 1; nothing else
prints a traceback for user errors. Each issue's commands live in their own section below.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from typer import Abort

try:  # typer >= 0.22 vendors click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
except ImportError:  # pragma: no cover - older typer depends on click itself
    from click.exceptions import ClickException, NoArgsIsHelpError
from rich.markup import escape

from tuner.errors import TunerError

app = typer.Typer(
    name="tuner",
    help=(
        "Auto-tune an SGLang server's memory and scheduling knobs (mem_fraction_static, "
        "max_running_requests, chunked prefill, hierarchical cache) with an Optuna study.\n\n"
        "Typical use: `tuner run --config configs/demo-sim.toml --budget 3m`, then "
        "`tuner trials`, `tuner best`, `tuner apply best`."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts name TOML sections like [study]: print them literally
)
console = Console()
err_console = Console(stderr=True)

# ---- sim (issue: simulated SGLang server) -------------------------------------------------

sim_app = typer.Typer(
    help="The simulated SGLang server (no GPU needed).", no_args_is_help=True, rich_markup_mode=None
)
app.add_typer(sim_app, name="sim")


@sim_app.command(
    "serve",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
def sim_serve(ctx: typer.Context) -> None:
    """Start the simulated SGLang server; every argument goes to `python -m tuner.sim`.

    It takes sglang.launch_server's flags of the mimicked version plus --sim-* options
    (`tuner sim serve --help` lists them), e.g. `tuner sim serve --model-path llama-3.1-8b
    --sim-gpu H100-80GB --port 30000`.
    """
    from tuner.sim.__main__ import main as sim_main

    raise typer.Exit(sim_main(list(ctx.args)))


# ---- explain (issue: SGLang knowledge) ------------------------------------------------------

from typing import Annotated as _ExplainAnn  # noqa: E402


@app.command("explain")
def explain_cmd(
    log: _ExplainAnn[str | None, typer.Option("--log", help="SGLang log file (plain or .gz; journalctl -o short / short-iso), or - for stdin.")] = None,
    unit: _ExplainAnn[str | None, typer.Option("--unit", help="systemd unit whose journal to read.")] = None,
    url: _ExplainAnn[str | None, typer.Option("--url", help="running server, e.g. http://127.0.0.1:30000.")] = None,
    model_config: _ExplainAnn[str | None, typer.Option("--model-config", help="the model's Hugging Face config.json (or its directory).")] = None,
    journalctl: _ExplainAnn[str, typer.Option("--journalctl", help="journalctl command, e.g. 'nsenter -t PID -m -p journalctl'.")] = "journalctl",
    mem_fraction_static: _ExplainAnn[float | None, typer.Option("--mem-fraction-static", help="the server's fraction in (0, 1), used only when the input does not state it (a stated value wins; a different one here is reported).")] = None,
    as_json: _ExplainAnn[bool, typer.Option("--json", help="print the explanation as JSON (docs/explain-schema.md).")] = False,
) -> None:
    """Where the GPU memory went, what limits capacity, predictions at other fractions, and traps."""
    from tuner.sglang.explain import explain_from, renderables

    result = explain_from(log=log, unit=unit, url=url, model_config=model_config, journalctl=journalctl,
                          mem_fraction_static=mem_fraction_static)
    if as_json:
        print(result.model_dump_json(indent=2))
    else:
        console.print(renderables(result))


# ---- restore / launch (issue: service control) ----------------------------------------------

from pathlib import Path as _LaunchPath  # noqa: E402
from typing import Annotated as _LaunchAnn  # noqa: E402
from typing import Any as _LaunchAny  # noqa: E402


def _launch_settings(config: _LaunchPath | None, unit: str | None, state_dir: _LaunchPath | None,
                     systemctl: str | None, journalctl: str | None, dropin_dir: _LaunchPath | None,
                     url: str | None) -> dict[str, _LaunchAny] | None:  # fmt: skip
    """The [service] settings of --config, overridden by the explicit options (None if neither)."""
    settings: dict[str, _LaunchAny] = {}
    if config is not None:
        from tuner.config import load_config

        settings = load_config(config).service.model_dump()
    overrides = {"unit": unit, "state_dir": state_dir, "systemctl": systemctl, "journalctl": journalctl,
                 "dropin_dir": dropin_dir, "url": url}  # fmt: skip
    settings.update({k: str(v) for k, v in overrides.items() if v is not None})
    return settings or None


@app.command("restore")
def restore_cmd(
    unit: _LaunchAnn[str | None, typer.Option("--unit", help="The unit (or process launcher name) to put back.")] = None,
    config: _LaunchAnn[_LaunchPath | None, typer.Option("--config", help="The run's TOML config (its service section).")] = None,
    state_dir: _LaunchAnn[_LaunchPath | None, typer.Option("--state-dir", help="Folder of locks and state files.")] = None,
    systemctl: _LaunchAnn[str | None, typer.Option(help="systemctl command (e.g. 'nsenter -t PID -m -p systemctl').")] = None,
    journalctl: _LaunchAnn[str | None, typer.Option(help="journalctl command.")] = None,
    dropin_dir: _LaunchAnn[_LaunchPath | None, typer.Option(help="Folder holding <unit>.d/.")] = None,
    url: _LaunchAnn[str | None, typer.Option(help="Server URL checked for health.")] = None,
    timeout_s: _LaunchAnn[float, typer.Option("--timeout-s", help="How long the server may take to be healthy.")] = 900.0,
) -> None:
    """Put the service back as it was before a tuning run (after a crash, kill -9 or Ctrl-C).

    Uses the state file the run wrote before its first change: the original command and
    drop-ins come back, the trial drop-in goes, and the server is restarted and checked healthy.
    """
    from tuner.errors import ConfigError
    from tuner.launch.factory import restore_service

    if unit is None and config is None:
        raise ConfigError("tuner restore needs the service", hint="pass --unit UNIT or --config FILE")
    settings = _launch_settings(config, unit, state_dir, systemctl, journalctl, dropin_dir, url)
    launcher, state, source = restore_service(settings, unit=unit, state_dir=state_dir, timeout_s=timeout_s)
    shown = " ".join(launcher.current_argv())
    if source == "nothing":
        console.print(f"{launcher.key}: nothing to restore (no state file, no trial drop-in); {state.phase.value}",
                      highlight=False, soft_wrap=True)  # fmt: skip
        return
    console.print(f"restored {launcher.key} from the {source}: {state.phase.value}, command: {shown}",
                  highlight=False, soft_wrap=True)  # fmt: skip


@app.command("launch")
def launch_cmd(
    config: _LaunchAnn[_LaunchPath, typer.Option("--config", help="The run's TOML config (its service section).")],
    set_flags: _LaunchAnn[list[str] | None, typer.Option("--set", help="FLAG=VALUE to change, e.g. mem-fraction-static=0.8; checked against the service's SGLang flags.")] = None,
) -> None:
    """Preview a trial: the drop-in (or command) the tuner would write for --set flags. Changes nothing.

    Starting a trial for real is `tuner run`'s job: it holds the lock and restores the service.
    """
    from tuner.config import load_config
    from tuner.launch.preview import preview
    from tuner.entrypoints import resolve_flag_table, resolve_launcher

    cfg = load_config(config)
    launcher = resolve_launcher(cfg)
    text = preview(launcher, set_flags or [], resolve_flag_table(cfg, launcher.current_argv()))
    console.print(text, highlight=False, soft_wrap=True, markup=False)


# ---- load (issue: load generator) -----------------------------------------------------------

from pathlib import Path as _LoadPath  # noqa: E402
from typing import Annotated as _LoadAnn  # noqa: E402

_LOAD_SUMMARY_ROWS = (
    ("completed / errored / incomplete", None),
    ("duration (s)", "duration"),
    ("request throughput (req/s)", "request_throughput"),
    ("output throughput (tok/s)", "output_throughput"),
    ("total throughput (tok/s)", "total_throughput"),
    ("concurrency (mean in flight)", "concurrency"),
    ("TTFT mean / p50 / p99 (ms)", "ttft"),
    ("ITL mean / p50 / p99 (ms)", "itl"),
    ("TPOT mean / p50 / p99 (ms)", "tpot"),
    ("E2E latency mean / p50 / p99 (ms)", "e2e_latency"),
    ("prefix-cache hit rate", "cache_hit_rate"),
    ("error rate", "error_rate"),
    ("goodput (req/s meeting the SLO)", "goodput"),
    ("SLO attainment", "slo_attainment"),
)


def _load_fmt(value: object, pct: bool = False) -> str:
    if value is None:
        return "-"
    if pct:
        return f"{float(value):.1%}"  # type: ignore[arg-type]
    return f"{value:,.2f}" if isinstance(value, float) else str(value)


def _load_summary_table(summary, title: str):  # noqa: ANN001, ANN202 - LoadSummary -> rich Table
    from rich.table import Table

    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, key in _LOAD_SUMMARY_ROWS:
        if key is None:
            value = f"{summary.completed} / {summary.errored} / {summary.incomplete}"
        elif key in ("ttft", "itl", "tpot", "e2e_latency"):
            value = " / ".join(_load_fmt(getattr(summary, f"{p}_{key}_ms")) for p in ("mean", "median", "p99"))
        else:
            value = _load_fmt(getattr(summary, key), pct=key in ("cache_hit_rate", "error_rate", "slo_attainment"))
        table.add_row(label, value)
    if summary.slo_met is not None:
        verdict = "[green]met[/]" if summary.slo_met else "[red]missed[/]"
        worst = ", ".join(
            f"{k} {'n/a' if v is None else f'{v:+.0%}'}" for k, v in summary.slo_violations.items()
        )
        table.add_row("SLO", f"{verdict} ({worst})")
    return table


def _load_check_out(path: _LoadPath | None, flag: str) -> None:
    """Fail before any load is sent when ``path`` (an output file) could not be written."""
    import os

    from tuner.errors import ConfigError

    if path is None:
        return
    folder = path.parent
    if path.is_dir():
        problem = "is a folder"
    elif not folder.is_dir():
        problem = f"is in a folder that does not exist ({folder})"
    elif not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        problem = "is not writable"
    else:
        return
    raise ConfigError(f"{flag} {path} {problem}", hint=f"pass a file path in an existing, writable folder to {flag}")


def _load_print_errors(summary) -> None:  # noqa: ANN001 - LoadSummary
    if summary.top_errors:
        console.print(f"errors ({summary.errored}), most common first:", highlight=False)
        for e in summary.top_errors:
            console.print(f"  {e.count:>6} x {e.kind or 'error'}: {escape(e.example)}", highlight=False, soft_wrap=True)


def _load_live_line(stats) -> str:  # noqa: ANN001 - LiveStats
    p99 = "-" if stats.p99_ttft_ms_so_far is None else f"{stats.p99_ttft_ms_so_far:,.0f} ms"
    return (
        f"[bold]{stats.phase}[/] {stats.elapsed_s:6.1f} s  sent {stats.sent}  done {stats.completed}  "
        f"errors {stats.errored}  in flight {stats.in_flight}  waiting {stats.waiting}  "
        f"{stats.output_tok_s:,.0f} tok/s  p99 TTFT {p99}"
    )


def _load_steps_table(found):  # noqa: ANN001, ANN202 - MaxLoadResult -> rich Table
    from rich.table import Table

    table = Table(title=f"tuner load --max-under-slo ({found.knob})", title_justify="left")
    for name in ("level", "verdict", "met [CI]", "n", "req/s", "tok/s", "p99 TTFT ms", "p99 ITL ms"):
        table.add_column(name, justify="left" if name == "verdict" else "right",
                         min_width=len("indeterminate") if name == "verdict" else None)
    for step in found.steps:
        table.add_row(
            f"{step.value:g}", step.verdict,
            f"{_load_fmt(step.attainment, pct=True)} [{step.ci_low:.0%}-{step.ci_high:.0%}]", str(step.judged),
            _load_fmt(step.request_throughput), f"{step.output_throughput:,.0f}",
            _load_fmt(step.p99_ttft_ms), _load_fmt(step.p99_itl_ms),
        )
    return table


@app.command("load")
def load_cmd(
    url: _LoadAnn[str, typer.Option("--url", help="the server's base URL, e.g. http://127.0.0.1:30000.")],
    api: _LoadAnn[str, typer.Option("--api", help="generate (/generate, input_ids) or completions (/v1/completions).")] = "generate",
    workload: _LoadAnn[str, typer.Option("--workload", help="random, shared-prefix, multi-turn or trace.")] = "random",
    input_len: _LoadAnn[int | None, typer.Option("--input-len", help="random: prompt tokens [1024].")] = None,
    output_len: _LoadAnn[int | None, typer.Option("--output-len", help="output tokens (ignore_eos) [256].")] = None,
    range_ratio: _LoadAnn[float | None, typer.Option("--range-ratio", help="random: lengths uniform in [L*r, L] [1.0].")] = None,
    num_requests: _LoadAnn[int | None, typer.Option("--num-requests", help="random: requests per pass [endless].")] = None,
    num_groups: _LoadAnn[int | None, typer.Option("--num-groups", help="shared-prefix: system prompts [64].")] = None,
    prompts_per_group: _LoadAnn[int | None, typer.Option("--prompts-per-group", help="shared-prefix: questions per system prompt [16].")] = None,
    system_prompt_len: _LoadAnn[int | None, typer.Option("--system-prompt-len", help="shared-prefix: tokens [2048].")] = None,
    question_len: _LoadAnn[int | None, typer.Option("--question-len", help="shared-prefix: tokens [128].")] = None,
    num_sessions: _LoadAnn[int | None, typer.Option("--num-sessions", help="multi-turn: conversations [32].")] = None,
    turns: _LoadAnn[int | None, typer.Option("--turns", help="multi-turn: turns per conversation [4].")] = None,
    first_input_len: _LoadAnn[int | None, typer.Option("--first-input-len", help="multi-turn: first prompt tokens [1024].")] = None,
    turn_input_len: _LoadAnn[int | None, typer.Option("--turn-input-len", help="multi-turn: new user tokens per turn [128].")] = None,
    trace: _LoadAnn[_LoadPath | None, typer.Option("--trace", help="trace: JSONL file (timestamp_s, input_len, output_len, ...).")] = None,
    time_scale: _LoadAnn[float | None, typer.Option("--time-scale", help="trace: multiply its time offsets [1.0].")] = None,
    seed: _LoadAnn[int, typer.Option("--seed", help="seed of prompts and arrivals.")] = 0,
    vocab_size: _LoadAnn[int, typer.Option("--vocab-size", help="token ids are drawn below this.")] = 32000,
    concurrency: _LoadAnn[int | None, typer.Option("--concurrency", help="closed loop: requests in flight (with --rate: a cap).")] = None,
    rate: _LoadAnn[float | None, typer.Option("--rate", help="open loop: mean arrivals, requests/s.")] = None,
    burstiness: _LoadAnn[float, typer.Option("--burstiness", help="gamma shape of arrivals: 1 = Poisson, < 1 burstier.")] = 1.0,
    max_under_slo: _LoadAnn[bool, typer.Option("--max-under-slo", help="search the highest --knob level meeting --slo.")] = False,
    knob: _LoadAnn[str, typer.Option("--knob", help="--max-under-slo: concurrency or rate.")] = "concurrency",
    start: _LoadAnn[float, typer.Option("--start", help="--max-under-slo: first level.")] = 1,
    max_value: _LoadAnn[float, typer.Option("--max-value", help="--max-under-slo: highest level.")] = 1024,
    time_budget: _LoadAnn[float, typer.Option("--time-budget", help="--max-under-slo: seconds for the whole search.")] = 600,
    target_attainment: _LoadAnn[float, typer.Option("--target-attainment", help="--max-under-slo: share of requests that must meet the SLO.")] = 0.9,
    slo: _LoadAnn[str | None, typer.Option("--slo", help='limits, e.g. "p99_ttft_ms=2000,p99_itl_ms=100".')] = None,
    duration: _LoadAnn[float | None, typer.Option("--duration", help="measured window, s (per level with --max-under-slo).")] = None,
    warmup: _LoadAnn[float | None, typer.Option("--warmup", help="unmeasured warm-up, s.")] = None,
    cooldown: _LoadAnn[float, typer.Option("--cooldown", help="unmeasured load while measured requests finish, s.")] = 0.0,
    max_requests: _LoadAnn[int | None, typer.Option("--max-requests", help="measured requests to send.")] = None,
    request_timeout: _LoadAnn[float, typer.Option("--request-timeout", help="limit per request, s.")] = 600.0,
    timeout: _LoadAnn[float | None, typer.Option("--timeout", help="limit for the whole run, s.")] = None,
    model: _LoadAnn[str | None, typer.Option("--model", help="completions: model name [from /v1/models].")] = None,
    transport: _LoadAnn[str, typer.Option("--transport", help="raw (own HTTP/1.1, least CPU) or aiohttp.")] = "raw",
    json_out: _LoadAnn[_LoadPath | None, typer.Option("--json", help="write the summary (or search result) as JSON.")] = None,
    csv_out: _LoadAnn[_LoadPath | None, typer.Option("--csv", help="write one row per request as CSV.")] = None,
    max_error_rate: _LoadAnn[float, typer.Option("--max-error-rate", help="exit 1 above this share of errored requests (0-1); always when none completed.")] = 0.1,
) -> None:
    """Load an SGLang server with a streaming workload and report bench_serving's metrics.

    Examples: `tuner load --url http://127.0.0.1:30000 --concurrency 64 --duration 60`;
    `tuner load --url URL --workload shared-prefix --rate 8 --duration 120 --json out.json`;
    `tuner load --url URL --max-under-slo --slo "p99_ttft_ms=2000" --duration 30`.
    """
    import json as _json

    from rich.live import Live

    from tuner.errors import ConfigError, LoadError
    from tuner.load import SLO, build_workload, find_max_under_slo_async, run_load
    from tuner.load.runner import run_sync
    from tuner.load.workloads import spec_from_options

    if api not in ("generate", "completions"):
        raise ConfigError(f"--api {api!r} is unknown", hint="use --api generate or --api completions")
    if transport not in ("raw", "aiohttp"):
        raise ConfigError(f"--transport {transport!r} is unknown", hint="use --transport raw or --transport aiohttp")
    if max_under_slo and (concurrency is not None or rate is not None):
        raise ConfigError("--max-under-slo searches the level itself", hint="drop --concurrency / --rate")
    if max_under_slo and knob not in ("concurrency", "rate"):
        raise ConfigError(f"--knob {knob!r} is unknown", hint="use --knob concurrency or --knob rate")
    if max_under_slo and not slo:
        raise ConfigError("--max-under-slo needs limits", hint='add --slo "p99_ttft_ms=2000,p99_itl_ms=100"')
    if max_under_slo and csv_out is not None:
        raise ConfigError("--csv writes per-request rows of one run", hint="drop --csv with --max-under-slo")
    if not 0 <= max_error_rate <= 1:
        raise ConfigError(f"--max-error-rate {max_error_rate:g} is not a share", hint="use a value in [0, 1], e.g. 0.1")
    _load_check_out(json_out, "--json")
    _load_check_out(csv_out, "--csv")
    spec = spec_from_options(workload, {
        "input_len": input_len, "output_len": output_len, "range_ratio": range_ratio, "num_requests": num_requests,
        "num_groups": num_groups, "prompts_per_group": prompts_per_group, "system_prompt_len": system_prompt_len,
        "question_len": question_len, "num_sessions": num_sessions, "turns": turns,
        "first_input_len": first_input_len, "turn_input_len": turn_input_len, "path": trace, "time_scale": time_scale,
    })
    limits = SLO.parse(slo) if slo else None
    wl = build_workload(spec, seed=seed, vocab_size=vocab_size)

    with Live(console=err_console, transient=True, refresh_per_second=4) as live:
        def tick(stats) -> None:  # noqa: ANN001 - LiveStats
            live.update(_load_live_line(stats))

        if max_under_slo:
            def step_done(step) -> None:  # noqa: ANN001 - SearchStep
                live.console.print(
                    f"{knob} {step.value:g}: [bold]{step.verdict}[/] attainment "
                    f"{_load_fmt(step.attainment, pct=True)} [{step.ci_low:.0%}, {step.ci_high:.0%}] of {step.judged}, "
                    f"{step.output_throughput:,.0f} tok/s, p99 TTFT {_load_fmt(step.p99_ttft_ms)} ms"
                    + (f" — {escape(step.note)}" if step.note else ""),
                    soft_wrap=True,
                )

            found = run_sync(find_max_under_slo_async(
                url, wl, limits, knob=knob, start=start, max_value=max_value,  # type: ignore[arg-type]
                step_duration_s=duration or 30.0, warmup_s=warmup, time_budget_s=time_budget,
                target_attainment=target_attainment, api=api, seed=seed,  # type: ignore[arg-type]
                request_timeout_s=request_timeout, on_step=step_done, on_tick=tick,
                transport=transport,  # type: ignore[arg-type]
            ))
        else:
            result = run_sync(run_load(
                url, wl, concurrency=concurrency, rate=rate, burstiness=burstiness, warmup_s=warmup or 0.0,
                duration_s=duration, max_requests=max_requests, cooldown_s=cooldown, api=api,  # type: ignore[arg-type]
                slo=limits, on_tick=tick, request_timeout_s=request_timeout, timeout_s=timeout, seed=seed, model=model,
                transport=transport,  # type: ignore[arg-type]
            ))
    console.print(f"workload: {wl.describe()}", highlight=False, soft_wrap=True)
    if max_under_slo:
        console.print(_load_steps_table(found))
        if found.answered:
            console.print(found.message, highlight=False, markup=False, soft_wrap=True)
        payload = found.model_dump(mode="json")
        partial = found.status == "aborted"
    else:
        mode = result.settings["mode"]
        pace = f"concurrency {concurrency}" if mode == "closed" else (f"rate {rate:g} req/s" if rate else "trace times")
        console.print(_load_summary_table(result.summary, f"tuner load — {workload}, {pace}, {api}"))
        _load_print_errors(result.summary)
        payload = result.to_json_dict()
        partial = result.partial
        if result.stopped_early or result.partial:
            err_console.print(f"[yellow]{'partial' if result.partial else 'stopped early'}:[/] {result.stop_reason}",
                              highlight=False)
        if csv_out is not None:
            result.write_csv(csv_out)
    if json_out is not None:
        try:
            json_out.write_text(_json.dumps(payload, indent=2) + "\n")
        except OSError as err:
            raise ConfigError(f"cannot write --json {json_out}: {err.strerror}", hint="pass a writable path") from err
    if partial:
        raise typer.Exit(1)
    if max_under_slo and not found.answered:
        raise LoadError(f"--max-under-slo reached no answer ({found.status}): {found.message}")
    failure = None if max_under_slo else result.summary.failure(max_error_rate)
    if failure is not None:
        raise LoadError(failure)


# ---- run / init (issue: tuner run) ----------------------------------------------------------

from pathlib import Path as _RunPath  # noqa: E402
from typing import Annotated as _RunAnn  # noqa: E402


def _print_best_vs_baseline(summary, chosen) -> None:  # noqa: ANN001 - tuner.study.loop.RunSummary, results.BestTrial
    """The closing summary; ``chosen`` is the run's :attr:`RunSummary.best` as
    :func:`tuner.results.present_best` shows it (:func:`tuner.study.best.choose_best`, the rule
    `tuner best` applies), ``None`` when no trial is feasible."""
    from rich.table import Table

    from tuner.study.best import max_running_requests_cut

    def fmt(value, spec: str = ".0f") -> str:  # noqa: ANN001
        return "-" if value is None else format(value, spec)

    console.print(
        f"study [bold]{summary.study_name}[/] ({summary.storage_url}): {summary.trials_run} trial(s) launched, "
        f"{summary.trials_skipped} skipped without a restart, stopped by {summary.stop_reason}"
        + (f"; re-enqueued interrupted trial(s) {summary.recovered}" if summary.recovered else ""),
        highlight=False,
    )
    if chosen is None:
        console.print("no feasible trial yet: nothing beats the baseline (see `tuner trials`)")
        return
    base = chosen.baseline.record if chosen.baseline else None
    best = chosen.trial
    table = Table(title=f"best (trial {best.number}) vs baseline"
                  + (f" (trial {chosen.baseline.number})" if chosen.baseline else ""))
    for column in ("", "baseline", "best", "change"):
        table.add_column(column, justify="right" if column else "left")
    rows = [
        ("context capacity (requests)", "context_capacity", "d"),
        ("token capacity (tokens)", "token_capacity", "d"),
        ("output throughput (tok/s)", "output_throughput_tok_s", ".0f"),
        ("p99 TTFT (ms)", "p99_ttft_ms", ".0f"),
        ("p99 ITL (ms)", "p99_itl_ms", ".1f"),
        ("free after graphs (GiB)", "free_gib_after_graphs", ".2f"),
    ]
    for label, field, spec in rows:
        old = getattr(base, field, None) if base else None
        new = getattr(best.record, field, None)
        change = f"{new / old:.2f}×" if old and new is not None and old > 0 else "-"
        table.add_row(label, fmt(old, spec), fmt(new, spec), change)
    console.print(table)
    changed = {k: v for k, v in best.record.params.items() if not base or base.params.get(k) != v}
    console.print(f"flags changed: {changed or 'none (the baseline is best)'}", highlight=False)
    console.print(f"why: {chosen.reason}", highlight=False, soft_wrap=True)
    cut = max_running_requests_cut(best.record, chosen.baseline.record if chosen.baseline else None)
    if cut is not None:
        console.print(cut, highlight=False, soft_wrap=True)


class _RunProgress:
    """Renders :class:`tuner.study.loop.Progress` events: one line per trial, a live phase line.

    The live line names the Optuna trial number (as the result lines do) and counts the budget
    left down every second from the last event's ``eta_s``.
    """

    def __init__(self) -> None:
        import time

        from rich.progress import Progress, ProgressColumn, SpinnerColumn, TextColumn
        from rich.text import Text

        from tuner.units import format_duration

        class TimeLeft(ProgressColumn):
            def render(self, task) -> Text:  # noqa: ANN001 - rich Task
                deadline = task.fields.get("deadline")
                if deadline is None:
                    return Text("")
                return Text(f"· {format_duration(max(0.0, deadline - time.monotonic()))} left")

        self._monotonic = time.monotonic
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeLeft(), console=console,
                                 transient=True, refresh_per_second=2)
        self.task = self.progress.add_task("starting", total=None, deadline=None)
        self.in_flight: int | None = None

    def __enter__(self) -> _RunProgress:
        """Start the live line on a terminal only: rich's Progress ends with an empty line on any
        other output, which would sit above an error line."""
        if console.is_interactive:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress.live.is_started:
            self.progress.stop()

    def __call__(self, event) -> None:  # noqa: ANN001
        deadline = None if event.eta_s is None or event.eta_s == float("inf") else self._monotonic() + event.eta_s
        of = f" of ~{event.expected} this run" if event.expected else ""
        if event.event == "phase":
            self.progress.update(self.task, description=f"trial {event.number} ({event.index}{of}) · {event.phase}",
                                 deadline=deadline)
        elif event.event in ("trial_end", "skip", "stop"):
            self.in_flight = None
            self.progress.console.print(f"  {event.message}", highlight=False)
        elif event.event == "trial_start":
            self.in_flight = event.number
            self.progress.update(self.task, description=f"trial {event.number} ({event.index}{of}) · starting",
                                 deadline=deadline)


@app.command("run")
def run_cmd(
    config: _RunAnn[_RunPath, typer.Option("--config", "-c", help="The tuning config (TOML).")],
    budget: _RunAnn[str | None, typer.Option("--budget", "-b", help="Wall-clock budget with a unit: 4h, 90m, 1h30m, 3m, 90s (a bare number is an error). At least one trial's estimated cost.")] = None,
    trials: _RunAnn[int | None, typer.Option("--trials", "-n", min=1, help="Cap on trials in this run.")] = None,
    dry_run: _RunAnn[bool, typer.Option("--dry-run", help="Print the plan and the first launch; change nothing.")] = False,
    storage: _RunAnn[str | None, typer.Option("--storage", help="Override the config's storage url.")] = None,
    allow_mixed_environment: _RunAnn[bool, typer.Option(
        "--allow-mixed-environment", help="Add trials to a study recorded with another SGLang/GPU/driver/model.")] = False,
    apply_best: _RunAnn[bool, typer.Option(
        "--apply-best", help="After the run, persist the best trial like `tuner apply best --yes` (verify, roll back on failure).")] = False,
) -> None:
    """Run (or resume) the Optuna study: relaunch the service per trial, measure, learn; restore it at the end."""
    from tuner.units import parse_duration_s
    from tuner.config import load_config
    from tuner.errors import ConfigError

    cfg = load_config(config)
    text = budget or cfg.budget.total
    budget_s = parse_duration_s(text) if text else None
    max_trials = trials or cfg.budget.trials
    if budget_s is None and max_trials is None and not dry_run:
        raise ConfigError("no budget: neither --budget nor --trials nor [budget] total/trials is set",
                          hint="pass e.g. --budget 4h")
    from tuner import entrypoints

    if dry_run:
        console.print(entrypoints.dry_run(cfg, budget_s=budget_s, max_trials=max_trials), highlight=False)
        return
    renderer = _RunProgress()
    try:
        with renderer:
            summary = entrypoints.tune(cfg, budget_s=budget_s, max_trials=max_trials,
                                     allow_mixed_environment=allow_mixed_environment, storage_url=storage,
                                     on_progress=renderer)
    except KeyboardInterrupt:  # tune() restored the service before re-raising
        what = (f"trial {renderer.in_flight} recorded as failed (interrupted)" if renderer.in_flight is not None
                else "no trial was in flight")
        again = f"tuner run --config {config}" + (f" --budget {budget}" if budget else "")
        err_console.print(f"interrupted: {what}, service restored to its original flags; resume with `{again}`",
                          highlight=False, markup=False, soft_wrap=True)
        raise typer.Exit(130) from None
    console.print("service restored to its original flags", highlight=False)
    from tuner import results

    stored = results.open_study(results.StudyLocation(storage_url=summary.storage_url, study_name=summary.study_name))
    # The run's own choice (RunSummary.best, the config's [objective]), shown with the stored views.
    chosen = results.present_best(stored, summary.best, cfg.objective) if summary.best is not None else None
    _print_best_vs_baseline(summary, chosen)
    if apply_best and chosen is not None:
        apply_cmd(target="best", undo=False, dry_run=False, yes=True, study=None, storage=storage, config=config,
                  state_dir=None, verify_s=20.0, timeout_s=cfg.service.start_timeout_s, write=None)


@app.command("init")
def init_cmd(
    output: _RunAnn[_RunPath, typer.Option("--output", "-o", help="Where to write the config.")] = _RunPath("tuner.toml"),
    unit: _RunAnn[str | None, typer.Option("--unit", help="Read a running systemd unit (ExecStart, model, GPU, version).")] = None,
    sim: _RunAnn[bool, typer.Option("--sim", help="Write a config for the simulated server instead.")] = False,
    force: _RunAnn[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
) -> None:
    """Write a starter config from a running unit (--unit sglang.service) or for the simulator (--sim)."""
    from tuner.errors import ConfigError
    from tuner.starter import starter_config

    if output.exists() and not force:
        raise ConfigError(f"{output} already exists", hint="pass --force to overwrite it, or --output another file")
    if not unit and not sim:
        raise ConfigError("tell init what to tune", hint="pass --unit sglang.service or --sim")
    text = starter_config(unit=unit, sim=sim)
    if not output.parent.is_dir():
        raise ConfigError(f"--output {output}: folder {output.parent} does not exist",
                          hint="create it first, or pass --output in an existing folder")
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"cannot write --output {output}: {err.strerror}", hint="pass a writable path") from err
    console.print(f"wrote {output}; check [workload] and [slo], then `tuner run --config {output} --dry-run` "
                  f"and `tuner run --config {output} --budget {'3m' if sim else '4h'}`",
                  highlight=False, markup=False, soft_wrap=True)

# ---- trials / show / best / studies / report / dashboard / apply / applies (issue: history) -

from pathlib import Path as _Path  # noqa: E402
from typing import Annotated as _Ann  # noqa: E402

_StudyOpt = _Ann[str | None, typer.Option("--study", help="Study name (default: [study] of --config, or the only studies/*.db).")]
_StorageOpt = _Ann[str | None, typer.Option("--storage", help="Optuna storage URL, e.g. sqlite:///studies/demo.db (must exist).")]
_ConfigOpt = _Ann[_Path | None, typer.Option("--config", "-c", help="Config file whose [study]/[storage] name the study.")]
_JsonOpt = _Ann[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _history_study(study: str | None, storage: str | None, config: _Path | None):  # noqa: ANN202
    from tuner import results

    return results.open_study(
        results.resolve_location(study=study, storage=storage, config=config)
    )


@app.command("trials")
def trials_cmd(
    study: _StudyOpt = None,
    storage: _StorageOpt = None,
    config: _ConfigOpt = None,
    feasible: _Ann[bool, typer.Option("--feasible", help="Only feasible trials.")] = False,
    failed: _Ann[bool, typer.Option("--failed", help="Only failed or skipped trials.")] = False,
    sort: _Ann[str | None, typer.Option("--sort", help="capacity, tokens, throughput, goodput, ttft, itl or number.")] = None,
    as_json: _JsonOpt = False,
    as_csv: _Ann[bool, typer.Option("--csv", help="Print CSV (params as param.<name> columns).")] = False,
) -> None:
    """Every trial of a study: params, capacity, throughput, p99 TTFT/ITL, feasibility, failure."""
    from tuner import report, results
    from tuner.errors import ConfigError

    if as_json and as_csv:
        raise ConfigError("--json and --csv exclude each other", hint="pass at most one of them")
    stored = _history_study(study, storage, config)
    views = results.select_trials(stored.trials, feasible=feasible, failed=failed, sort=sort)
    if as_json:
        print(report.trials_json(views))
    elif as_csv:
        print(report.trials_csv(views), end="")
    else:
        report.print_fitted(report.trials_table(views, title=f"study {stored.name}: {len(views)} trials"))


@app.command("show")
def show_cmd(
    number: _Ann[int, typer.Argument(help="Trial number (see `tuner trials`).")],
    study: _StudyOpt = None,
    storage: _StorageOpt = None,
    config: _ConfigOpt = None,
    as_json: _JsonOpt = False,
) -> None:
    """One trial in full: params, memory waterfall, load phases, failure evidence, log, artifacts."""
    from tuner import report

    stored = _history_study(study, storage, config)
    view = stored.trial(number)
    if as_json:
        print(report.trial_json(stored, view))
    else:
        report.print_fitted(report.trial_detail(stored, view))


@app.command("best")
def best_cmd(
    study: _StudyOpt = None,
    storage: _StorageOpt = None,
    config: _ConfigOpt = None,
    policy: _Ann[str | None, typer.Option("--policy", help="throughput_within_capacity, max_capacity or max_throughput (default: the study's).")] = None,
    tolerance: _Ann[float | None, typer.Option("--tolerance", help="Capacity tolerance of throughput_within_capacity only (0.05 = 5%).")] = None,
    as_json: _JsonOpt = False,
) -> None:
    """The feasible Pareto front and the best trial under the policy, with deltas vs the baseline."""
    from tuner import report, results
    from tuner.study.best import override_policy

    stored = _history_study(study, storage, config)
    chosen = results.best_trial(stored, override_policy(stored.info, policy, tolerance))
    if as_json:
        print(report.json_text(chosen.summary()))
    else:
        report.print_fitted(report.best_panel(chosen))


@app.command("studies")
def studies_cmd(
    storage: _StorageOpt = None,
    config: _ConfigOpt = None,
    as_json: _JsonOpt = False,
) -> None:
    """The studies in a storage (default: every studies/*.db)."""
    from tuner import report, results
    from tuner.study.storage import list_studies

    urls = results.storage_urls(storage=storage, config=config)
    rows = {url: list_studies(url) for url in urls}
    if as_json:
        print(report.json_text(report.studies_rows(rows)))
    else:
        for url, summaries in rows.items():
            report.print_fitted(report.studies_table(summaries, url))


@app.command("report")
def report_cmd(
    study: _StudyOpt = None,
    storage: _StorageOpt = None,
    config: _ConfigOpt = None,
    output: _Ann[_Path | None, typer.Option("--output", "-o", help="HTML file (default studies/<study>-report.html).")] = None,
) -> None:
    """Write one self-contained HTML report (plots inlined; opens offline)."""
    from tuner import report

    stored = _history_study(study, storage, config)
    path = report.write_study_report(stored, output)
    console.print(f"report written to {path}")


@app.command("dashboard")
def dashboard_cmd(
    study: _StudyOpt = None,
    storage: _StorageOpt = None,
    config: _ConfigOpt = None,
    host: _Ann[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: _Ann[int, typer.Option("--port", help="Port to listen on.")] = 8080,
) -> None:
    """Run optuna-dashboard on the study's storage (Ctrl-C stops it)."""
    from tuner import report, results
    from tuner.study.storage import check_storage

    location = results.resolve_location(study=study, storage=storage, config=config)
    check_storage(location.storage_url)
    report.check_listen_address(host, port)
    console.print(f"optuna-dashboard on http://{host}:{port}/  (storage {location.storage_url}; Ctrl-C stops it)",
                  highlight=False, soft_wrap=True)  # fmt: skip
    status = report.serve_dashboard(location.storage_url, host=host, port=port)
    if status is None:
        console.print("dashboard stopped", highlight=False)
    raise typer.Exit(status or 0)


@app.command("apply")
def apply_cmd(
    target: _Ann[str | None, typer.Argument(help="`best` or a trial number.")] = None,
    undo: _Ann[bool, typer.Option("--undo", help="Return to the state before the last verified apply.")] = False,
    dry_run: _Ann[bool, typer.Option("--dry-run", help="Print the drop-in and the command-line diff; change nothing.")] = False,
    yes: _Ann[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    study: _StudyOpt = None,
    storage: _StorageOpt = None,
    config: _ConfigOpt = None,
    state_dir: _Ann[_Path | None, typer.Option("--state-dir", help="Folder of locks and state files.")] = None,
    verify_s: _Ann[float, typer.Option("--verify-s", help="Seconds of the verifying load check (0: none).")] = 20.0,
    timeout_s: _Ann[float, typer.Option("--timeout-s", help="How long the server may take to be ready.")] = 900.0,
    write: _Ann[_Path | None, typer.Option("--write", help="Process launcher: write the command line to this file.")] = None,
) -> None:
    """Persist a trial's flags (systemd drop-in 80-tuner.conf), restart, verify; roll back on failure."""
    from tuner import apply as applying
    from tuner import report, results
    from tuner.study.best import max_running_requests_cut
    from tuner.errors import ConfigError

    if undo == (target is not None):
        raise ConfigError("pass either a target (`best` or a trial number) or --undo", hint="e.g. `tuner apply best`")
    if target not in (None, "best") and not target.isdigit():
        raise ConfigError(f"apply target {target!r} is neither `best` nor a trial number", hint="e.g. `tuner apply 7`")
    stored = _history_study(study, storage, config)
    view = None
    if not undo:
        view = results.best_trial(stored).trial if target == "best" else stored.trial(int(target))
    cfg = applying.study_config(stored, config)
    log = applying.ApplyLog(stored.location.storage_url)
    if view is None:
        plan = applying.plan_undo(stored, cfg, log, state_dir=state_dir)
    else:
        load = applying.load_check_for(cfg, view, duration_s=verify_s) if verify_s > 0 else None
        plan = applying.plan_apply(stored, view, cfg, state_dir=state_dir, load=load)
    console.print(plan.render(timeout_s=timeout_s), markup=False, highlight=False)
    cut = max_running_requests_cut(view.record, baseline.record if (baseline := stored.baseline()) else None) if view is not None else None
    if cut is not None:
        console.print(cut, markup=False, highlight=False)
    if dry_run:
        return
    if plan.launcher == "systemd" and not yes:
        if not sys.stdin.isatty():
            raise ConfigError("tuner apply restarts the service and needs a confirmation", hint="pass --yes")
        typer.confirm(f"restart {plan.target} with this config?", abort=True)
    gpu = applying.gpu_monitor(cfg) if plan.launcher == "systemd" else None
    record = applying.execute(plan, log, timeout_s=timeout_s, write=write, gpu=gpu)
    report.print_fitted(report.apply_result(record))


@app.command("applies")
def applies_cmd(
    study: _StudyOpt = None,
    storage: _StorageOpt = None,
    config: _ConfigOpt = None,
    as_json: _JsonOpt = False,
) -> None:
    """Every apply, undo and rollback recorded in the study's storage."""
    from tuner import apply as applying
    from tuner import report, results

    location = results.resolve_location(study=study, storage=storage, config=config)
    records = applying.ApplyLog(location.storage_url).records()
    if as_json:
        print(report.json_text([r.model_dump(mode="json") for r in records]))
    elif not records:
        name = location.study_name or location.storage_url
        console.print(f"no apply recorded in {name} yet (`tuner apply best` makes one)", highlight=False, soft_wrap=True)
    else:
        report.print_fitted(report.applies_table(records))


def main() -> None:
    """Entry point of the ``tuner`` script.

    Turns every user error into one line on stderr: a :class:`TunerError` exits 1, a command-line
    usage error (unknown option, bad value) exits 2 as click does, Ctrl-C exits 130.
    """
    try:
        rc = app(standalone_mode=False)
    except TunerError as err:
        err_console.print(f"[bold red]error:[/] {escape(str(err))}", highlight=False, soft_wrap=True)
        sys.exit(err.exit_code)
    except NoArgsIsHelpError as err:  # `tuner` or `tuner sim` alone: the help, as asked for
        console.print(err.format_message(), markup=False, highlight=False)
        sys.exit(0)
    except ClickException as err:
        command = err.ctx.command_path if getattr(err, "ctx", None) is not None else "tuner"
        err_console.print(
            f"[bold red]error:[/] {escape(err.format_message())} — see `{escape(command)} --help`",
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(err.exit_code)
    except (KeyboardInterrupt, Abort):
        err_console.print("interrupted")
        sys.exit(130)
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
