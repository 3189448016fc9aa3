"""`tuner show` lists speculative decoding's accept length of each load phase, pooled and per
prompt class, as the trial record stores it (the measure phase's metrics)."""

from __future__ import annotations

from tests.support.study_factory import make_study, ok_trial


def test_show_lists_accept_length_per_class(tmp_path, tuner_cli) -> None:
    trial = ok_trial(0.85, 48, 4, 900.0, kind="baseline")
    trial["record"]["phases"][0]["metrics"].update(accept_length=2.31, accept_length_chat=2.12, accept_length_code=2.74)
    db = make_study(tmp_path / "spec.db", "spec", [trial])
    proc = tuner_cli("show", "0", "--storage", db)
    assert proc.returncode == 0, proc.stderr
    lines = {line.split("│")[1].strip(): line for line in proc.stdout.splitlines() if line.count("│") >= 2}
    assert "2.31" in lines["accept length"] and "2.12" in lines["accept length (chat)"]
    assert "2.74" in lines["accept length (code)"]
