"""What Optuna sees: storage, the search space and planner, the budget, the loop, and "best".

Modules, in the order a run uses them: :mod:`~tuner.study.storage` (where),
:mod:`~tuner.study.optuna_io` (Optuna's public API), :mod:`~tuner.study.space` and
:mod:`~tuner.study.planner` (what to try), :mod:`~tuner.study.proposals` (the sampler's proposals,
screened in memory), :mod:`~tuner.study.budget` (what fits),
:mod:`~tuner.study.loop` (ask, skip or launch, tell), :mod:`~tuner.study.best` (what to recommend).
Nothing here imports :mod:`tuner.launch`; the trial itself is :mod:`tuner.trial`.
"""

__all__: list[str] = []
