"""The study's decisions on every search scenario, as text: the safety net of a refactor.

For each scenario of ``tests/benchmarks/search_scenarios.toml`` at seeds 0-2, the study runs as
the search-quality benchmark runs it (the product's loop and trial on the simulator's offline
evaluation, virtual time, an in-memory study, 20 launches at most), and so do the three HiCache
studies of ``tests/benchmarks/bench_hicache.py`` (the cache candidate, the host-memory check); every progress event that is a
decision is written down in order: a launch's kind, params and outcome; a skip's kind, params and
reason; a note; the stop. Optuna trial numbers are left out (skips are stored by a background
thread, so their numbers interleave): a number in a reason is written as the launch it names
(``L3``, the third launch of the run) or ``T?`` for a trial that was not launched.

``python -m tests.support.decision_trace`` writes the golden file
(``tests/study/golden/decision-trace.txt``); ``tests/study/test_decision_trace.py`` checks the
product still makes the same decisions.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from tests.support.offline_server import OfflineExecutor
from tests.support.scenarios import hicache_scenarios, scenarios, with_seed
from tuner.study.loop import run_study
from tuner.study.progress import Progress

GOLDEN = Path(__file__).resolve().parents[1] / "study" / "golden" / "decision-trace.txt"
SEEDS = (0, 1, 2)
MAX_TRIALS = 20
"""The benchmark's trial cap (20 launches: skips do not count; ``MAX_SKIPS_IN_A_ROW`` bounds them)."""
HICACHE_MAX_TRIALS = 10
"""The HiCache benchmark's trial cap (10 launches)."""

_TRIAL = re.compile(r"\btrials? (\d+)\b")
_NUMBERED = re.compile(r"^(?:trial \d+|a \w+ config)(?: skipped)?: ")


class _Recorder:
    """Turns progress events into trace lines (trial numbers replaced by launch ordinals)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.launches: dict[int, int] = {}

    def _numbers(self, text: str) -> str:
        def name(match: re.Match[str]) -> str:
            number = int(match.group(1))
            ordinal = self.launches.get(number)
            return match.group(0).replace(match.group(1), f"L{ordinal}" if ordinal else "T?")

        return _TRIAL.sub(name, text)

    def __call__(self, event: Progress) -> None:
        if event.event == "trial_start" and event.number is not None:
            self.launches[event.number] = len(self.launches) + 1
            return
        if event.event not in ("trial_end", "skip", "note", "stop"):
            return
        text = self._numbers(_NUMBERED.sub("", event.message))
        flags = json.dumps(_plain(event.flags), sort_keys=True)
        if event.event == "trial_end":
            ordinal = self.launches.get(event.number if event.number is not None else -1, 0)
            self.lines.append(f"launch L{ordinal} {event.kind} {flags} -> {text}")
        elif event.event == "skip":
            self.lines.append(f"skip {event.kind} {flags} -> {text}")
        else:
            self.lines.append(f"{event.event} {text}")


def _plain(flags: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in flags.items()}


def trace(name: str, seed: int) -> list[str]:
    """The decisions of search scenario ``name``'s study at ``seed`` (one line each)."""
    item = scenarios()[name]
    cfg = with_seed(item["config"], seed)
    recorder = _Recorder()
    runner = OfflineExecutor(cfg, world_seed=0, noise=item["noise"])
    run_study(cfg, runner, max_trials=MAX_TRIALS, storage_url=":memory:", on_progress=recorder)
    return recorder.lines


def hicache_trace(name: str) -> list[str]:
    """The decisions of the HiCache benchmark's study ``name`` (its config's seed, 10 launches at
    most, as ``bench_hicache.py`` runs it): the cache candidate and the host-memory check."""
    cfg = hicache_scenarios()[name]
    recorder = _Recorder()
    runner = OfflineExecutor(cfg, pool_requests=256)
    run_study(cfg, runner, max_trials=HICACHE_MAX_TRIALS, storage_url=":memory:", on_progress=recorder)
    return recorder.lines


def studies() -> list[tuple[str, Callable[[], list[str]]]]:
    """Every study of the trace in order, as (its header line, what computes its decisions): each
    search scenario at :data:`SEEDS`, then the HiCache studies."""
    out: list[tuple[str, Callable[[], list[str]]]] = []
    for name in scenarios():
        out.extend((f"## {name} | seed {seed}", partial(trace, name, seed)) for seed in SEEDS)
    out.extend((f"## HiCache: {name}", partial(hicache_trace, name)) for name in hicache_scenarios())
    return out


def render() -> str:
    """The whole trace: each study's header line, then its decisions (:func:`studies`)."""
    out = []
    for header, decisions in studies():
        out.append(header)
        out.extend(decisions())
    return "\n".join(out) + "\n"


def golden_sections() -> dict[str, list[str]]:
    """The checked-in trace as {header line: its decision lines}."""
    sections: dict[str, list[str]] = {}
    lines: list[str] = []
    for line in GOLDEN.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            lines = sections.setdefault(line, [])
        else:
            lines.append(line)
    return sections


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        sys.exit(0 if GOLDEN.read_text(encoding="utf-8") == text else 1)
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(text, encoding="utf-8")
    print(f"wrote {GOLDEN} ({text.count(chr(10))} lines)")
