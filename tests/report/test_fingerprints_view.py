"""``tuner fingerprints``' terminal view at a narrow width (operator review 2, R13: at 80-100
columns the study's name and every header broke across lines: "demo-s / im")."""

from __future__ import annotations

from rich.console import Console

from tuner.report.fingerprints import fingerprints_view


def test_a_long_study_name_and_every_figure_stay_whole_at_80_columns() -> None:
    figures = {"launches": 12, "failed": 1, "baseline_gib": 94.51, "weight_gib": 71.2, "cell_bytes": 70272,
               "tokens_per_hundredth": 12_345, "graph_gib_per_bs": {"8": 0.41, "16": 0.52}, "draft_gib": 1.93,
               "host_pool_gb_per_rank": None, "model_error_gib": 0.03}
    rows = [{"storage": "sqlite:///s.db", "study": name, "deployment": "8x H200, driver 570.1, SGLang 0.5.23, kimi",
             "figures": figures, "warm_start": None} for name in ("reference-multiturn-sim", "demo-sim")]
    console = Console(width=80, record=True, color_system=None)
    console.print(fingerprints_view(rows))
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines())
    assert "reference-multiturn-sim" in text and "demo-sim" in text
    for figure in ("12 (1 failed)", "94.51", "70272", "12,345", "0.41@8, 0.52@16"):
        assert figure in text, (figure, text)
