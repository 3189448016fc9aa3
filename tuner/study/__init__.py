"""What Optuna sees: a run's loop, its decisions, what it records, and "best".

One run (:mod:`~tuner.study.loop`, ``StudyRun``) repeats view → decide → claim → run → record:

- where and how a study is stored: :mod:`~tuner.study.storage` (the one rule for
  ``studies/<study>.db``), :mod:`~tuner.study.optuna_io` (Optuna's public API: open, tell, the
  study's attributes), :mod:`~tuner.study.hosts` (many hosts on one study: claims, heartbeats, the
  reaper, and the only module that reads Optuna's private attributes);
- what the study searches: :mod:`~tuner.study.space` (the knob table and the baseline-derived
  space), :mod:`~tuner.study.baseline` (the service's own flags, measured once, fix the space);
- what a decision sees: :mod:`~tuner.study.view` (one frozen read of the study),
  :mod:`~tuner.study.calibration` (the memory and SLO models calibrated on it),
  :mod:`~tuner.study.slo_bound` (where the latency SLO breaks), :mod:`~tuner.study.hostcheck`
  (host pools against the host);
- what decides: :mod:`~tuner.study.decide` (proposers and screens, the chain in
  :mod:`~tuner.study.decide.chain`);
- what a trial is handed and returns: :mod:`~tuner.study.job` (``TrialJob``, the ``TrialRunner``
  protocol :class:`tuner.trial.TrialExecutor` implements);
- what a run stores and tells: :mod:`~tuner.study.record` (tell, skips, late results),
  :mod:`~tuner.study.progress` (events, the launch estimate, the run's summary);
- what fits and what wins: :mod:`~tuner.study.budget`, :mod:`~tuner.study.best`.

Nothing here imports :mod:`tuner.launch` or :mod:`tuner.trial`.
"""

__all__: list[str] = []
