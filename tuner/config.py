"""The tuning config: one TOML file validated into frozen pydantic models.

Sections: ``[study]``, ``[service]``, ``[model]``, ``[space]``, ``[workload]``, ``[slo]``,
``[objective]``, ``[budget]``, ``[storage]``. Unknown keys are errors (``extra="forbid"``), and
every error is one line that names the key, the bad value and the fix. ``[workload]`` and
``[slo]`` are the load generator's own models (:mod:`tuner.load`), embedded as they are.

Ranges left out of ``[space]`` are derived at run time from the GPU, the model and the SGLang
version (see :func:`tuner.study.space.resolve_space`).
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from tuner.errors import ConfigError, StudyError, TunerError
from tuner.load.metrics import SLO
from tuner.load.quality import QualityConfig
from tuner.load.runner import MAX_CONCURRENCY
from tuner.load.steady import SteadyWindow, sessions_reach
from tuner.load.workloads import MultiTurnSpec, WorkloadSpec, build_workload
from tuner.sglang.client import url_problem
from tuner.sglang.flags import check_bundled_series, flag_value
from tuner.units import EMPTY_TEXT, MaintenanceWindow, NonEmptyStr, parse_duration_s

__all__ = [
    "check_url_matches_port",
    "StudySection",
    "ServiceSection",
    "ModelSection",
    "SpaceSection",
    "ObjectiveSection",
    "BudgetSection",
    "StorageSection",
    "TunerConfig",
    "load_config",
    "parse_config",
]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

DAY_S = 86_400.0
"""The longest phase, timeout or reserve a key may ask for, in seconds: ``warmup_s = 1e30`` passed
the dry run as a run that would never end (a new user's sweep)."""


class _Section(BaseModel):
    """A TOML table: unknown keys refused, values frozen, no ``inf``/``nan`` (``stress_s = inf`` ran
    into the dry run's duration formatting as a traceback: operator review 2's sweep), and strict
    types: a number written as a string (``start_timeout_s = "60"``), a boolean where a number
    belongs (``seed = true``) or ``2.0`` where an integer belongs is refused with the key's name,
    not coerced (:func:`parse_config` words the error)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)


# TOML has no tuple: a range is a list of two numbers (the list→tuple step lax, the numbers strict).
FloatRange = Annotated[tuple[StrictFloat, StrictFloat], Field(strict=False, description="[low, high]")]
IntRange = Annotated[tuple[StrictInt, StrictInt], Field(strict=False, description="[low, high]")]
# A command (argv): at least one word, none empty.
Argv = Annotated[list[NonEmptyStr], Field(min_length=1)]


class StudySection(_Section):
    """``[study]``: the Optuna study's name, seed and sampler.

    Attributes:
        name: Study name; also names the default SQLite file ``studies/<name>.db``.
        seed: Sampler seed (the same config and seed replay the same candidates).
        sampler: ``tpe`` (multi-objective TPE with constraints, the default), ``nsga2`` or
            ``random`` (for comparison).
        predicted_candidates: How many memory-model candidates the planner may propose in a study
            (0: the sampler alone after the baseline).
    """

    name: str = "tuner"
    seed: int = Field(default=0, ge=0, le=2**32 - 1)  # numpy's and Optuna's seed range
    sampler: Literal["tpe", "nsga2", "random"] = "tpe"
    predicted_candidates: int = Field(default=20, ge=0, le=200)

    @field_validator("name")
    @classmethod
    def _name_ok(cls, value: str) -> str:
        if not _NAME_RE.match(value):
            raise ValueError("use letters, digits, '.', '_' and '-' only")
        return value


class ServiceSection(_Section):
    """``[service]``: the SGLang server the study relaunches.

    Attributes:
        launcher: ``systemd`` (production: a drop-in, ``systemctl``, ``journalctl``) or
            ``process`` (the server as a child process; the demo and hosts without systemd).
        unit: The systemd unit (``sglang.service``); required for ``systemd``.
        command: The baseline server command line for ``process`` (argv list or one string);
            the word ``{python}`` stands for the interpreter that runs the tuner.
        url: Base URL of the server.
        systemctl: The systemctl command (a list, so a prefix such as ``nsenter -t PID -m -p``
            works).
        journalctl: The journalctl command, likewise.
        dropin_dir: Where persistent drop-ins go (``tuner apply``'s; default
            ``/etc/systemd/system``, i.e. ``/etc/systemd/system/<unit>.d``).
        runtime_dropin_dir: Where a trial's drop-in goes: systemd's runtime unit folder (default
            ``/run/systemd/system``, a tmpfs systemd forgets at boot, so a reboot in the middle of
            a trial brings the unit up on its own command). It must be a folder systemd reads units
            from.
        python: The Python that runs SGLang, used to read its flags and version.
        sglang_version: Override the detected SGLang version.
        start_timeout_s: How long a start may take until ready (weights load for minutes).
        stop_timeout_s: How long a stop may take until GPU memory is free.
        workdir: Working directory of the ``process`` launcher.
        gpu_monitor: ``nvml`` (real GPUs), ``sim`` (the simulator's ledger at ``url``), ``none``,
            or ``auto`` (``sim`` when the command runs ``tuner.sim``, else ``nvml``).
        allow_foreign: Start even when a foreign process holds GPU memory.
        state_dir: Folder of the restore state (default: the launcher's, ``/var/lib/sglang-tuner``
            for root). The unit's lock is host-wide whatever this is (``/run/lock/sglang-tuner``,
            see :func:`tuner.launch.session.default_lock_dir`).
        pre_restart: A command run before every restart of a trial and before the final restore
            (e.g. drain the server from a load balancer; argv or one string, no shell); a non-zero
            exit stops the run, the service restored (:mod:`tuner.launch.hooks`).
        post_ready: A command run once a trial's server is ready, and after the final restore
            (e.g. return it to the load balancer).
        hook_timeout_s: How long a hook may take, seconds.
        window: A daily maintenance window of local time (``"02:00-05:00"``; may wrap midnight)
            outside which no trial's restart starts.
        outside_window: ``wait`` (default: wait for the window when the budget holds the wait and
            a trial, else stop) or ``stop`` (stop at once); either way the run says which.
    """

    launcher: Literal["systemd", "process"] = "systemd"
    unit: NonEmptyStr | None = None
    command: Argv | None = None
    url: str = "http://127.0.0.1:30000"
    systemctl: Argv = Field(default_factory=lambda: ["systemctl"])
    journalctl: Argv = Field(default_factory=lambda: ["journalctl"])
    dropin_dir: NonEmptyStr | None = None
    runtime_dropin_dir: NonEmptyStr | None = None
    python: NonEmptyStr | None = None
    sglang_version: NonEmptyStr | None = None
    start_timeout_s: float = Field(default=900.0, gt=0, le=DAY_S)
    stop_timeout_s: float = Field(default=120.0, gt=0, le=DAY_S)
    workdir: NonEmptyStr | None = None
    gpu_monitor: Literal["auto", "nvml", "sim", "none"] = "auto"
    allow_foreign: StrictBool = False
    state_dir: NonEmptyStr | None = None
    pre_restart: Argv | None = None
    post_ready: Argv | None = None
    hook_timeout_s: float = Field(default=300.0, gt=0, le=DAY_S)
    window: NonEmptyStr | None = None
    outside_window: Literal["wait", "stop"] = "wait"

    @field_validator("pre_restart", "post_ready", mode="before")
    @classmethod
    def _split_hook(cls, value: Any) -> Any:
        if isinstance(value, str):
            import shlex

            value = shlex.split(value)
        if isinstance(value, list) and not value:
            raise ValueError("an empty hook: name a command, or leave the key out")
        return value

    @field_validator("window")
    @classmethod
    def _window_ok(cls, value: str | None) -> str | None:
        if value is not None:
            MaintenanceWindow.parse(value)
        return value

    @field_validator("command", mode="before")
    @classmethod
    def _split_command(cls, value: Any) -> Any:
        if isinstance(value, str):
            import shlex

            value = shlex.split(value)
        if isinstance(value, list):
            import sys

            # "{python}" is the interpreter running the tuner (the venv's, for the simulator).
            unknown = [w for w in value if isinstance(w, str) and re.fullmatch(r"\{[A-Za-z_]+\}", w) and w != "{python}"]
            if unknown:  # a mistyped placeholder ("{pyton}") would only fail at launch, as a missing program
                raise ValueError(f"unknown placeholder {unknown[0]} (the only one is {{python}}, the tuner's interpreter)")
            value = [sys.executable if word == "{python}" else word for word in value]
        return value

    @field_validator("sglang_version")
    @classmethod
    def _version_bundled(cls, value: str | None) -> str | None:
        """A version no bundled flag table covers is refused as ``upgrade-check --version`` refuses it."""
        if value is not None:
            try:
                check_bundled_series(value, name="sglang_version", fix="set [service] python to the interpreter that runs "
                                     "SGLang (its own parser is read), or leave sglang_version out")
            except TunerError as err:
                raise ValueError(str(err)) from None
        return value

    @field_validator("url")
    @classmethod
    def _url_ok(cls, value: str) -> str:
        problem = url_problem(value) if re.match(r"^https?://[^/\s]+", value) else "write it like http://127.0.0.1:30000"
        if problem is not None:
            raise ValueError(problem)
        return value.rstrip("/")

    @model_validator(mode="after")
    def _target_given(self) -> ServiceSection:
        if self.launcher == "systemd" and not self.unit:
            raise ValueError("the systemd launcher needs unit = \"sglang.service\"")
        if self.launcher == "process" and not self.command:
            raise ValueError("the process launcher needs command = [\"python\", \"-m\", ...]")
        return self


class ModelSection(_Section):
    """``[model]``: optional facts about the served model.

    Attributes:
        config_json: Path of the model's Hugging Face ``config.json`` (default: read from the
            server's ``--model-path`` when it is a local directory).
        name: A display name for reports.
    """

    config_json: NonEmptyStr | None = None
    name: NonEmptyStr | None = None


class SpaceSection(_Section):
    """``[space]``: the knobs the study searches, by SGLang field name.

    Any range left out is derived from the baseline, the GPU and the SGLang version.

    Attributes:
        mem_fraction_static: ``[low, high]``.
        mem_fraction_step: Resolution of ``mem_fraction_static`` (0.005 ≈ 0.47 GiB on a 94 GiB
            baseline, §1.8).
        max_running_requests: ``[low, high]`` (searched on a log scale).
        chunked_prefill_size: Choices; ``-1`` disables chunked prefill (§2.1).
        hierarchical_cache: Search ``enable_hierarchical_cache`` and its knobs (§7): ``true`` /
            ``false`` force it in or out; unset (the default), the study decides from the
            workload's prefix reuse and working set (in when evicted prefixes can be served from
            host memory, out with the reason otherwise; the dry run says which and why).
        hicache_ratio: ``[low, high]`` host/device pool ratio (versions that prefer the ratio;
            default ``[2.0, 4.0]``: ≤ 0.5.10 needs more host than device tokens).
        hicache_size: ``[low, high]`` host pool per rank in decimal GB (versions that prefer the
            size, 0.5.23; default: a quarter to all of what the host leaves, over the ranks).
        hicache_write_policy: Choices (default: every policy the version has).
        hicache_io_backend: Choices (default: ``kernel`` and ``direct`` where the version has them).
        hicache_mem_layout: Choices (default: the version's default layout and ``page_first``).
        page_size: Choices (optional).
        cuda_graph_max_bs: Choices (optional; rendered per version, §3.2).
        schedule_conservativeness: ``[low, high]`` (optional, §2.4).
        kv_cache_dtype: Choices of ``--kv-cache-dtype`` (optional; a structural lever:
            ``["auto", "fp8_e4m3"]`` halves the bytes per token; fp8 changes numerics, so such a
            candidate must pass the ``[quality]`` gate).
        dcp_size: Choices of ``--dcp-size`` (decode context parallelism, SGLang 0.5.23; a size the
            version lacks or that does not divide ``--tp-size`` is skipped, never launched).
        dp_size: DP-attention sizes (``--enable-dp-attention --dp-size N``; 1 = off).
            The three structural levers (``kv_cache_dtype``, ``dcp_size``, ``dp_size``) left unset are
            derived from the baseline, the version's flags and the feasibility table
            (:mod:`tuner.study.lever_space`); a list names the values, the baseline's value alone pins it.
        exclude_levers: Structural levers the study never derives: ``fp8_kv``, ``dcp``, ``dp_attention``.
        speculative: Search speculative decoding on/off and its draft shape when the baseline runs a
            draft model (§1.5): unset or ``true`` searches them, ``false`` leaves them as they are.
        speculative_num_steps, speculative_eagle_topk, speculative_num_draft_tokens: Choices
            (default: steps 1-5; topk 1 and the baseline's; draft tokens the baseline's, and 4, 6, 8
            when a topk above 1 is searched). Combinations SGLang refuses are never launched.
        speculative_draft_kv_cache_dtype: Choices of ``--speculative-draft-kv-cache-dtype``
            (default: the baseline's and ``fp8_e4m3``; searched only where the version has the
            flag, SGLang 0.5.23, and the draft shape is searched).
    """

    mem_fraction_static: FloatRange | None = None
    mem_fraction_step: float = Field(default=0.005, gt=0, le=0.05)
    max_running_requests: IntRange | None = None
    chunked_prefill_size: list[int] | None = None
    hierarchical_cache: StrictBool | None = None
    hicache_ratio: FloatRange | None = None
    hicache_size: FloatRange | None = None
    hicache_write_policy: list[Literal["write_through", "write_through_selective", "write_back"]] | None = None
    hicache_io_backend: list[Literal["kernel", "direct"]] | None = None
    hicache_mem_layout: list[Literal["layer_first", "page_first", "page_first_direct", "page_first_kv_split",
                                     "page_head"]] | None = None
    page_size: list[int] | None = None
    cuda_graph_max_bs: list[int] | None = None
    schedule_conservativeness: FloatRange | None = None
    kv_cache_dtype: list[Literal["auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]] | None = None
    dcp_size: list[Annotated[int, Field(ge=1, le=64)]] | None = None
    dp_size: list[Annotated[int, Field(ge=1, le=64)]] | None = None
    exclude_levers: list[Literal["fp8_kv", "dcp", "dp_attention"]] = Field(default_factory=list)
    speculative: StrictBool | None = None
    speculative_num_steps: list[Annotated[int, Field(ge=1)]] | None = None
    speculative_eagle_topk: list[Annotated[int, Field(ge=1)]] | None = None
    speculative_num_draft_tokens: list[Annotated[int, Field(ge=2)]] | None = None
    speculative_draft_kv_cache_dtype: list[Literal["auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]] | None = None

    @field_validator("mem_fraction_static")
    @classmethod
    def _mfs_ok(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        if value is not None:
            low, high = value
            if not 0.05 <= low <= high < 1.0:
                raise ValueError("give [low, high] with 0.05 <= low <= high < 1.0, e.g. [0.80, 0.95]")
        return value

    @field_validator("max_running_requests")
    @classmethod
    def _mrr_ok(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is not None and not 1 <= value[0] <= value[1]:
            raise ValueError("give [low, high] with 1 <= low <= high, e.g. [8, 512]")
        return value

    @field_validator("chunked_prefill_size")
    @classmethod
    def _cps_ok(cls, value: list[int] | None) -> list[int] | None:
        if value is not None:
            if not value:
                raise ValueError("give at least one size, e.g. [-1, 4096, 8192] (-1 disables)")
            if any(v == 0 or v < -1 for v in value):
                raise ValueError("sizes must be positive, or -1 to disable chunked prefill")
        return value

    @field_validator("hicache_ratio", "hicache_size", "schedule_conservativeness")
    @classmethod
    def _positive_range(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        if value is not None and not 0 < value[0] <= value[1]:
            raise ValueError("give [low, high] with 0 < low <= high")
        return value

    @field_validator("page_size", "cuda_graph_max_bs")
    @classmethod
    def _positive_choices(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not value or any(v < 1 for v in value)):
            raise ValueError("give a non-empty list of positive integers")
        return value


class ObjectiveSection(_Section):
    """``[objective]``: how "best" is chosen from the Pareto front of (capacity, throughput).

    Attributes:
        policy: ``throughput_within_capacity`` (default: among feasible trials whose context
            capacity is within ``capacity_tolerance`` of the best, the highest throughput),
            ``max_capacity`` (highest capacity, throughput breaks ties) or ``max_throughput``.
        capacity_tolerance: Relative tolerance (0.05 = within 5 % of the best capacity).
        throughput_noise: Relative throughput margin treated as measurement noise by
            ``throughput_within_capacity`` (0.03: throughputs within 3 % of the band's best are
            ties, and the higher context capacity wins them).
        context_tokens: The context length a "context" means for context capacity (default:
            the workload's longest request, input plus output).
        capacity: Which context capacity the objective and the best rule use: ``slo_safe`` (the
            closed-loop sessions at which the ``[slo]``'s p99 TTFT/ITL still hold in a steady
            window, :mod:`tuner.load.steady`), ``oom_safe`` (longest contexts that fit without
            OOM), or ``auto`` (default: ``slo_safe`` where an SLO is set, else ``oom_safe``).
        longest_share: Share of the steady sessions' requests at the longest context
            (``context_tokens``; the rest keep the workload's own lengths, 0-1; default 1.0: every
            request is a longest context, so the SLO-safe count is in longest contexts as the
            OOM-safe one is). A multi-turn workload's sessions reach it at their last turn instead.
        concurrency: The concurrent sessions the deployment must serve (the operator's figure;
            default: what the config implies: ``[budget] concurrency``, else a multi-turn
            workload's ``num_sessions``, else none). Capacity beyond it does not outrank
            throughput in the best rule (:func:`tuner.study.best.choose_best`).
    """

    policy: Literal["throughput_within_capacity", "max_capacity", "max_throughput"] = (
        "throughput_within_capacity"
    )
    capacity_tolerance: float = Field(default=0.05, ge=0.0, lt=1.0)
    throughput_noise: float = Field(default=0.03, ge=0.0, lt=1.0)
    context_tokens: int | None = Field(default=None, gt=0)
    capacity: Literal["auto", "slo_safe", "oom_safe"] = "auto"
    longest_share: float = Field(default=1.0, ge=0.0, le=1.0)
    concurrency: int | None = Field(default=None, ge=1, le=MAX_CONCURRENCY)


class BudgetSection(_Section):
    """``[budget]``: time limits of the run and of each load phase.

    Attributes:
        total: Default wall-clock budget when ``--budget`` is not given (``4h``, ``90m``).
        trials: Default cap on the number of trials launched in a run (``--trials`` overrides;
            skipped proposals do not count).
        warmup_s: Warm-up phase length (not measured).
        measure_s: Measured window length.
        stress_s: Stress phase length (longest contexts at the highest admitted concurrency).
        max_requests: Cap on requests per measured window (optional).
        concurrency: Client concurrency of the measured window (default: the config's context
            capacity, at least 1).
        request_rate: Poisson arrival rate in req/s of the measured window (default: unbounded).
        max_concurrency: Upper bound of the derived concurrency (client streams).
        early_stop: Stop a load phase early once its SLO is clearly lost.
        probe_only_below: Capacity-first fidelity: a candidate whose context capacity is below
            this share of the best feasible capacity gets no full load (0 disables).
        restore_reserve_s: Seconds kept at the end for restoring the service.
        slo_capacity_steps: Bracketing windows a trial may add when its first steady window (at
            the OOM-safe capacity) breaks the SLO, to measure how many sessions still meet it (0:
            the first window's verdict only). Each is a steady window (:mod:`tuner.load.steady`):
            sessions started over ``ramp_s``, ``warmup_s`` more of warm-up, ``stress_s`` measured.
        ramp_s: The steady window's ramp: its sessions start staggered over this many seconds
            (default: ``min(10, stress_s / 2)``); at most ``stress_s``.
    """

    total: NonEmptyStr | None = None
    trials: int | None = Field(default=None, ge=1)
    warmup_s: float = Field(default=10.0, ge=0, le=DAY_S)
    measure_s: float = Field(default=60.0, gt=0, le=DAY_S)
    stress_s: float = Field(default=30.0, ge=0, le=DAY_S)
    max_requests: int | None = Field(default=None, ge=1)
    concurrency: int | None = Field(default=None, ge=1, le=MAX_CONCURRENCY)
    request_rate: float | None = Field(default=None, gt=0)
    max_concurrency: int = Field(default=256, ge=1, le=MAX_CONCURRENCY)
    early_stop: StrictBool = True
    probe_only_below: float = Field(default=0.8, ge=0.0, le=1.0)
    restore_reserve_s: float = Field(default=0.0, ge=0, le=DAY_S)
    slo_capacity_steps: int = Field(default=2, ge=0, le=8)
    ramp_s: float | None = Field(default=None, ge=0, le=DAY_S)

    @model_validator(mode="after")
    def _ramp_inside_window(self) -> BudgetSection:
        if self.ramp_s is not None and self.stress_s > 0:
            try:
                self.steady_window()
            except TunerError as err:
                raise ValueError(str(err)) from None
        return self

    def steady_window(self) -> SteadyWindow:
        """The trial's steady window (:class:`tuner.load.steady.SteadyWindow`): ``stress_s``
        measured after a ramp of ``ramp_s`` and ``warmup_s`` of settling.

        Raises:
            LoadError: The ramp is longer than the window.
        """
        return SteadyWindow(duration_s=self.stress_s, ramp_s=self.ramp_s, settle_s=self.warmup_s).check(
            ramp_flag="[budget] ramp_s", window_flag="[budget] stress_s")

    @field_validator("total")
    @classmethod
    def _total_ok(cls, value: str | None) -> str | None:
        if value is not None:
            parse_duration_s(value, name="budget.total")
        return value


class StorageSection(_Section):
    """``[storage]``: where trials and artifacts go.

    Attributes:
        url: SQLAlchemy URL of the Optuna storage (default ``sqlite:///studies/<study>.db``,
            relative to the working directory). ``postgresql+psycopg://user:pw@host/db`` shares
            one study between many hosts (``pip install 'sglang-tuner[postgres]'``).
        artifacts_dir: Artifact folder (default ``studies/<study>/artifacts``; local to each host).
        heartbeat_interval_s: Seconds between a running trial's heartbeats in the storage
            (Optuna's ``heartbeat_interval``; whole seconds).
        grace_period_s: Seconds without a heartbeat after which another host marks a running trial
            FAIL and queues its params once more (Optuna's ``grace_period``; whole seconds, more
            than the interval).
        outage_s: Seconds a run waits for a database server that stopped answering (restarting,
            failing over, cut off) before it stops with one line, the service restored and the
            result in flight kept on this host for the next run (:mod:`tuner.study.outage`).
    """

    url: NonEmptyStr | None = None
    artifacts_dir: NonEmptyStr | None = None
    heartbeat_interval_s: int = Field(default=30, ge=1, le=3600)
    grace_period_s: int = Field(default=120, ge=2, le=86400)
    outage_s: float = Field(default=300.0, ge=0, le=86400)

    @model_validator(mode="after")
    def _grace_after_interval(self) -> StorageSection:
        if self.grace_period_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"grace_period_s ({self.grace_period_s}) must exceed heartbeat_interval_s "
                f"({self.heartbeat_interval_s}), e.g. 4 times it"
            )
        return self


class TunerConfig(_Section):
    """The whole config.

    Attributes:
        path: The file it was read from (set by :func:`load_config`).
    """

    study: StudySection = Field(default_factory=StudySection)
    service: ServiceSection
    model: ModelSection = Field(default_factory=ModelSection)
    space: SpaceSection = Field(default_factory=SpaceSection)
    workload: WorkloadSpec
    slo: SLO = Field(default_factory=SLO)
    objective: ObjectiveSection = Field(default_factory=ObjectiveSection)
    budget: BudgetSection = Field(default_factory=BudgetSection)
    storage: StorageSection = Field(default_factory=StorageSection)
    quality: QualityConfig = Field(default_factory=QualityConfig)
    path: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _implied_concurrency(cls, data: Any) -> Any:
        """``[objective] concurrency`` left unset takes what the config implies: ``[budget]
        concurrency`` (the load the operator measures at), else a multi-turn workload's sessions."""
        if not isinstance(data, dict) or not isinstance(data.get("objective", {}), dict):
            return data  # `objective = 1` is refused as not a table, not replaced by one
        objective: dict[str, Any] = data.get("objective", {})
        if objective.get("concurrency") is not None:
            return data
        budget: dict[str, Any] = data["budget"] if isinstance(data.get("budget"), dict) else {}
        workload: dict[str, Any] = data["workload"] if isinstance(data.get("workload"), dict) else {}
        implied = budget.get("concurrency") or (
            workload.get("num_sessions", MultiTurnSpec.model_fields["num_sessions"].default)
            if workload.get("kind") == "multi_turn" else None)
        if implied is None:
            return data
        return {**data, "objective": {**objective, "concurrency": implied}}

    @model_validator(mode="after")
    def _sessions_reach_the_context(self) -> TunerConfig:
        """A study judged on steady sessions (an SLO, capacity not ``oom_safe``) needs sessions
        that reach ``[objective] context_tokens`` (:func:`tuner.load.steady.sessions_reach`)."""
        if self.slo.is_empty() or self.objective.capacity == "oom_safe" or not self.objective.context_tokens:
            return self
        if isinstance(self.workload, MultiTurnSpec):
            try:
                sessions_reach(build_workload(self.workload, seed=self.study.seed), self.objective.context_tokens)
            except TunerError as err:
                raise ValueError(str(err)) from None
        return self



def _location(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if not isinstance(p, int)]
    # Discriminated unions add the tag (``random``) to the location; the user wrote ``workload.x``.
    if len(parts) >= 3 and parts[0] == "workload":
        parts = [parts[0], *parts[2:]]
    return ".".join(parts) or "(top level)"


def parse_config(data: dict[str, Any], *, source: str = "config") -> TunerConfig:
    """Validate a config already read from TOML.

    Args:
        data: The TOML document as a dict.
        source: The file name, for error messages.

    Returns:
        The validated config.

    Raises:
        ConfigError: A key is unknown, missing or out of range (the first problem, one line).
    """
    try:
        return TunerConfig.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = _location(first["loc"])
        kind = first["type"]
        if kind == "extra_forbidden":
            raise ConfigError(
                f"{source}: unknown key {where}",
                hint="remove it or fix its spelling (see configs/demo-sim.toml for every key)",
            ) from None
        value = first.get("input")
        if kind in ("missing", "too_long") and isinstance(first["loc"][-1], int) or kind == "too_long" and \
                isinstance(value, list) and where.startswith("space."):  # a [low, high] range of one or three numbers
            raise ConfigError(f"{source}: {where} is a range: it takes two numbers, [low, high]",
                              hint=f"write {where} like {_key(first['loc'])} = {_example(first['loc']) or '[low, high]'}") from None
        if kind == "missing":
            raise ConfigError(
                f"{source}: missing key {where}",
                hint="add it (see configs/demo-sim.toml for an example)",
            ) from None
        shown = "" if isinstance(value, dict) else f" = {value!r}"
        if kind in _TYPE_WORDS:  # strict types (_Section): nothing coerced, "60" is not 60
            raise _type_error(source, first["loc"], kind, value) from None
        message = first["msg"].removeprefix("Value error, ")
        if message == EMPTY_TEXT:  # NonEmptyStr: "" is not "left out"
            what = "holds an empty word" if isinstance(first["loc"][-1], int) else "is empty"
            raise ConfigError(f"{source}: {where} {what}",
                              hint=f"give it a value, or leave {_key(first['loc'])} out for its default") from None
        if " — " in message:  # a check that names its own fix (a TunerError's message — hint)
            message, fix = message.split(" — ", 1)
            raise ConfigError(f"{source}: {message}" if where == "(top level)" else
                              f"{source}: {where} is invalid: {message}", hint=fix) from None
        raise ConfigError(f"{source}: {where}{shown} is invalid: {message}",
                          hint=f"fix {where} in {source} (configs/demo-sim.toml shows a valid one)") from None


_TYPE_WORDS = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
               "string_type": "a string", "list_type": "a list", "tuple_type": "a list", "dict_type": "a table",
               "model_type": "a table"}
"""What a strict type error's key takes, by pydantic's error type."""


def _key(loc: tuple[Any, ...]) -> str:
    """The key as written in its table (``start_timeout_s``; ``p99`` inside ``ttft_ms``)."""
    return next((str(p) for p in reversed(loc) if isinstance(p, str)), "(top level)")


def _example(loc: tuple[Any, ...]) -> str | None:
    """A valid value of the key at ``loc``, in TOML: its default where it has a scalar one, the demo
    config's range for a ``[space]`` range; ``None`` where neither is known."""
    from pydantic_core import PydanticUndefined

    model: Any = TunerConfig
    field = None
    for part in (p for p in loc if isinstance(p, str)):
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            if field is not None and part in ("random", "shared_prefix", "multi_turn", "trace", "text"):
                continue  # the workload's tag
            return None
        field = fields[part]
        model = field.annotation if isinstance(field.annotation, type) else None
    if field is None:
        return None
    default = field.get_default(call_default_factory=True) if field.default is not PydanticUndefined or \
        field.default_factory is not None else None
    if isinstance(default, bool):
        return "true" if default else "false"
    if isinstance(default, (int, float)):
        return f"{default:g}" if isinstance(default, float) else str(default)
    if isinstance(default, str):
        return f'"{default}"'
    if "Range" in str(field.metadata) or field.description == "[low, high]" or "tuple" in str(field.annotation):
        return "[0.80, 0.95]" if "float" in str(field.annotation).lower() else "[8, 512]"
    return None


def _type_error(source: str, loc: tuple[Any, ...], kind: str, value: Any) -> ConfigError:
    """A value of the wrong TOML type, worded with the key and a valid example: a number in quotes
    (``start_timeout_s = "60"``) is told to lose them, anything else is shown a valid value."""
    where, key, wants = _location(loc), _key(loc), _TYPE_WORDS[kind]
    if isinstance(value, str) and kind in ("int_type", "float_type"):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
        if number is not None and (kind == "float_type" or number.is_integer()):
            return ConfigError(f"{source}: {where} = {value!r} is a string where {wants} belongs",
                               hint=f"write {where} without quotes: {key} = {value.strip()}")
    if isinstance(value, str) and kind == "bool_type" and value.strip().lower() in ("true", "false", "yes", "no"):
        return ConfigError(f"{source}: {where} = {value!r} is a string where true or false belongs",
                           hint=f"write {where} without quotes: {key} = true or {key} = false")
    shown = "a table" if isinstance(value, dict) else repr(value)
    example = _example(loc)
    return ConfigError(f"{source}: {where} = {shown} is not {wants}",
                       hint=f"write {where} like {key} = {example}" if example else
                       f"fix {where} in {source} (configs/demo-sim.toml shows a valid one)")


def check_url_matches_port(url: str | None, argv: Sequence[str]) -> None:
    """Refuse a ``[service] url`` whose port differs from the command's ``--port`` (§2.4: default 30000).

    Every trial would otherwise wait the whole start timeout for a server listening elsewhere.

    Raises:
        StudyError: Both name a port and they differ.
    """
    port = flag_value(argv, "--port")
    if not url or port is None:
        return
    try:
        url_port = urlsplit(url).port
    except ValueError:
        return
    if url_port is not None and str(url_port) != port.strip():
        raise StudyError(
            f"[service] url {url!r} uses port {url_port} but the server command has --port {port}",
            hint=f"make them match (e.g. url = \"http://127.0.0.1:{port}\")",
        )


def load_config(path: str | Path) -> TunerConfig:
    """Read and validate a TOML config file.

    Args:
        path: The file.

    Returns:
        The validated config, with :attr:`TunerConfig.path` set.

    Raises:
        ConfigError: The file is missing, is not TOML, or does not validate.
    """
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"config file {str(file)!r} does not exist",
            hint="pass --config with an existing file, or write one with `tuner init`",
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {str(file)!r} cannot be read: {err}",
                          hint="check its permissions and that it is UTF-8 text (a TOML file)") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(
            f"config file {str(file)!r} is not valid TOML: {err}",
            hint="fix the syntax at that line",
        ) from None
    config = parse_config(data, source=str(file))
    return config.model_copy(update={"path": str(file)})
