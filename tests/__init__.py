"""The test suite, mirroring the package (folders are packages, so basenames need not be unique).

- ``tests/study``: the study loop, space, planner, budget and best rule (``tuner/study/``), and
  ``tuner run`` end to end (``test_run_e2e.py``, ``test_run_errors.py``, ``test_run_systemd.py``).
- ``tests/report``: the readers (``tuner/results.py``, ``tuner trials/show/best``) and the report
  (``tuner/report/``), on factory-made studies and on the session's real demo run.
- ``tests/apply``: ``plan_apply``/``plan_undo`` (``test_plan.py``), the CLI, and apply under systemd.
- ``tests/launch``: the launchers (the conformance class, both launchers), units, the emulator.
- ``tests/load``, ``tests/sglang``, ``tests/sim``: the load generator, SGLang's facts, the simulator.
- ``tests/cli``: the CLI's one-line error boundary.
- ``tests/multihost``: many hosts on one study in a real PostgreSQL server (``tuner/study/hosts.py``,
  three ``tuner run`` processes, a killed host, bad storages, ``copy-study``).
- ``tests/test_config.py``, ``test_gpu.py``, ``test_trial.py``, ``test_starter.py``,
  ``test_architecture.py``: the top-level modules and the layer contract.
- ``tests/benchmarks``: speed and search-quality figures (``--run-benchmarks``).
- ``tests/support``: one copy of every helper (see its ``__init__``); ``tests/fixtures``: data.

Fixtures live in ``conftest.py`` files: ``tests/conftest.py`` (``tuner_cli``, ``workdir``,
``systemd_sandbox``, the session's ``demo_run``, the hygiene check), ``tests/load/conftest.py``
(the SSE server), ``tests/report/conftest.py`` (factory-made studies).
"""
