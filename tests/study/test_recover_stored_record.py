"""A trial killed after its record was stored but before Optuna marked it finished is kept, not re-measured.

``tell_record`` writes the record, then the constraints, then tells Optuna; a ``kill -9`` between
the two leaves a RUNNING trial that carries a complete record. The next run's recovery tells it as
``tell_record`` would have (no restart, no second measurement); a RUNNING trial without a record,
or with a partial one (an interruption), is marked FAIL and its params are enqueued again.
Real SQLite file, real Optuna; the "killed" run is a separate process that exits without telling.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import optuna
from optuna.trial import TrialState

from tuner.study.hosts import recover_own
from tuner.study.optuna_io import make_sampler, open_study, records
from tuner.study.storage import open_storage

_KILLED_RUN = r'''
import os, sys
import optuna
from optuna.distributions import FloatDistribution
from tuner.records import RECORD_ATTR, TrialRecord
from tuner.study.optuna_io import constraints_of, make_sampler, open_study
from tuner.study.storage import open_storage

study = open_study("rec", open_storage(sys.argv[1]), make_sampler("random", 0))
space = {"mem_fraction_static": FloatDistribution(0.5, 0.98)}
# trial 0: killed inside tell_record, after the record and the constraints were stored
done = study.ask(space)
record = TrialRecord(params=dict(done.params), kind="sampled", outcome="ok", context_capacity=12,
                     output_throughput_tok_s=345.0, duration_s=61.0, feasible=True,
                     constraints={"oom_or_crash": -1.0, "slo": -0.2, "stress": -1.0})
done.set_user_attr(RECORD_ATTR, record.model_dump(mode="json"))
for name, value in constraints_of(record).items():
    done.set_constraint(name, value)
# trial 1: killed while measuring (no record); trial 2: killed inside fail_trial (partial record)
study.ask(space)
partial = study.ask(space)
partial.set_user_attr(RECORD_ATTR, TrialRecord(params=dict(partial.params), kind="sampled", outcome="failed",
    failure_evidence="interrupted (Ctrl-C or SIGTERM) during the trial", duration_s=3.0).model_dump(mode="json"))
os._exit(0)  # no tell, no cleanup: what kill -9 leaves
'''


def test_recovery_keeps_a_stored_record_and_requeues_the_rest(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'rec.db'}"
    subprocess.run([sys.executable, "-c", _KILLED_RUN, url], check=True, timeout=120)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = open_study("rec", open_storage(url), make_sampler("random", 0))
    assert [t.state for t in study.trials] == [TrialState.RUNNING] * 3
    params = [dict(t.params) for t in study.trials]

    requeued = recover_own(study, "this-host", shared=False)

    trials = study.get_trials(deepcopy=False)
    assert trials[0].state is TrialState.COMPLETE and trials[0].values == [12.0, 345.0]
    assert [(t.number, r.context_capacity) for t, r in records(study)] == [(0, 12)]  # what the run's history sees
    assert requeued == [1, 2]
    assert [t.state for t in trials[1:3]] == [TrialState.FAIL, TrialState.FAIL]
    assert sum(t.state is TrialState.WAITING for t in trials) == 2
    assert recover_own(study, "this-host", shared=False) == []  # idempotent
    space = {"mem_fraction_static": optuna.distributions.FloatDistribution(0.5, 0.98)}
    assert [dict(study.ask(space).params) for _ in range(2)] == [params[1], params[2]]  # re-measured next; not 0
