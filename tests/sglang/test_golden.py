"""Golden lines rendered from SGLang's own format strings (tests/fixtures/sglang-formats), per version.

1. The parser reads every golden line: each is recognised, and every number rendered into it is
   in the report (the ``logged`` block, the scheduler line, the settings).
2. The simulator, started as a real process in each version it mimics, prints only lines whose
   shape SGLang's source of that version has: each of its lines that names a known line kind
   matches one of that version's templates, so the simulator cannot hide a parser gap.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.sim import spawn, wait_ready
from tuner.sglang.logs import clean_line, parse_log

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sglang-formats"
FORMATS = Path(__file__).resolve().parents[2] / "tuner" / "data" / "log-formats.json"
VERSIONS = ["0.5.5.post3", "0.5.10", "0.5.23"]
SIM_VERSION = {"0.5.5.post3": "0.5.5", "0.5.10": "0.5.10", "0.5.23": "0.5.23"}


def _module(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"sglang_formats_{name}", FIXTURES / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


render = _module("render")
extract = _module("extract")
_NUM = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w.]*\w)")

# Formats that are continuation lines of another message (parsed with it) or carry no number
# the parser has a use for; they must still be recognised when they are a failure.
_CONTINUATION = {"alloc_avail", "alloc_avail_swa"}
_NO_NUMBERS_NEEDED = {"ready", "graph_failed", "unbalanced", "not_enough", "mrr_spec", "dist_begin", "kv_dtype"}


def _report_numbers(report: Any) -> set[float]:
    out: set[float] = set()
    for lines in report.logged.values():
        for ln in lines:
            for v in ln.values.values():
                vals = v.value if isinstance(v.value, list) else [v.value]
                out.update(float(x) for x in vals)
    for v in report.server_args.values():
        try:
            out.add(float(v))
        except ValueError:
            pass
    return out


def test_formats_come_from_each_version() -> None:
    doc = json.loads(FORMATS.read_text())
    ids = {v: {r["id"] for r in doc["formats"] if r["version"] == v} for v in VERSIONS}
    for v in VERSIONS:
        assert {"load_begin", "load_end", "kv_alloc", "pool_end", "cap_begin", "cap_end", "scheduler", "retract", "alloc_oom",
                "req_slots", "not_enough", "mtt_larger", "server_args", "ready"} <= ids[v], v
    assert "dist_end" in ids["0.5.5.post3"] and "baseline" in ids["0.5.23"] and "dist_end" not in ids["0.5.23"]
    assert all(r["file"].startswith("sglang/srt/") and r["line"] > 0 for r in doc["formats"])


@pytest.mark.parametrize("version", VERSIONS)
def test_golden_file_is_what_render_writes(version: str) -> None:
    """The checked-in golden file is reproducible from the checked-in formats."""
    expected = []
    for rec, rendered in render.golden(version):
        expected.append(f"# {rec['id']} {rec['file']}:{rec['line']}")
        expected += [render.PREFIX + ln for ln in rendered]
    assert (FIXTURES / f"golden-{version}.log").read_text().splitlines() == expected


@pytest.mark.parametrize("version", VERSIONS)
def test_parser_reads_every_golden_line(version: str) -> None:
    problems = []
    for rec, rendered in render.golden(version):
        if rec["id"] in _CONTINUATION:
            continue
        report = parse_log([render.PREFIX + ln for ln in rendered])
        known = report.sglang_lines > 0 or report.failure is not None or report.soft_failure is not None or report.server_args
        if not known:
            problems.append(f"not recognised: {rec['id']} {rec['file']}:{rec['line']}: {rendered[0]}")
            continue
        if rec["id"] in _NO_NUMBERS_NEEDED:
            continue
        have = _report_numbers(report)
        wanted = {float(x) for ln in rendered for x in _NUM.findall(ln) if not ln.startswith("Possible")}
        if missing := wanted - have:
            problems.append(f"numbers not read {sorted(missing)}: {rec['id']} {rec['file']}:{rec['line']}: {' | '.join(rendered)}")
    assert not problems, "\n".join(problems)


def test_golden_semantics() -> None:
    """The numbers land in the right fields, in every version's wording."""
    for version in VERSIONS:
        blocks = {rec["id"]: rendered for rec, rendered in render.golden(version)}
        line = blocks["load_end"][0]
        r = parse_log([render.PREFIX + line])
        rank = r.ranks["TP0"]
        avail, usage = (float(re.search(k + r"=([\d.]+)", line).group(1)) for k in ("avail mem", "mem usage"))  # type: ignore[union-attr]
        assert rank.weight_end_avail_gib == avail and rank.weight_gib == usage, version
        r = parse_log([render.PREFIX + ln for ln in blocks["scheduler"]])
        assert r.scheduler is not None and r.scheduler.max_total_num_tokens == 1017 and r.scheduler.context_len == 1085, version
        r = parse_log([render.PREFIX + ln for ln in blocks["server_args"]])
        assert r.server_args["mem_fraction_static"] == "0.85" and r.server_args["max_running_requests"] == "64", version
        r = parse_log([render.PREFIX + ln for ln in blocks["alloc_oom"]])
        assert r.failure is not None and r.failure.failure_class.value == "kv_page_shortfall", version
        assert r.kv_shortfall is not None and r.kv_shortfall.requested_tokens == 1017 and r.kv_shortfall.available_size == 2048
    r = parse_log([render.PREFIX + ln for rec, rendered in render.golden("0.5.23") if rec["id"] == "load_end" for ln in rendered])
    assert r.ranks["TP0"].weight_dtype == "compressed-tensors"


