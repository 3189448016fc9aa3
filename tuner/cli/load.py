"""``tuner load``: drive a workload against a running server, or find its max concurrency under the SLO."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from tuner.cli.common import app, check_output_path, console, err_console, non_empty_path, non_empty_text
from tuner.load.runner import MAX_CONCURRENCY
from tuner.report import tables


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


def _note_repeated_prompts(summary, workload: str, seed: int) -> None:  # noqa: ANN001 - LoadSummary
    """A note when a random workload's prompts hit the prefix cache: they repeat an earlier run's
    (same ``--seed``), and a radix-cache hit skips their prefill (§5.3; ``POST /flush_cache`` empties it, §5.4), so TTFT reads far too low."""
    if workload == "random" and (summary.cache_hit_rate or 0.0) >= 0.5:
        err_console.print(f"[yellow]note:[/] the prefix cache served {summary.cache_hit_rate:.0%} of the prompt tokens: "
                          f"these random prompts repeat an earlier run's (--seed {seed}), so TTFT reads low; pass "
                          "another --seed, or flush the server's cache (POST /flush_cache)", highlight=False)


def _print_acceptance(summary, url: str) -> float | None:  # noqa: ANN001 - LoadSummary
    """Speculative decoding's accept length of the window, by prompt class, beside the server's own
    ``avg_spec_accept_length`` (``/get_server_info``, since start); returns the server's figure."""
    if summary.accept_length is None:
        return None
    from tuner.errors import TunerError
    from tuner.sglang.client import SGLangClient

    try:
        server = SGLangClient(url, timeout_s=10).server_info().avg_spec_accept_length
    except TunerError:
        server = None
    by_class = ", ".join(f"{k} {v:.2f}" for k, v in summary.accept_length_by_class.items())
    console.print(f"accept length {summary.accept_length:.2f} tokens per verify step ({by_class}); "
                  f"server avg_spec_accept_length {'-' if server is None else f'{server:.2f}'}",
                  highlight=False, soft_wrap=True)
    if any(summary.accept_length_by_class.get(c) is not None for c in ("raw", "unknown")):
        err_console.print("[yellow]note:[/] random token ids overstate speculative acceptance; load a "
                          "speculative deployment with --workload text (or a trace with --send-text)", highlight=False)
    return server




def _check_pace(*, concurrency: int | None, rate: float | None, burstiness: float, seed: int,
                time_budget: float | None) -> None:
    """Refuse, before any request, a pace the load cannot keep: ``--rate inf`` (an unbounded
    arrival loop grew to 22 GB), a concurrency past :data:`MAX_CONCURRENCY`, a burstiness that is
    not a positive number, a seed outside numpy's range, a ``--time-budget`` of no time.

    Raises:
        ConfigError: Naming the option and the fix.
    """
    import math

    from tuner.errors import ConfigError

    if rate is not None and not (math.isfinite(rate) and rate > 0):
        raise ConfigError(f"--rate {rate:g} is not a positive number of requests/s",
                          hint="give e.g. --rate 4, or --concurrency N for a closed loop")
    if concurrency is not None and not 1 <= concurrency <= MAX_CONCURRENCY:
        raise ConfigError(f"--concurrency {concurrency} is outside 1-{MAX_CONCURRENCY:,}", hint="give e.g. --concurrency 64")
    if not (math.isfinite(burstiness) and burstiness > 0):
        raise ConfigError(f"--burstiness {burstiness:g} is not a positive number",
                          hint="1 is Poisson arrivals, below 1 burstier, e.g. --burstiness 0.5")
    if not 0 <= seed <= 2**32 - 1:
        raise ConfigError(f"--seed {seed} is outside 0-{2**32 - 1}", hint="give e.g. --seed 0")
    if time_budget is not None and not (math.isfinite(time_budget) and time_budget > 0):
        raise ConfigError(f"--time-budget {time_budget:g} is no time", hint="give seconds, e.g. --time-budget 300")


