"""The HTML report: self-contained, escaped, and rendered by headless Chromium offline."""

from __future__ import annotations

import html
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import plotly.offline
import pytest
import requests

from tests.support.cli import TUNER
from tests.support.net import free_port
from tests.support.study_factory import HTML_LOG_LINE, make_study, ok_trial
from tuner.report.html import build_html_report
from tuner.results import StudyLocation, open_study

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def test_report_escapes_logs_and_inlines_plotly(demo_study: str, tmp_path: Path, tuner_cli) -> None:
    out = tmp_path / "report.html"
    proc = tuner_cli("report", "--storage", demo_study, "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    text = out.read_text(encoding="utf-8")
    assert '<script>alert("pwned")</script>' not in text
    assert html.escape(HTML_LOG_LINE) in text
    assert "&lt;script&gt;alert(&quot;pwned&quot;)&lt;/script&gt; &amp; &lt;b&gt;bold&lt;/b&gt;" in text
    assert plotly.offline.get_plotlyjs() in text  # plotly.js inlined, once
    own = text.replace(plotly.offline.get_plotlyjs(), "")
    assert "<script src" not in own and "<link" not in own and "https://" not in own
    for div in ("pareto-front", "history", "capacity-vs-mfs"):
        assert f'id="{div}"' in text, div
    assert "Parameter importance is not drawn" in text  # 5 completed trials: too few to rank parameters
    assert "failure boundary (fails above: cuda_graph_oom)" in text


def test_importance_is_guarded_on_a_small_study(tmp_path: Path) -> None:
    url = make_study(tmp_path / "small.db", "small", [ok_trial(0.8, 64, 10, 1000.0, kind="baseline")])
    text = build_html_report(open_study(StudyLocation(storage_url=url)), None, "no best")
    assert "Parameter importance is not drawn: it needs at least 10 completed trials" in text
    assert 'id="importance"' not in text


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install -y chromium)")
def test_report_renders_in_headless_chromium_offline(demo_study: str, tmp_path: Path, tuner_cli) -> None:
    out = tmp_path / "report.html"
    assert tuner_cli("report", "--storage", demo_study, "-o", str(out)).returncode == 0
    argv = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
        "--host-resolver-rules=MAP * ~NOTFOUND", "--virtual-time-budget=10000", "--dump-dom",
        out.as_uri(),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout
    # plotly drew every figure: each plot div holds rendered <svg class="main-svg"> elements
    for div in ("pareto-front", "history", "capacity-vs-mfs"):
        start = dom.index(f'id="{div}"')
        assert 'class="main-svg"' in dom[start : start + 20000], div
    assert dom.count('class="main-svg"') >= 8
    assert "&lt;script&gt;alert" in dom and "<script>alert" not in dom


def test_dashboard_serves_the_storage_and_ctrl_c_stops_it_quietly(demo_study: str) -> None:
    """`tuner dashboard` as a terminal runs it: Ctrl-C (SIGINT to its process group) stops the
    dashboard with one line, no traceback, and leaves no server behind."""
    port = free_port()
    tuner = TUNER
    proc = subprocess.Popen(
        [str(tuner), "dashboard", "--storage", demo_study, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        body = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                body = requests.get(f"http://127.0.0.1:{port}/api/studies", timeout=2).json()
                break
            except requests.RequestException:
                time.sleep(0.5)
        assert body is not None, "optuna-dashboard did not answer within 60 s"
        assert [s["study_name"] for s in body["study_summaries"]] == ["demo"]
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.terminate()  # the tuner stops its dashboard child on SIGTERM too
            proc.communicate(timeout=60)
    assert proc.returncode == 0, (out, err)
    assert out.strip().splitlines()[-1] == "dashboard stopped" and "Traceback" not in err, (out, err)
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{port}/api/studies", timeout=2)


def test_dashboard_on_a_port_in_use_is_one_line(demo_study: str) -> None:
    """A port another program listens on: one error line, exit 1, no traceback, nothing started."""
    tuner = TUNER
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = subprocess.run(
            [str(tuner), "dashboard", "--storage", demo_study, "--host", "127.0.0.1", "--port", str(port)],
            capture_output=True, text=True, timeout=120, check=False,
        )
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: --port {port} on 127.0.0.1 is already in use") and "--port" in line.split("—")[-1]
    assert "optuna-dashboard on" not in proc.stdout
