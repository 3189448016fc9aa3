"""The study makes the same decisions on every search scenario as the checked-in trace.

The trace (:mod:`tests.support.decision_trace`) is the product's loop on the simulator's offline
evaluation at seeds 0-2: every launch (kind, params, outcome), every skip (kind, params, reason),
every note and the stop. A change that alters a decision fails here with the first lines that
differ; when the change is meant to alter decisions, say why in its commit and write the trace
again (``python -m tests.support.decision_trace``). One test per scenario (its seeds together), so
that the scenarios spread over the suite's workers.
"""

from __future__ import annotations

import difflib
from collections import defaultdict

import pytest

from tests.support.decision_trace import golden_sections, studies

_BY_SCENARIO: dict[str, list[str]] = defaultdict(list)
for _header, _ in studies():
    _BY_SCENARIO[_header.split(" | seed ")[0].removeprefix("## ")].append(_header)


def test_the_golden_trace_holds_every_study_and_no_other() -> None:
    assert list(golden_sections()) == [header for header, _ in studies()]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("scenario", list(_BY_SCENARIO))
def test_the_decisions_on_every_search_scenario_match_the_golden_trace(scenario: str) -> None:
    golden = golden_sections()
    decisions = dict(studies())
    for header in _BY_SCENARIO[scenario]:
        expected = golden.get(header, [])
        actual = decisions[header]()
        if actual != expected:
            diff = difflib.unified_diff(expected, actual, "golden", "now", lineterm="", n=2)
            shown = "\n".join(list(diff)[:60])
            pytest.fail(f"{header}: the study's decisions changed (python -m tests.support.decision_trace "
                        f"writes them):\n{shown}")
