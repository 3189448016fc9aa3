"""Shared pytest setup: benchmarks run only with ``--run-benchmarks``."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-benchmarks",
        action="store_true",
        default=False,
        help="run tests/benchmarks (speed and search-quality figures for the README)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-benchmarks"):
        return
    skip = pytest.mark.skip(reason="benchmark: run with `pytest tests/benchmarks --run-benchmarks`")
    for item in items:
        if "benchmarks" in item.path.parts:
            item.add_marker(skip)