@app.command("load", short_help='Load a server with a streaming workload; bench_serving metrics.')
def load_cmd(  # noqa: C901 - over the complexity ceiling when it was set (15); it only goes down
    ctx: typer.Context,
    url: Annotated[str, typer.Option("--url", parser=non_empty_text, help="the server's base URL, e.g. http://127.0.0.1:30000.")],
    api: Annotated[str, typer.Option("--api", parser=non_empty_text, help="generate (/generate, input_ids) or completions (/v1/completions).")] = "generate",
    workload: Annotated[str, typer.Option("--workload", parser=non_empty_text, help="random, shared-prefix, multi-turn, trace or text (prompts sent as text: use it for a speculative deployment).")] = "random",
    input_len: Annotated[int | None, typer.Option("--input-len", help="random: prompt tokens [1024].")] = None,
    output_len: Annotated[int | None, typer.Option("--output-len", help="output tokens (ignore_eos) [256].")] = None,
    range_ratio: Annotated[float | None, typer.Option("--range-ratio", help="random: lengths uniform in [L*r, L] [1.0].")] = None,
    num_requests: Annotated[int | None, typer.Option("--num-requests", help="random: requests per pass [endless].")] = None,
    num_groups: Annotated[int | None, typer.Option("--num-groups", help="shared-prefix: system prompts [64].")] = None,
    prompts_per_group: Annotated[int | None, typer.Option("--prompts-per-group", help="shared-prefix: questions per system prompt [16].")] = None,
    system_prompt_len: Annotated[int | None, typer.Option("--system-prompt-len", help="shared-prefix: tokens [2048]; multi-turn: a system prompt shared by every session [0].")] = None,
    question_len: Annotated[int | None, typer.Option("--question-len", help="shared-prefix: tokens [128].")] = None,
    num_sessions: Annotated[int | None, typer.Option("--num-sessions", help="multi-turn: conversations [32].")] = None,
    turns: Annotated[int | None, typer.Option("--turns", help="multi-turn: turns per conversation [4].")] = None,
    first_input_len: Annotated[int | None, typer.Option("--first-input-len", help="multi-turn: first prompt tokens [1024].")] = None,
    turn_input_len: Annotated[int | None, typer.Option("--turn-input-len", help="multi-turn: new user tokens per turn [128].")] = None,
    trace: Annotated[Path | None, typer.Option("--trace", parser=non_empty_path, help="trace: the tuner's JSONL (timestamp_s, input_len, output_len, ...), bench_serving's ShareGPT JSON, or an OpenAI-format request log (JSONL).")] = None,
    trace_format: Annotated[str | None, typer.Option("--trace-format", parser=non_empty_text, help="trace: auto, jsonl, sharegpt or openai [auto].")] = None,
    bytes_per_token: Annotated[float | None, typer.Option("--bytes-per-token", help="trace: UTF-8 bytes per token for text traces, no tokenizer [4.0].")] = None,
    time_scale: Annotated[float | None, typer.Option("--time-scale", help="trace: multiply its time offsets [1.0].")] = None,
    send_text: Annotated[bool, typer.Option("--send-text", help="trace: send the prompts as text (its messages; a JSONL trace gets the shipped prompts at its lengths): use it for a speculative deployment.")] = False,
    prompts: Annotated[Path | None, typer.Option("--prompts", parser=non_empty_path, help="text: a JSONL of {\"prompt\": text, \"class\": chat|code} [the shipped chat-like set].")] = None,
    prompt_tokens: Annotated[int | None, typer.Option("--prompt-tokens", help="text: grow each prompt to about this many tokens [as written].")] = None,
    seed: Annotated[int, typer.Option("--seed", help="seed of prompts and arrivals.")] = 0,
    vocab_size: Annotated[int, typer.Option("--vocab-size", help="token ids are drawn below this.")] = 32000,
    concurrency: Annotated[int | None, typer.Option("--concurrency", help="closed loop: requests in flight (with --rate: a cap).")] = None,
    rate: Annotated[float | None, typer.Option("--rate", help="open loop: mean arrivals, requests/s.")] = None,
    burstiness: Annotated[float, typer.Option("--burstiness", help="gamma shape of arrivals: 1 = Poisson, < 1 burstier.")] = 1.0,
    max_under_slo: Annotated[bool, typer.Option("--max-under-slo", help="search the highest --knob level meeting --slo.")] = False,
    knob: Annotated[str, typer.Option("--knob", parser=non_empty_text, help="--max-under-slo: concurrency or rate.")] = "concurrency",
    start: Annotated[float, typer.Option("--start", help="--max-under-slo: first level.")] = 1,
    max_value: Annotated[float, typer.Option("--max-value", help="--max-under-slo: highest level.")] = 1024,
    time_budget: Annotated[float, typer.Option("--time-budget", help="--max-under-slo: seconds for the whole search.")] = 600,
    target_attainment: Annotated[float, typer.Option("--target-attainment", help="--max-under-slo: share of requests that must meet the SLO.")] = 0.9,
    slo: Annotated[str | None, typer.Option("--slo", parser=non_empty_text, help='limits, e.g. "p99_ttft_ms=2000,p99_itl_ms=100".')] = None,
    duration: Annotated[float | None, typer.Option("--duration", help="measured window, s (per level with --max-under-slo).")] = None,
    warmup: Annotated[float | None, typer.Option("--warmup", help="unmeasured warm-up, s (after --ramp).")] = None,
    ramp: Annotated[float | None, typer.Option("--ramp", help="closed loop: start the sessions staggered over this many s (warm-up, at most --duration): the steady window of the trial's SLO-safe capacity.")] = None,
    longest_context: Annotated[int | None, typer.Option("--longest-context", help="replace a share of the requests by prompts of this context (input + output tokens), as the trial's steady window does.")] = None,
    longest_share: Annotated[float, typer.Option("--longest-share", help="--longest-context: share of requests at it (0-1).")] = 1.0,
    cooldown: Annotated[float, typer.Option("--cooldown", help="unmeasured load while measured requests finish, s.")] = 0.0,
    max_requests: Annotated[int | None, typer.Option("--max-requests", help="measured requests to send.")] = None,
    request_timeout: Annotated[float, typer.Option("--request-timeout", help="limit per request, s.")] = 600.0,
    timeout: Annotated[float | None, typer.Option("--timeout", help="limit for the whole run, s.")] = None,
    model: Annotated[str | None, typer.Option("--model", parser=non_empty_text, help="completions: model name [from /v1/models].")] = None,
    transport: Annotated[str, typer.Option("--transport", parser=non_empty_text, help="raw (own HTTP/1.1, least CPU) or aiohttp.")] = "raw",
    json_out: Annotated[Path | None, typer.Option("--json", parser=non_empty_path, help="write the summary (or search result) as JSON.")] = None,
    csv_out: Annotated[Path | None, typer.Option("--csv", parser=non_empty_path, help="write one row per request as CSV.")] = None,
    max_error_rate: Annotated[float, typer.Option("--max-error-rate", help="exit 1 above this share of errored requests (0-1); always when none completed.")] = 0.1,
) -> None:
    """Load an SGLang server with a streaming workload and report bench_serving's metrics.

    Examples: `tuner load --url http://127.0.0.1:30000 --concurrency 64 --duration 60`;
    `tuner load --url URL --workload shared-prefix --rate 8 --duration 120 --json out.json`;
    `tuner load --url URL --max-under-slo --slo "p99_ttft_ms=2000" --duration 30`;
    the SLO-safe sessions of a long-context deployment, as the trial measures them:
    `tuner load --url URL --max-under-slo --slo "p99_ttft_ms=30000,p99_itl_ms=4000" --ramp 10
    --duration 30 --longest-context 32768`.
    """
    import json

    from rich.live import Live

    from tuner.errors import ConfigError, LoadError
    from tuner.load import SLO, build_workload, find_max_under_slo_async, run_load
    from tuner.load.runner import check_fits_server, run_sync
    from tuner.load.steady import SteadyWindow, session_workload
    from tuner.load.workloads import spec_from_options

    if api not in ("generate", "completions"):
        raise ConfigError(f"--api {api!r} is unknown", hint="use --api generate or --api completions")
    if transport not in ("raw", "aiohttp"):
        raise ConfigError(f"--transport {transport!r} is unknown", hint="use --transport raw or --transport aiohttp")
    if max_under_slo and (concurrency is not None or rate is not None):
        raise ConfigError("--max-under-slo searches the level itself", hint="drop --concurrency / --rate")
    search_only = [f"--{name.replace('_', '-')}" for name in ("knob", "start", "max_value", "time_budget",
                   "target_attainment") if getattr(ctx.get_parameter_source(name), "name", "") == "COMMANDLINE"]
    if search_only and not max_under_slo:  # each was ignored without the search
        raise ConfigError(f"{search_only[0]} is an option of --max-under-slo",
                          hint=f"add --max-under-slo --slo ... to search, or drop {search_only[0]}")
    if max_under_slo and knob not in ("concurrency", "rate"):
        raise ConfigError(f"--knob {knob!r} is unknown", hint="use --knob concurrency or --knob rate")
    if max_under_slo and not slo:
        raise ConfigError("--max-under-slo needs limits", hint='add --slo "p99_ttft_ms=2000,p99_itl_ms=100"')
    if max_under_slo and csv_out is not None:
        raise ConfigError("--csv writes per-request rows of one run", hint="drop --csv with --max-under-slo")
    if not 0 <= max_error_rate <= 1:
        raise ConfigError(f"--max-error-rate {max_error_rate:g} is not a share", hint="use a value in [0, 1], e.g. 0.1")
    _check_pace(concurrency=concurrency, rate=rate, burstiness=burstiness, seed=seed, time_budget=time_budget)
    check_output_path(json_out, "--json")
    check_output_path(csv_out, "--csv")
    spec = spec_from_options(workload, {
        "input_len": input_len, "output_len": output_len, "range_ratio": range_ratio, "num_requests": num_requests,
        "num_groups": num_groups, "prompts_per_group": prompts_per_group, "system_prompt_len": system_prompt_len,
        "question_len": question_len, "num_sessions": num_sessions, "turns": turns,
        "first_input_len": first_input_len, "turn_input_len": turn_input_len, "path": trace, "time_scale": time_scale,
        "trace_format": trace_format, "bytes_per_token": bytes_per_token, "prompts": prompts,
        "prompt_tokens": prompt_tokens, "send_text": send_text or None,
    })
    limits = SLO.parse(slo) if slo else None
    if ramp is not None and (rate is not None or (max_under_slo and knob != "concurrency")):
        raise ConfigError("--ramp staggers closed-loop sessions", hint="drop --ramp with --rate / --knob rate")
    if ramp is not None and not max_under_slo and duration is None:
        raise ConfigError("--ramp needs a measured window to keep the ramp out of", hint="add --duration S (>= --ramp)")
    steady = None if ramp is None else SteadyWindow(
        duration_s=duration or 30.0, ramp_s=ramp, settle_s=warmup or 0.0).check()
    wl = build_workload(spec, seed=seed, vocab_size=vocab_size)
    if longest_context is not None:
        wl = session_workload(wl, longest_context, longest_share, where="--longest-context", sessions=concurrency)
    check_fits_server(url, wl)

    with Live(console=err_console, transient=True, refresh_per_second=4) as live:
        def tick(stats) -> None:  # noqa: ANN001 - LiveStats
            live.update(_load_live_line(stats))

        if max_under_slo:
            def step_done(step) -> None:  # noqa: ANN001 - SearchStep
                live.console.print(
                    f"{knob} {step.value:g}: [bold]{step.verdict}[/] attainment "
                    f"{tables.load_number(step.attainment, pct=True)} [{step.ci_low:.0%}, {step.ci_high:.0%}] of {step.judged}, "
                    f"{step.output_throughput:,.0f} tok/s, p99 TTFT {tables.load_number(step.p99_ttft_ms)} ms"
                    + (f" — {escape(step.note)}" if step.note else ""),
                    soft_wrap=True,
                )

            found = run_sync(find_max_under_slo_async(
                url, wl, limits, knob=knob, start=start, max_value=max_value,  # type: ignore[arg-type]
                step_duration_s=duration or 30.0, warmup_s=warmup, time_budget_s=time_budget,
                target_attainment=target_attainment, api=api, seed=seed,  # type: ignore[arg-type]
                request_timeout_s=request_timeout, on_step=step_done, on_tick=tick,
                transport=transport, ramp_s=ramp or 0.0,  # type: ignore[arg-type]
            ))
        else:
            result = run_sync(run_load(
                url, wl, concurrency=concurrency, rate=rate, burstiness=burstiness,
                warmup_s=steady.warmup_s if steady is not None else warmup or 0.0, ramp_s=steady.ramp if steady else 0.0,
                duration_s=duration, max_requests=max_requests, api=api,  # type: ignore[arg-type]
                cooldown_s=steady.cooldown_s(request_timeout) if steady is not None and not cooldown else cooldown,
                slo=limits, on_tick=tick, request_timeout_s=request_timeout, timeout_s=timeout, seed=seed, model=model,
                transport=transport,  # type: ignore[arg-type]
            ))
    console.print(f"workload: {wl.describe()}", highlight=False, soft_wrap=True)
    if max_under_slo:
        console.print(tables.load_steps_table(found))
        if found.answered:
            console.print(found.message, highlight=False, markup=False, soft_wrap=True)
        payload = found.model_dump(mode="json")
        partial = found.status == "aborted"
    else:
        mode = result.settings["mode"]
        pace = f"concurrency {concurrency}" if mode == "closed" else (f"rate {rate:g} req/s" if rate else "trace times")
        console.print(tables.load_summary_table(result.summary, f"tuner load — {workload}, {pace}, {api}"))
        _load_print_errors(result.summary)
        _note_repeated_prompts(result.summary, workload, seed)
        payload = result.to_json_dict()
        server_accept = _print_acceptance(result.summary, url)
        if server_accept is not None:
            payload["server_avg_spec_accept_length"] = server_accept
        partial = result.partial
        if result.stopped_early or result.partial:
            err_console.print(f"[yellow]{'partial' if result.partial else 'stopped early'}:[/] {result.stop_reason}",
                              highlight=False)
        if csv_out is not None:
            result.write_csv(csv_out)
    if json_out is not None:
        try:
            json_out.write_text(json.dumps(payload, indent=2) + "\n")
        except OSError as err:
            raise ConfigError(f"cannot write --json {json_out}: {err.strerror}", hint="pass a writable path") from err
    if partial:
        raise typer.Exit(1)
    if max_under_slo and not found.answered:
        raise LoadError(f"--max-under-slo reached no answer ({found.status}): {found.message}",
                        hint=_no_answer_hint(found.status))
    failure = None if max_under_slo else result.summary.failure(max_error_rate)
    if failure is not None:
        raise LoadError(failure)


def _no_answer_hint(status: str) -> str | None:
    """The fix for a search with no answer: an SLO no level meets names the SLO and the load per
    session; the other statuses' messages name their own (``--duration``, ``--time-budget``)."""
    if status != "none_pass":
        return None
    return ("no session count meets --slo: loosen it (a larger p99 limit), or send less per session "
            "(a lower --longest-share or --longest-context, a shorter --output-len)")
