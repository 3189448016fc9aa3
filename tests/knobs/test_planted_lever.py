"""A new structural lever is one module: a lever planted in :data:`tuner.knobs.LEVERS` (and nowhere
else) reaches the space, the render, the rung proposer and the availability screen of a study that
runs the product's own trial on the simulator (offline, virtual time).

The planted lever's knob ``planted_decode_steps`` renders to ``--num-continuous-decode-steps`` (a real
flag of SGLang 0.5.5 that the simulator accepts and does not model; the neutral 1 removes it): values
1, 2 and 3, where its own rule says 3 is unavailable. Nothing outside this file names it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import optuna
import pytest

import tuner.knobs
from tests.support.offline_server import OfflineExecutor
from tuner.config import TunerConfig
from tuner.errors import FlagError
from tuner.knobs import Knob, Lever
from tuner.sglang.flags import FlagTable
from tuner.sglang.levers import Verdict
from tuner.study.loop import run_study
from tuner.study.optuna_io import SPACE_ATTR
from tuner.study.space import Space
from tuner.trial import render_argv

LLAMA = Path(__file__).resolve().parents[2] / "tuner" / "data" / "models" / "llama-3.1-8b"
NAME = "planted_decode_steps"
FLAG = "num_continuous_decode_steps"


class _Planted(Lever):
    def derived(self, base: Any, *, tp: int) -> tuple[Any, ...]:
        return (base, 2, 3)

    def feasible(self, *, gpu: str | None, version: str, backend: str | None, attentions: Sequence[str]) -> Verdict:
        return Verdict(ok=True, why="planted: every cell supports it")

    def unavailable(self, value: Any, *, version: str | None, tp: int) -> str | None:
        return "planted: 3 continuous decode steps are not available here" if int(value) == 3 else None

    def render(self, value: Any) -> dict[str, Any]:
        return {FLAG: None if value in (None, 1) else int(value)}

    def rung(self, value: Any) -> dict[str, Any]:
        return {} if value in (None, 1) else {FLAG: int(value)}

    def gain(self, value: Any) -> float:
        return float(value)


PLANTED = _Planted(name="planted", words=f"planted ({NAME})", flag=FLAG, neutral=1, changes_numerics=False,
                   knob=Knob(name=NAME, kind="categorical", domain="levers", help="Decode steps per schedule (planted)."))


@pytest.fixture
def planted(monkeypatch: pytest.MonkeyPatch) -> Lever:
    monkeypatch.setattr(tuner.knobs, "LEVERS", (*tuner.knobs.LEVERS, PLANTED))
    return PLANTED


def _config(tmp_path: Path) -> TunerConfig:
    return TunerConfig.model_validate({
        "study": {"name": "planted", "seed": 0},
        "service": {"launcher": "process", "command": [
            "{python}", "-m", "tuner.sim", "--model-path", "llama-3.1-8b", "--sim-gpu", "L4-24GB",
            "--mem-fraction-static", "0.80"]},
        "model": {"config_json": str(LLAMA / "config.json")},
        "storage": {"url": f"sqlite:///{tmp_path / 'study.db'}", "artifacts_dir": str(tmp_path / "artifacts")},
        "space": {"mem_fraction_static": [0.78, 0.9], "mem_fraction_step": 0.01, "chunked_prefill_size": [2048]},
        "workload": {"kind": "random", "input_len": 2016, "output_len": 32, "range_ratio": 0.5},
        "slo": {"ttft_ms": {"p99": 10000}, "itl_ms": {"p99": 2500}},
        "budget": {"warmup_s": 2, "measure_s": 10, "stress_s": 5, "max_concurrency": 32},
    })


def test_the_render_and_the_space_read_the_planted_lever() -> None:
    argv = ["python", "-m", "sglang.launch_server", "--model-path", "m", "--num-continuous-decode-steps", "4"]
    table = FlagTable.for_version("0.5.5")
    with pytest.raises(FlagError):  # not a lever: a knob SGLang does not have
        render_argv(argv, {NAME: 2}, table)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tuner.knobs, "LEVERS", (*tuner.knobs.LEVERS, PLANTED))
        assert render_argv(argv, {NAME: 2}, table)[-2:] == ["--num-continuous-decode-steps", "2"]
        assert "--num-continuous-decode-steps" not in render_argv(argv, {NAME: 1}, table)  # neutral: removed
        space = Space(mem_fraction_static=(0.8, 0.9, 0.01), max_running_requests=(1, 8), chunked_prefill_size=(2048,),
                      levers={NAME: (1, 2, 3)})
        assert space.distributions()[NAME].choices == (1, 2, 3)  # type: ignore[attr-defined]
        assert space.snap({NAME: 2})[NAME] == 2 and space.snap({})[NAME] == 1
    assert NAME not in space.model_copy().distributions()  # unplanted, the space does not know the knob


def test_a_planted_lever_reaches_the_space_the_render_the_rungs_and_the_screen(planted: Lever, tmp_path: Path) -> None:
    config = _config(tmp_path)
    runner = OfflineExecutor(config, world_seed=0)
    skips: list[str] = []
    notes: list[str] = []
    run_study(config, runner, max_trials=4, storage_url=config.storage.url,
              on_progress=lambda e: (skips if e.event == "skip" else notes).append(e.message or ""))

    # The space: derived by the lever's own rules, searched as one more categorical knob.
    study = optuna.load_study(study_name=config.study.name, storage=config.storage.url)
    space = Space.model_validate(study.user_attrs[SPACE_ATTR])
    assert space.levers.get(NAME) == (1, 2, 3), space.levers
    assert any(reason.startswith(f"planted ({NAME}): derived: 1, 2, 3") for reason in space.lever_reasons), space.lever_reasons

    # The rung proposer launched its rung first after the baseline, rendered to its flag, and the
    # simulator started with it.
    launched = [(n, r) for n, r in runner.history if r.params.get(NAME) == 2]
    assert launched, [r.params for _, r in runner.history]
    record = launched[0][1]
    assert (record.prediction.why or "").startswith(f"rung {FLAG}=2 on the best flags so far"), record.prediction.why  # its ladder flags
    at = record.argv.index("--num-continuous-decode-steps")  # the lever's render, not the knob's name
    assert record.argv[at + 1] == "2" and record.outcome == "ok", (record.argv, record.outcome)
    assert runner.history[1][1] is record

    # The availability screen: the value its rule refuses is skipped with the fact, never launched.
    assert not any(r.params.get(NAME) == 3 for _, r in runner.history)
    assert any("unavailable: planted: 3 continuous decode steps are not available here" in s for s in skips), skips


def test_the_ladder_reads_the_planted_lever_from_the_declarations_it_is_handed() -> None:
    """``tuner explain``'s ladder and the rung proposer price a rung's availability with the levers
    they hand the ladder (:attr:`tuner.sglang.ladder.LadderBase.levers`, issue 39): the planted
    lever's own layout rule refuses its value 3; the ladder handed the shipped levers alone does not
    know that rule (before, the ladder kept its own map of three levers)."""
    from tuner.sglang.ladder import LadderBase, evaluate
    from tuner.sglang.memory import KVCapacityModel

    mem = KVCapacityModel(baseline_gib=80.0, static_gib=20.0, cell_bytes=131072, observed_mem_fraction_static=0.8,
                          observed_tokens=100_000)
    base = LadderBase(memory=mem, mem_fraction_static=0.8, levers=(*tuner.knobs.LEVERS, PLANTED))
    refused = evaluate(base, {FLAG: 3})
    assert refused.available is False and "planted: 3 continuous decode steps are not available here" in refused.why
    assert evaluate(base, {FLAG: 2}).available is not False
    assert evaluate(base.model_copy(update={"levers": tuner.knobs.LEVERS}), {FLAG: 3}).available is not False
