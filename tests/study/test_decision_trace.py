"""The study makes the same decisions on every search scenario as the checked-in trace.

The trace (:mod:`tests.support.decision_trace`) is the product's loop on the simulator's offline
evaluation at seeds 0-2: every launch (kind, params, outcome), every skip (kind, params, reason),
every note and the stop. A change that alters a decision fails here with the first lines that
differ; when the change is meant to alter decisions, say why in its commit and write the trace
again (``python -m tests.support.decision_trace``).
"""

from __future__ import annotations

import difflib

import pytest

from tests.support.decision_trace import GOLDEN, render


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_decisions_on_every_search_scenario_match_the_golden_trace() -> None:
    expected = GOLDEN.read_text(encoding="utf-8")
    actual = render()
    if actual != expected:
        diff = difflib.unified_diff(expected.splitlines(), actual.splitlines(), "golden", "now", lineterm="", n=2)
        shown = "\n".join(list(diff)[:60])
        pytest.fail(f"the study's decisions changed (python -m tests.support.decision_trace writes them):\n{shown}")
