"""Debian's headless Chromium for the report tests: render a page with the network blocked and
read back its DOM (after plotly drew it), a screenshot, or the boxes of its drawn labels."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install -y chromium)")


def chromium(page: Path, profile: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """Run headless Chromium on ``page`` (name resolution blocked, 10 s of virtual time for the
    scripts) with ``extra`` flags (``--dump-dom``, ``--screenshot=FILE``, ``--window-size=W,H``)."""
    assert CHROMIUM is not None
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--no-first-run", f"--user-data-dir={profile}",
            "--host-resolver-rules=MAP * ~NOTFOUND", "--virtual-time-budget=10000", "--hide-scrollbars",
            *extra, page.as_uri()]
    return subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False)


_MEASURE = """<script>
window.addEventListener('load', () => setTimeout(() => {
  const box = e => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  const out = {};
  for (const div of document.querySelectorAll('.js-plotly-plot')) {
    out[div.id] = {
      svg: box(div.querySelector('svg.main-svg')),
      plots: [...div.querySelectorAll('.bglayer rect.bg')].map(box),
      labels: [...div.querySelectorAll('.scatterlayer .textpoint text')]
        .filter(t => t.textContent.trim()).map(t => ({text: t.textContent, box: box(t)})),
      annotations: [...div.querySelectorAll('.infolayer .annotation')]
        .filter(a => a.textContent.trim()).map(a => ({text: a.textContent, box: box(a)})),
      titles: [...div.querySelectorAll('.infolayer .gtitle')]
        .filter(t => t.textContent.trim()).map(t => ({text: t.textContent, box: box(t)})),
    };
  }
  const pre = document.createElement('pre'); pre.id = 'drawn-boxes'; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
}, 1000));
</script>"""


def drawn_boxes(page: Path, profile: Path, *, width: int = 1300) -> dict[str, Any]:
    """``{figure div id: {"svg", "plots", "labels", "annotations", "titles"}}`` as Chromium laid them
    out at ``width`` px: each box ``[left, top, right, bottom]`` in px; ``plots`` the subplots' plot
    areas, ``labels`` the points' printed texts, ``annotations`` plotly's annotations (subplot
    titles, line labels), ``titles`` the figure's title with its subtitle."""
    measured = page.with_name(page.stem + "-measured.html")
    measured.write_text(page.read_text(encoding="utf-8").replace("</body>", _MEASURE + "</body>", 1), encoding="utf-8")
    proc = chromium(measured, profile, f"--window-size={width},1000", "--dump-dom")
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = re.search(r'<pre id="drawn-boxes">(.*?)</pre>', proc.stdout, re.S)
    assert found, "the measuring script did not run"
    return json.loads(html.unescape(found.group(1)))
