"""``tuner explain`` on the handed real cases and ladder pairs (issue 40): the figures of docs/explain.md.

For every ``case-NN.json`` of a cases folder (``$TUNER_CASES``, default ``tests/fixtures/cases``, the
project's copies of ``shared/cases``; point it at a held-out folder of the same format to measure
that): the log excerpt through :func:`tuner.sglang.explain.explain` exactly as the excerpt reads
(no extra evidence), and three counts: the outcome class (``started`` / ``startup_oom`` /
``runtime_oom`` / ``other_error``, or the case's ``expected_class``), the first lever's knob and
direction against the case's ``lever`` (cases whose excerpt lacks the failure or the deciding line
count as read wrong here: the strict figure), and every number under ``observed`` the excerpt
prints found in the JSON. For the ladder pairs (``$TUNER_LADDER``, default
``tests/fixtures/ladder``): the relative error of the ladder's prediction against the logged
number, per pair.

Run: ``.venv/bin/python -m pytest tests/benchmarks/bench_explain_cases.py --run-benchmarks -s``
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tuner.knobs import LEVERS
from tuner.sglang.explain import explain
from tuner.sglang.ladder import LadderBase, evaluate, ladder
from tuner.sglang.logs import outcome_of, parse_log
from tuner.sglang.memory import GIB, KVCapacityModel, cell_size_bytes
from tuner.sglang.modelconfig import model_arch_from_dict

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
_ALIASES = {"startup_failure_not_memory": "other_error"}


def _numbers(doc: Any) -> list[float]:
    if isinstance(doc, bool):
        return []
    if isinstance(doc, (int, float)):
        return [doc]
    if isinstance(doc, dict):
        return [n for v in doc.values() for n in _numbers(v)]
    if isinstance(doc, list):
        return [n for v in doc for n in _numbers(v)]
    return []


def _case_row(case: dict[str, Any]) -> tuple[bool, bool | None, int, int]:
    """(class right, lever right or None without a lever field, observed numbers found, observed numbers printed)."""
    e = explain(parse_log(case["log_excerpt"]), structural=LEVERS)
    want = case.get("expected_class")
    got_class = e.diagnosis.failure_class.value if e.diagnosis is not None else None
    if isinstance(want, list):
        class_ok = got_class in want or (None in want and e.diagnosis is None)
    else:
        class_ok = outcome_of(e.diagnosis) == _ALIASES.get(case["outcome"], case["outcome"])
    lever_ok = None
    if "lever" in case:
        first = (e.levers[0].knob, e.levers[0].direction) if e.levers else (None, "none")
        want_lever = (case["lever"]["knob"], case["lever"]["direction"])
        lever_ok = first == want_lever or (want_lever[1] == "none" and first[0] is None)
    shown = _numbers(e.model_dump(mode="json"))
    printed = [v for v in _numbers(case.get("observed", {})) if f"{v}" in case["log_excerpt"] or f"{v:,}" in case["log_excerpt"]]
    found = [v for v in printed if any(n == v or (isinstance(n, float) and round(n, 2) == v) for n in shown)]
    return class_ok, lever_ok, len(found), len(printed)


def _ladder_errors(folder: Path) -> dict[str, float]:
    """Relative error of the ladder against each pair's logged figure (see tests/sglang/test_ladder.py for the arithmetic)."""
    out: dict[str, float] = {}
    if (folder / "ladder-01.json").exists():  # DSA per-rank pool under DP attention: the logged token count
        case = json.loads((folder / "ladder-01.json").read_text())
        arch = case["model"]
        model = model_arch_from_dict({k: arch[k] for k in ("num_hidden_layers", "kv_lora_rank", "qk_rope_head_dim", "index_head_dim")}, name="v32")
        cell = cell_size_bytes(model, tp=8, kv_cache_dtype="fp8_e4m3", dp_attention_size=8)
        obs = case["lever"]["observed"]
        mem = KVCapacityModel(baseline_gib=180.0, static_gib=0.8 * 180.0 - obs["kv_size_gb"], cell_bytes=cell, observed_mem_fraction_static=0.8,
                              observed_tokens=obs["max_total_num_tokens"])
        base = LadderBase(levers=LEVERS, memory=mem, model=model, version="0.5.5", tp=8, dp=8, mem_fraction_static=0.8, kv_cache_dtype="fp8_e4m3",
                          page_size=64, context_len=163840, gpu="B200", flags={"enable_dp_attention": True, "kv_cache_dtype": "fp8_e4m3"})
        got = ladder(base)[0].tokens_per_rank or 0
        out["ladder-01 tokens per DP rank (DSA cell from the logged KV size)"] = got / case["expected"]["tokens_per_rank"] - 1
    if (folder / "ladder-06.json").exists():  # hybrid GDN fp8 cell: both logged K sizes
        case = json.loads((folder / "ladder-06.json").read_text())
        config = {"num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": case["model"]["num_key_value_heads"],
                  "head_dim": case["model"]["head_dim"], "full_attention_interval": 4, "torch_dtype": "bfloat16",
                  "quantization_config": {"quant_method": "modelopt", "kv_cache_quant_algo": "FP8"}}
        cell = cell_size_bytes(model_arch_from_dict(config, name="qwen-gdn"))
        for arm in ("baseline", "lever"):
            obs = case[arm]["observed"]
            out[f"ladder-06 {arm} K size (hybrid fp8 cell)"] = obs["max_total_num_tokens"] * cell / 2 / GIB / obs["k_size_gb"] - 1
    if (folder / "ladder-09.json").exists():  # one start at 0.65: the feasibility of every logged fraction
        case = json.loads((folder / "ladder-09.json").read_text())
        arch = case["model"]
        model = model_arch_from_dict({"num_hidden_layers": arch["num_hidden_layers"], "num_attention_heads": 8,
                                      "num_key_value_heads": arch["num_key_value_heads"], "head_dim": arch["head_dim"], "hidden_size": 2560}, name="g3")
        cell = cell_size_bytes(model)
        obs = case["baseline"]["observed"]
        mem = KVCapacityModel(baseline_gib=22.4, static_gib=0.65 * 22.4 - (obs["max_total_num_tokens"] + 0.5) * cell / GIB, cell_bytes=cell,
                              observed_mem_fraction_static=0.65, observed_tokens=obs["max_total_num_tokens"],
                              observed_free_after_graphs_gib=obs["avail_after_graphs_gb"])
        base = LadderBase(levers=LEVERS, memory=mem, model=model, mem_fraction_static=0.65, context_len=131072)
        wrong = sum(evaluate(base, {"mem_fraction_static": float(f)}).starts is not ok for f, ok in case["expected"]["feasible"].items())
        out["ladder-09 fractions read wrong (of 7)"] = float(wrong)
    return out


def test_explain_on_the_handed_cases_and_ladder_pairs() -> None:
    cases_dir = Path(os.environ.get("TUNER_CASES", FIXTURES / "cases"))
    rows = {p.stem: _case_row(json.loads(p.read_text())) for p in sorted(cases_dir.glob("case-*.json"))}
    classes = sum(r[0] for r in rows.values())
    levers = [r[1] for r in rows.values() if r[1] is not None]
    found, printed = sum(r[2] for r in rows.values()), sum(r[3] for r in rows.values())
    print(f"\n{cases_dir}: class {classes}/{len(rows)}, first lever {sum(levers)}/{len(levers)}, printed numbers in the JSON {found}/{printed}")
    for name, (c, lv, f, p) in rows.items():
        if not c or lv is False:
            print(f"  {name}: class {'ok' if c else 'WRONG'}, lever {'ok' if lv else 'WRONG' if lv is False else '-'}, numbers {f}/{p}")
    for name, err in _ladder_errors(Path(os.environ.get("TUNER_LADDER", FIXTURES / "ladder"))).items():
        print(f"  {name}: {err:+.4f}" if "wrong" not in name else f"  {name}: {err:.0f}")
    assert rows
