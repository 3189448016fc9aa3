"""sglang-tuner: auto-tune SGLang's memory and scheduling knobs with an Optuna study.

The layers, top to bottom: a module imports only from layers below it (``|`` separates siblings
that do not import each other). ``[tool.importlinter]`` in ``pyproject.toml`` states the same
order and ``tests/test_architecture.py`` runs it, so an upward import fails the suite::

    script                                the console script: the CLI imported under a Ctrl-C guard
    cli                                   the commands (one module per group), the one-line error boundary
    report | apply                        rendering of stored results; persisting a trial's flags
    results | entrypoints | starter       the read model; the composition root (tune, dry_run); tuner init
    served                                the service as trial.ServerUnderTest (launcher + HTTP load + GPU monitor)
    trial | preflight                     one trial's phases (TrialExecutor, implements study.job.TrialRunner,
                                          drives the ServerUnderTest it defines; never imports launch);
                                          the checks every command makes before it takes a unit
    study                                 storage, Optuna I/O, space, the decisions (decide/), budget,
                                          the loop, record, hosts, best
    knobs                                 the structural levers declared, one module each (LEVERS), and the Knob row
    config                                the TOML schema (uses load's workload/SLO models, units)
    launch | load | gpu                   service control; the load generator; the GPU monitor
    records                               TrialRecord, PhaseResult, Constraints: what a trial produces
    sglang                                SGLang's facts: flags, versions, logs, failures, memory, client
    units                                 durations and GiB
    errors                                the error tree

``tuner.sim`` is apart: it imports nothing from ``tuner`` and re-derives SGLang's behaviour from
SGLang's own source, so tests never check the product against itself. It shares only data files
(``tuner/data/``: flag tables, model configs), which it reads with :mod:`importlib.resources`.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
