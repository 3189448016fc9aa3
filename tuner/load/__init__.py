"""Load generator: workloads, arrivals, an async streaming client, and bench_serving-compatible metrics.

The public API is :data:`__all__`; see ``docs/load-generator.md`` for ``tuner load``.
"""

from tuner.load.arrivals import PhasePlan, arrival_offsets_s
from tuner.load.client import StreamClient
from tuner.load.metrics import SLO, ErrorCount, LoadSummary, RequestRecord, request_itls_s, summarize, top_errors
from tuner.load.runner import LiveStats, LoadResult, PhaseWindow, run_load, run_load_sync
from tuner.load.search import MaxLoadResult, SearchStep, find_max_under_slo, find_max_under_slo_async, wilson_interval
from tuner.load.workloads import (
    MultiTurnSpec,
    RandomSpec,
    Request,
    SharedPrefixSpec,
    TraceSpec,
    Workload,
    WorkloadSpec,
    build_workload,
    capacity_probe,
    designed_hit_rate,
)

__all__ = [
    "RandomSpec",
    "SharedPrefixSpec",
    "MultiTurnSpec",
    "TraceSpec",
    "WorkloadSpec",
    "Request",
    "Workload",
    "build_workload",
    "capacity_probe",
    "designed_hit_rate",
    "PhasePlan",
    "arrival_offsets_s",
    "StreamClient",
    "SLO",
    "RequestRecord",
    "LoadSummary",
    "ErrorCount",
    "summarize",
    "top_errors",
    "request_itls_s",
    "LiveStats",
    "PhaseWindow",
    "LoadResult",
    "run_load",
    "run_load_sync",
    "SearchStep",
    "MaxLoadResult",
    "find_max_under_slo",
    "find_max_under_slo_async",
    "wilson_interval",
]