def _field_pattern(inner: str) -> str:
    """A field's regex: a number for numeric specs, a list, or text without a field separator;
    anything for conditional fields (``{quant_str + ', ' if quant_str else ''}``) and the settings echo."""
    expr, _, spec = inner.rpartition(":") if render._SPEC.match(inner.rsplit(":", 1)[-1]) and ":" in inner else (inner, "", "")
    if spec.endswith(("f", "d")):
        return r"-?\d+(?:\.\d+)?"
    if "_server_args_for_logging" in inner:  # 0.5.23: resolved_dict(), a dict
        return r"\{.*\}"
    if inner.startswith("server_args!r"):  # 0.5.5/0.5.10: f"{server_args=}", the dataclass repr
        return r"ServerArgs\(.*\)"
    if " if " in inner:
        return ".*?"
    return r"(?:\[[^\]]*\]|[^,\[]*?)"


def _templates(version: str) -> dict[str, list[re.Pattern[str]]]:
    """Each format of ``version`` as a regex of its first line (literal text escaped)."""
    out: dict[str, list[re.Pattern[str]]] = {}
    for rec in json.loads(FORMATS.read_text())["formats"]:
        if rec["version"] != version:
            continue
        tpl = rec["template"].split("\n")[0]
        parts, last = [], 0
        for start, end, inner in render._fields(tpl):
            parts.append(re.escape(tpl[last:start].replace("{{", "{").replace("}}", "}")))
            parts.append(_field_pattern(inner))
            last = end
        parts.append(re.escape(tpl[last:].replace("{{", "{").replace("}}", "}")))
        pattern = "".join(parts)
        pattern = re.sub(r"%(?:\\\.\d+)?[df]", r"-?\\d+(?:\\.\\d+)?", pattern)
        pattern = pattern.replace("%s", r"\S+")
        tail = ".*" if rec["id"] == "retract" else r"\s*"
        out.setdefault(rec["id"], []).append(re.compile(pattern + tail + "$"))
    return out


SIM_RUNS = [
    ["--model-path", "llama-3.1-8b", "--tp", "2", "--mem-fraction-static", "0.85"],
    ["--model-path", "deepseek-v3", "--tp", "8", "--sim-gpu", "H200-141GB"],
    ["--model-path", "llama-3.1-8b", "--enable-hierarchical-cache", "--hicache-ratio", "2"],
]


@pytest.mark.parametrize("version", VERSIONS)
def test_simulator_prints_only_lines_sglang_has(version: str, tmp_path: Path) -> None:
    templates = _templates(version)
    anchors = {k: re.compile(v) for k, v in extract.ANCHORS.items()}
    problems = []
    for args in SIM_RUNS:
        sim = spawn([*args, "--sim-version", SIM_VERSION[version]], tmp_path)
        try:
            wait_ready(sim)
            log = sim.log()
        finally:
            sim.stop()
        for raw in log.splitlines():
            msg = clean_line(raw)[0]
            for key, anchor in anchors.items():
                if key in _CONTINUATION or key == "retract_details" or not anchor.search(msg):
                    continue
                if not any(p.match(msg) for p in templates.get(key, [])):
                    problems.append(f"{version} {key}: {msg[:160]}")
    assert not problems, "\n".join(dict.fromkeys(problems))
