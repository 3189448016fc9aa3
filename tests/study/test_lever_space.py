"""Structural levers as dimensions of the space (issue 23): ``[space] kv_cache_dtype`` / ``dcp_size``
become categorical knobs with the baseline's value first, and the lever screen skips what the
SGLang version does not have (named from its flag table) before any launch."""

from __future__ import annotations

from tests.support.views import study_view
from tuner.config import BudgetSection, SpaceSection
from tuner.sglang.flags import FlagTable
from tuner.study.decide.screens import Unavailable
from tuner.study.space import resolve_space
from tuner.trial import render_argv

BASELINE = {"mem_fraction_static": 0.88, "max_running_requests": 48, "chunked_prefill_size": 8192}
ARGV = ["python", "-m", "sglang.launch_server", "--model-path", "m", "--tp-size", "8", "--mem-fraction-static", "0.88"]


def _space():
    return resolve_space(SpaceSection(kv_cache_dtype=["fp8_e4m3"], dcp_size=[8, 3]), BASELINE)


def test_levers_are_dimensions_only_when_the_space_names_them():
    space = _space()
    assert space.levers == {"kv_cache_dtype": ("auto", "fp8_e4m3"), "dcp_size": (1, 8, 3)}
    assert {"kv_cache_dtype", "dcp_size"} <= set(space.distributions())
    assert not {"kv_cache_dtype", "dcp_size"} & set(resolve_space(SpaceSection(), BASELINE).distributions())


def _view():
    return study_view(_space(), [], context_tokens=32768, budget=BudgetSection(), mean_request_tokens=4096)


def test_the_lever_screen_names_the_missing_flag_and_the_divisor():
    view = _view()
    old, new = Unavailable("0.5.5", ARGV), Unavailable("0.5.23", ARGV)
    skip = old.why_not({**BASELINE, "dcp_size": 8}, view)
    assert skip is not None and "has no --dcp-size" in skip.reason and skip.proof is None  # no baseline yet: no trial
    assert new.why_not({**BASELINE, "dcp_size": 8}, view) is None
    bad = new.why_not({**BASELINE, "dcp_size": 3}, view)
    assert bad is not None and "must divide --tp-size 8" in bad.reason
    assert old.why_not({**BASELINE, "kv_cache_dtype": "fp8_e4m3", "dcp_size": 1}, view) is None
    assert Unavailable("0.5.5", ARGV).why_not({"kv_cache_dtype": "mxfp8"}, view) is not None  # 0.5.23's dtype


def test_the_lever_screen_cites_the_study_baseline_not_trial_0():
    """A version fact is proved by the study's baseline, whichever trial it is: here trial 0 was a
    baseline that could not start (the command was fixed) and trial 1 an interrupted trial, so the
    baseline is trial 2 (before, the screen cited trial 0 whatever it was)."""
    from tuner.records import TrialRecord

    broken = TrialRecord(params=BASELINE, kind="baseline", outcome="failed", failure_evidence="no such file")
    other = TrialRecord(params=BASELINE, kind="sampled", outcome="failed", failure_evidence="interrupted")
    baseline = TrialRecord(params=BASELINE, kind="baseline", outcome="ok", token_capacity=159277)
    view = study_view(_space(), [(0, broken), (1, other), (2, baseline)], context_tokens=32768, budget=BudgetSection(),
                      mean_request_tokens=4096)
    assert view.baseline == 2
    skip = Unavailable("0.5.5", ARGV).why_not({**BASELINE, "dcp_size": 8}, view)
    assert skip is not None and skip.proof == 2
    assert skip.record(BASELINE, "sampled").proved_by_trial == 2


def test_a_candidate_without_dcp_renders_on_a_version_without_the_flag():
    argv = render_argv(ARGV, {**BASELINE, "kv_cache_dtype": "fp8_e4m3", "dcp_size": 1}, FlagTable.for_version("0.5.5"))
    assert "--dcp-size" not in argv and argv[argv.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    argv = render_argv(ARGV, {**BASELINE, "dcp_size": 8}, FlagTable.for_version("0.5.23"))
    assert argv[argv.index("--dcp-size") + 1] == "8"


def test_a_trial_that_changes_numerics_says_so_in_its_attributes():
    """The quality gate's scope (issue 24) is stored with each trial of a lever that changes numerics."""
    import optuna

    from tuner.study.decide import Proposal
    from tuner.study.optuna_io import SPACE_ATTR
    from tuner.study.record import NUMERICS_ATTR, Recorder

    study = optuna.create_study(storage=optuna.storages.InMemoryStorage(), directions=["maximize"])
    study.set_user_attr(SPACE_ATTR, _space().model_dump(mode="json"))
    recorder = Recorder(study, None, "host", {})
    fp8 = recorder.ask(Proposal(params={**BASELINE, "kv_cache_dtype": "fp8_e4m3", "dcp_size": 1}))
    assert fp8.user_attrs[NUMERICS_ATTR] == ["kv_cache_dtype"]
    same = recorder.ask(Proposal(params={**BASELINE, "kv_cache_dtype": "auto", "dcp_size": 1}))
    assert NUMERICS_ATTR not in same.user_attrs


def test_rungs_are_proposed_on_the_best_flags_largest_gain_first_and_unavailable_ones_are_screened():
    from tests.support.views import study_view as view_of
    from tuner.config import ObjectiveSection
    from tuner.records import TrialRecord
    from tuner.study.decide import first_skip
    from tuner.study.decide.rungs import RungCandidate

    space = _space()
    baseline = TrialRecord(params={**BASELINE, "kv_cache_dtype": "auto", "dcp_size": 1}, kind="baseline", outcome="ok",
                           context_tokens=32768, context_capacity=4, token_capacity=159277, feasible=True,
                           output_throughput_tok_s=100.0, constraints={"oom_or_crash": -1.0, "slo": -1.0, "stress": -1.0})
    view = view_of(space, [(0, baseline)], context_tokens=32768, budget=BudgetSection(), mean_request_tokens=4096)
    first = RungCandidate(ObjectiveSection()).propose(view)
    assert first is not None and first.params["dcp_size"] == 8 and first.params["kv_cache_dtype"] == "auto"
    skip = first_skip([Unavailable("0.5.5", ARGV)], first.params, view)
    assert skip is not None and "has no --dcp-size" in skip.reason  # never launched on 0.5.5
    tried = TrialRecord(params=first.params, kind="predicted", outcome="skipped", skipped_reason=skip.reason, proved_by_trial=0)
    after = view_of(space, [(0, baseline), (1, tried)], context_tokens=32768, budget=BudgetSection(), mean_request_tokens=4096)
    second = RungCandidate(ObjectiveSection()).propose(after)
    assert second is not None and second.params["dcp_size"] == 3
