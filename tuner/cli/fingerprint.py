"""``tuner fingerprints`` (what each storage knows of each deployment's memory) and ``tuner upgrade-check``."""

from __future__ import annotations

import datetime
from typing import Annotated

import typer

from tuner.cli.common import ConfigOpt, JsonOpt, StorageOpt, StudyOpt, app, non_empty_text, open_stored_study


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
    python: Annotated[str | None, typer.Option("--python", parser=non_empty_text, help="The other SGLang installation's Python (its flag table is read from SGLang's own parser).")] = None,
    version: Annotated[str | None, typer.Option("--version", parser=non_empty_text, help="Another SGLang version, from the bundled flag tables (the simulator stands in for it).")] = None,
    study: StudyOpt = None,
    storage: StorageOpt = None,
    boot: Annotated[bool, typer.Option("--boot", help="Consent: start the best flags once on the new version (the unit's lock, restored afterwards, as a trial); needs --config.")] = False,
    window: Annotated[str | None, typer.Option("--window", parser=non_empty_text, help="Only boot inside this local-time window, HH:MM-HH:MM (e.g. 02:00-04:00).")] = None,
    load: Annotated[bool, typer.Option("--load", help="With --boot: one short load after the boot probe ([budget] phases).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Report the flags of the study's best config that another SGLang installation renamed,
    removed, deprecated or changed the default of, beside the deployment's fingerprint. With
    --boot, start those flags once on the new version and print capacity, free memory after
    graphs and the draft's share beside the fingerprint; the service is restored. Nothing is stored."""
    from tuner.config import load_config
    from tuner.errors import ConfigError
    from tuner.report import tables
    from tuner.sglang.flags import FlagTable, check_bundled_series
    from tuner.upgrade import boot as boot_new
    from tuner.upgrade import in_window, plan_upgrade

    if (python is None) == (version is None):
        raise ConfigError("upgrade-check needs exactly one of --python and --version",
                          hint="pass --python /opt/sglang-new/bin/python (or --version 0.5.23 for a bundled table)")
    if version is not None:
        check_bundled_series(version, name="--version",
                             fix="pass --python with that version's interpreter, whose SGLang parser is read instead")
    if (window is not None or load) and not boot:
        raise ConfigError("--window and --load only apply with --boot", hint="add --boot to start the new version once")
    if boot and config is None:
        raise ConfigError("--boot needs --config (the service to start)", hint="pass --config tuner.toml")
    stored = open_stored_study(study, storage, config)
    recorded = (stored.info.environment if stored.info else {}).get("sglang_version")
    old = FlagTable.for_version(str(recorded or FlagTable.bundled_versions()[0]))
    new = FlagTable.from_python(python) if python else FlagTable.for_version(str(version))
    check = plan_upgrade(stored, old, new)
    result = None
    if boot:
        assert config is not None
        if window is not None and not in_window(window, datetime.datetime.now().time()):
            raise ConfigError(f"now ({datetime.datetime.now():%H:%M}) is outside the window {window}: nothing was started",
                              hint="run it inside the window, or pass another --window")
        result = boot_new(load_config(config), stored, check, old, new, python=python, version=version, load=load)
    if as_json:
        print(tables.json_text({**check.model_dump(mode="json"), "boot": result.model_dump(mode="json") if result else None}))
    else:
        for line in check.lines() + (result.lines() if result else []):
            print(line)
