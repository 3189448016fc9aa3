"""Fixtures of the apply tests (shared with tests/report)."""

from tests.report.cli_runner import tuner_cli  # noqa: F401  (fixture)
