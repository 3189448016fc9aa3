"""Each structural lever's declaration (:mod:`tuner.knobs`) holds together, and its rules reach the
places that read :data:`tuner.knobs.LEVERS`: the numerics key, the fingerprint's layout, and the
checks a run makes on ``[space]`` before it changes anything (``tuner run`` and its dry run, on the
simulator's demo config: Llama-3.1-8B at tp 1 on SGLang 0.5.5)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli import one_error_line, run_tuner
from tests.support.configs import config_copy
from tuner.config import SpaceSection
from tuner.errors import ConfigError
from tuner.knobs import LEVERS, check_listed_levers
from tuner.sglang.numerics import NUMERICS_FLAGS, numerics_changes
from tuner.study.fingerprint import LAYOUT_FLAGS
from tuner.study.launch import launch_fields


def _values(lever) -> list:  # type: ignore[no-untyped-def]
    return [v for v in lever.derived(lever.neutral, tp=8) if v != lever.neutral]


@pytest.mark.parametrize("lever", LEVERS, ids=[lever.name for lever in LEVERS])
def test_a_lever_that_changes_numerics_launches_numerics_flags_and_the_key_sees_each_value(lever) -> None:  # type: ignore[no-untyped-def]
    for value in _values(lever):
        launched = {k for k, v in lever.render(value).items() if v is not None}
        assert launched, (lever.name, value)
        if lever.changes_numerics:
            assert launched <= set(NUMERICS_FLAGS), (lever.name, launched)
            # the key of the launch differs from the baseline's: dp_size 4 over 1 was once read as no change
            assert numerics_changes(launch_fields({lever.knob.name: value}, {}), launch_fields({}, {})), (lever.name, value)
        assert set(lever.layout) <= set(LAYOUT_FLAGS)
    neutral = {k for k, v in lever.render(lever.neutral).items() if v is not None and k != lever.knob.name}
    assert not neutral, (lever.name, neutral)  # the neutral value sets no other flag


@pytest.mark.parametrize(("listed", "tp", "version", "needle"), [
    ({"dcp_size": [2]}, 2, "0.5.5", "SGLang 0.5.5 has no --dcp-size"),
    ({"dp_size": [3]}, 1, "0.5.23", "--dp-size 3 must divide --tp-size 1"),
    ({"dp_size": [3]}, 1, None, "--dp-size 3 must divide --tp-size 1"),  # the layout needs no version
    ({"dcp_size": [4]}, 8, "0.5.23", None),
    ({"dcp_size": [3]}, 8, "0.5.23", "--dcp-size 3 must divide --tp-size 8"),
    ({"kv_cache_dtype": []}, 1, "0.5.5", "[space] kv_cache_dtype = [] lists no value"),
    ({"dcp_size": []}, 1, "0.5.5", "[space] dcp_size = [] lists no value"),
    ({"kv_cache_dtype": ["auto", "fp8_e4m3"]}, 1, "0.5.5", None),
    ({"dcp_size": [1]}, 1, "0.5.5", None),  # the neutral value pins it: nothing to launch
])
def test_each_listed_lever_is_checked_by_its_own_rule(listed: dict, tp: int, version: str | None, needle: str | None) -> None:
    section = SpaceSection.model_validate(listed)
    if needle is None:
        check_listed_levers(section, version=version, tp=tp)
        return
    with pytest.raises(ConfigError) as err:
        check_listed_levers(section, version=version, tp=tp)
    assert needle in err.value.message and "\n" not in str(err.value)


@pytest.mark.parametrize(("line", "needles"), [
    ("dcp_size = [2]", ("[space] dcp_size = [2]", "SGLang 0.5.5 has no --dcp-size", "leave dcp_size out")),
    ("dp_size = [3]", ("[space] dp_size = [3]", "--dp-size 3 must divide --tp-size 1")),
    ("kv_cache_dtype = []", ("[space] kv_cache_dtype = [] lists no value", "exclude_levers")),
])
def test_the_dry_run_refuses_a_lever_the_deployment_cannot_take(tmp_path: Path, line: str, needles: tuple[str, ...]) -> None:
    """The first hour's sweep: each of these passed the dry run (``dcp_size = [2]`` on 0.5.5,
    ``dp_size = [3]`` at tp 1; ``kv_cache_dtype = []`` read as unset while ``page_size = []`` was refused)."""
    config = config_copy("demo-sim.toml", tmp_path)
    config.write_text(config.read_text().replace("[space]\n", f"[space]\n{line}\n", 1))
    one_error_line(run_tuner("run", "--config", str(config), "--dry-run"), *needles)
