"""Many-hosts tests: a real PostgreSQL cluster of the tests' own (:mod:`tests.postgres`)."""

from __future__ import annotations

from tests.postgres import postgres_cluster, postgres_url  # noqa: F401  (the fixtures)
