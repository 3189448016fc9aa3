"""``tuner fingerprints``: what each storage knows of each deployment's memory (the fingerprint)."""

from __future__ import annotations

from tuner.cli.common import ConfigOpt, JsonOpt, StorageOpt, app


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
