"""Helpers shared by the test folders: one copy of each (fixtures live in the ``conftest.py`` files).

- :mod:`tests.support.net`: ``free_port``.
- :mod:`tests.support.cli`: the ``tuner`` CLI as a subprocess or in-process, the one-error-line check.
- :mod:`tests.support.sim`: the simulator as a real process; polling ``/health``.
- :mod:`tests.support.configs`: bundled configs copied onto free ports and temporary folders; stored studies.
- :mod:`tests.support.postgres`: a private PostgreSQL cluster (initdb/pg_ctl) for the many-hosts tests.
- :mod:`tests.support.sandbox`: real systemd booted in a private PID namespace (or its emulator).
- :mod:`tests.support.conformance`: the launcher contract every launcher passes.
- :mod:`tests.support.study_factory`: SQLite studies written the way ``tuner run`` stores them.
- :mod:`tests.support.offline_server`: the simulator's offline evaluation as a ``ServerUnderTest``; the product's ``TrialExecutor`` on it.
- :mod:`tests.support.sglang_http`: canned SGLang HTTP answers on a loopback port.
- :mod:`tests.support.chromium`: headless Chromium on a report page: its DOM, a screenshot, its drawn labels' boxes.
- :mod:`tests.support.sse_server`: a small SGLang-shaped SSE server (run as a subprocess).
"""
