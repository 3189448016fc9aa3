"""The baseline is measured once per study: a host that waits while another measures it takes that
baseline when it finishes, on a real PostgreSQL server with two hosts' own connections."""

from __future__ import annotations

import optuna
import pytest
from optuna.storages import RDBStorage

from tuner.records import TrialRecord
from tuner.study import baseline as baseline_module
from tuner.study.baseline import claim_baseline
from tuner.study.hosts import ClaimLock
from tuner.study.optuna_io import SPACE_ATTR, tell_record

optuna.logging.set_verbosity(optuna.logging.WARNING)

ENV = {"sglang_version": "0.5.5", "gpu_name": "L4-24GB", "model": "llama-3.1-8b", "gpu_count": 1}


def _host(url: str) -> optuna.Study:
    return optuna.create_study(study_name="s", storage=RDBStorage(url), load_if_exists=True,
                               directions=["maximize", "maximize"])


def test_a_waiting_host_takes_the_baseline_that_finishes_while_it_looks(postgres_url: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Host B waits for host A's baseline longer than the stored space's visibility wait; A's
    baseline finishes between B's look at the finished trials and its look at the running ones
    (there: inside B's budget check, which sat between them). B must take A's baseline: before,
    it saw it neither finished nor running, and measured the baseline a second time (1 of 4 fleet
    starts, 34 ms after the first host finished it)."""
    monkeypatch.setattr(baseline_module, "WAIT_POLL_S", 0.01)
    monkeypatch.setattr(baseline_module, "BASELINE_VISIBLE_S", 0.05)
    a, b = _host(postgres_url), _host(postgres_url)
    claim_a, claim_b = ClaimLock.of(a), ClaimLock.of(b)
    trial_a, _ = claim_baseline(a, ENV, "host-a", claim=claim_a.held, can_continue=lambda: True,
                                own_environment=lambda: True, on_wait=lambda _t: None)
    assert trial_a is not None
    a.set_user_attr(SPACE_ATTR, {"fixed": "by the baseline, before its tell"})  # as fix_space does
    looks = []
    waits: list[str] = []

    def budget_holds() -> bool:
        looks.append(1)
        if len(looks) == 20:  # B has waited past BASELINE_VISIBLE_S: A's baseline finishes now
            tell_record(a, trial_a, TrialRecord(kind="baseline", outcome="ok", token_capacity=21032,
                                                context_capacity=10, output_throughput_tok_s=43.0,
                                                duration_s=30.0))
        return True

    trial_b, found = claim_baseline(b, ENV, "host-b", claim=claim_b.held, can_continue=budget_holds,
                                    own_environment=lambda: True, on_wait=waits.append)
    assert trial_b is None, f"host B measured the baseline again (trial {trial_b.number})"
    assert found is not None and found[0] == trial_a.number
    assert waits and "waiting for the baseline" in waits[0]
    assert len(b.get_trials()) == 1
