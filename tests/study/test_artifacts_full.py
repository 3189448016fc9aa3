"""A trial's result is stored, and the run stops in one line, when the disk holding the study's
artifact folder is full (the artifacts folder can be elsewhere than the database: ``[storage]
artifacts_dir``). Real SQLite file, real Optuna artifact store on a real tmpfs filled to the last
byte, in a private mount namespace (``unshare --mount``, as root)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

_RUN = r'''
import json, sys
from pathlib import Path
import optuna
from tuner.errors import StudyError
from tuner.records import TrialRecord
from tuner.study.decide import Proposal
from tuner.study.optuna_io import make_sampler, open_study, records
from tuner.study.record import Recorder
from tuner.study.storage import open_storage

url, folder, log = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
study = open_study("full", open_storage(url), make_sampler("random", 0))
recorder = Recorder(study, folder, "host", {})
trial = recorder.ask(Proposal(params={"mem_fraction_static": 0.8}))
record = TrialRecord(params={"mem_fraction_static": 0.8}, kind="sampled", outcome="ok", context_capacity=7,
                     feasible=True, constraints={"oom_or_crash": -1.0, "slo": -1.0, "stress": -1.0},
                     artifacts={"server_log": str(log)})
try:
    recorder.tell(trial, record)
    error = None
except StudyError as err:
    error = f"{err.message} | {err.hint}"
recorder.close()
stored = [(t.number, r.context_capacity, r.artifacts) for t, r in records(study)]
print(json.dumps({"error": error, "stored": stored}))
'''


def test_a_full_artifact_disk_stores_the_result_and_stops_in_one_line(tmp_path: Path) -> None:
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--mount", "true"]).returncode != 0:
        pytest.skip("needs unshare --mount (root) for a private tmpfs")
    folder, log = tmp_path / "artifacts", tmp_path / "server.log"
    folder.mkdir()
    log.write_text("x" * 65536)
    script = 'mount -t tmpfs -o size=64k tmpfs "$0" && { cat /dev/zero > "$0/filler" 2>/dev/null; exec "$@"; }'
    url = f"sqlite:///{tmp_path / 'full.db'}"
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, str(folder),
                           sys.executable, "-c", _RUN, url, str(folder), str(log)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["error"] is not None and str(folder) in out["error"] and "full" in out["error"], out
    assert "df -h" in out["error"] and "trial 0's result" in out["error"], out
    assert out["stored"] == [[0, 7, {}]], out  # the result, without the file that did not fit
    assert "artifacts not stored" not in proc.stderr, proc.stderr[-2000:]  # one line, from the caller
