"""``tuner fingerprints`` (what each storage knows of each deployment's memory) and ``tuner upgrade-check``."""

from __future__ import annotations

from typing import Annotated

import typer

from tuner.cli.common import ConfigOpt, JsonOpt, StorageOpt, StudyOpt, app, open_stored_study


@app.command("fingerprints", short_help="What is known of each deployment's memory, per study, with the figures.")
def fingerprints_cmd(
    storage: StorageOpt = None,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Every study's memory fingerprint (default: every studies/*.db), by deployment: free memory at
    the baseline, weights, KV bytes per token, graphs, draft share, host pools, the memory model's
    error, and what each study reused from another's. An unreadable fingerprint is one line."""
    from tuner import results
    from tuner.report import tables
    from tuner.report.fingerprints import error_lines, fingerprint_rows, fingerprints_view
    from tuner.study.fingerprint import read_fingerprints
    from tuner.study.storage import list_studies, read_storage
    from tuner.study.warm import WARM_ATTR

    found = {}
    for url in results.storage_urls(storage=storage, config=config):
        warm = {s.study_name: s.user_attrs.get(WARM_ATTR) for s in list_studies(url)}
        found[url] = [(item, warm.get(item.study)) for item in read_fingerprints(read_storage(url))]
    rows = fingerprint_rows(found)
    if as_json:
        print(tables.json_text(rows))
    else:
        tables.print_fitted(fingerprints_view(rows))
        for line in error_lines(rows):
            print(line)


@app.command("upgrade-check", short_help="What another SGLang installation changes of the best config's flags.")
def upgrade_check_cmd(
    config: ConfigOpt = None,
    python: Annotated[str | None, typer.Option("--python", help="The other SGLang installation's Python (its flag table is read from SGLang's own parser).")] = None,
    version: Annotated[str | None, typer.Option("--version", help="Another SGLang version, from the bundled flag tables (the simulator stands in for it).")] = None,
    study: StudyOpt = None,
    storage: StorageOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Report the flags of the study's best config that another SGLang installation renamed,
    removed, deprecated or changed the default of, beside the deployment's fingerprint. Changes
    nothing and stores nothing."""
    from tuner.errors import ConfigError
    from tuner.report import tables
    from tuner.sglang.flags import FlagTable
    from tuner.upgrade import plan_upgrade

    if (python is None) == (version is None):
        raise ConfigError("upgrade-check needs exactly one of --python and --version",
                          hint="pass --python /opt/sglang-new/bin/python (or --version 0.5.23 for a bundled table)")
    stored = open_stored_study(study, storage, config)
    recorded = (stored.info.environment if stored.info else {}).get("sglang_version")
    old = FlagTable.for_version(str(recorded or FlagTable.bundled_versions()[0]))
    new = FlagTable.from_python(python) if python else FlagTable.for_version(str(version))
    check = plan_upgrade(stored, old, new)
    if as_json:
        print(tables.json_text(check.model_dump(mode="json")))
    else:
        for line in check.lines():
            print(line)
