"""Structural levers derived by default (issue 23): the rungs the baseline's flags, the SGLang version's
flag table and the feasibility table allow become dimensions of the space without ``[space]`` naming
them; ``[space]`` pins or excludes each; the dry run says which were derived and why the others were not."""

from __future__ import annotations

import sys
from pathlib import Path

from tuner.config import SpaceSection, TunerConfig
from tuner.entrypoints import dry_run
from tuner.sglang.flags import FlagTable
from tuner.sglang.modelconfig import load_model_config
from tuner.study.lever_space import attentions_of_log, derive_levers
from tuner.study.space import resolve_space
from tuner.trial import render_argv

KIMI = Path(__file__).resolve().parents[2] / "tuner" / "data" / "models" / "kimi-k2.5-int4"
TWIN = "RTX-PRO-6000-96GB"


def _derive(version: str, section: SpaceSection | None = None, **flags):
    return derive_levers(section or SpaceSection(), {"tp_size": 8, **flags}, version=version, gpu=TWIN,
                         model=load_model_config(KIMI))


def test_the_twin_on_0523_derives_fp8_dcp_and_dp_attention():
    choice = _derive("0.5.23")
    assert choice.of("kv_cache_dtype") == ("auto", "fp8_e4m3")
    assert choice.of("dp_size") == (1, 8, 4)
    assert choice.of("dcp_size") == (1, 8, 4)
    fp8, dcp, dp = choice.reasons
    assert fp8.startswith("fp8 KV") and "derived" in fp8 and "sglang#20479" in fp8 and "default backend here is triton" in fp8
    # the Triton MLA backend's DCP path, read in 0.5.23's triton_backend.py (issue 44); unknown before that cell
    assert "derived" in dcp and "_dcp_kv_indices" in dcp and "default backend here is triton" in dcp
    assert "derived" in dp and "deepseek_v2.py" in dp


def test_fp8_kv_is_no_rung_where_sglang_resolves_a_dsa_models_auto_kv_to_fp8():
    """DeepSeek-V3.2 (DSA) on SM100: SGLang's ``auto`` KV is fp8_e4m3 already (the ladder prices no
    fp8 rung there), so the space does not search it; on SM90 ``auto`` is bf16, so fp8 is a rung
    (the DSA cell read from SGLang's source: fp8_e4m3 decodes with flashmla_kv below SM100)."""
    dsa = load_model_config(KIMI.parent / "deepseek-v3.2")
    b200 = derive_levers(SpaceSection(), {"tp_size": 8}, version="0.5.23", gpu="B200-180GB", model=dsa)
    assert b200.of("kv_cache_dtype") is None
    assert "resolves to fp8_e4m3 for DeepSeek DSA on sm100" in b200.reasons[0]
    assert b200.of("dp_size") == (1, 8, 4)  # the other levers are still derived
    h200 = derive_levers(SpaceSection(), {"tp_size": 8}, version="0.5.23", gpu="H200-141GB", model=dsa)
    assert "resolves" not in h200.reasons[0] and h200.of("kv_cache_dtype") == ("auto", "fp8_e4m3")
    assert "flashmla_kv" in h200.reasons[0]


def test_the_twin_on_055_has_no_fp8_path_and_no_dcp_flag():
    choice = _derive("0.5.5")
    assert choice.of("kv_cache_dtype") is None and choice.of("dcp_size") is None
    assert "doesn't support quantized kv cache" in choice.reasons[0]
    assert "has no --dcp-size" in choice.reasons[1]


def test_space_pins_and_excludes_each_lever():
    pinned = _derive("0.5.23", SpaceSection(kv_cache_dtype=["auto"], exclude_levers=["dp_attention"]))
    assert pinned.of("kv_cache_dtype") is None and "pinned by [space] kv_cache_dtype" in pinned.reasons[0]
    assert pinned.of("dp_size") is None and "exclude_levers" in pinned.reasons[2]
    given = _derive("0.5.23", SpaceSection(dcp_size=[8]))
    assert given.of("dcp_size") == (1, 8) and "as [space] dcp_size lists" in given.reasons[1]


def test_a_lever_the_baseline_runs_or_an_unknown_model_is_not_derived():
    running = _derive("0.5.23", kv_cache_dtype="fp8_e4m3", enable_dp_attention=True, dp_size=8)
    assert running.of("kv_cache_dtype") is None and "runs it already" in running.reasons[0]
    assert running.of("dp_size") is None and "runs it already" in running.reasons[2]
    blind = derive_levers(SpaceSection(), {"tp_size": 8}, version="0.5.23", gpu=TWIN)
    assert (blind.of("kv_cache_dtype"), blind.of("dcp_size"), blind.of("dp_size")) == (None, None, None)
    assert all("attention type is unknown" in r for r in blind.reasons)
    # From the baseline's log alone: one KV buffer is MLA or DSA; fp8 on DSA here is unknown, so not derived.
    log = attentions_of_log({"TP0": {"kv_size_gib": 10.0}})
    assert log == ("mla", "dsa")
    assert derive_levers(SpaceSection(), {"tp_size": 8}, version="0.5.23", gpu=TWIN, log_attentions=log).of("kv_cache_dtype") is None
    assert attentions_of_log({"TP0": {"k_size_gib": 1.0, "v_size_gib": 1.0}}) == ("mha",)


def test_derived_levers_are_dimensions_and_dp_attention_renders_its_switch():
    space = resolve_space(SpaceSection(), {"mem_fraction_static": 0.88}, levers=_derive("0.5.23"))
    assert {"kv_cache_dtype", "dp_size", "dcp_size"} <= set(space.distributions())
    assert "dcp_size" not in resolve_space(SpaceSection(), {"mem_fraction_static": 0.88}, levers=_derive("0.5.5")).distributions()
    assert len(space.lever_reasons) == 3
    argv = ["python", "-m", "sglang.launch_server", "--tp-size", "8", "--mem-fraction-static", "0.88"]
    table = FlagTable.for_version("0.5.23")
    on = render_argv(argv, {"dp_size": 8, "mem_fraction_static": 0.95}, table)
    assert "--enable-dp-attention" in on and on[on.index("--dp-size") + 1] == "8"
    off = render_argv(on, {"dp_size": 1}, table)
    assert "--enable-dp-attention" not in off and "--dp-size" not in off
    old = render_argv(argv, {"dp_size": 4}, FlagTable.for_version("0.5.5"))
    assert old[old.index("--data-parallel-size") + 1] == "4"


def test_the_dry_run_says_which_rungs_were_derived_and_why_not(tmp_path: Path):
    config = TunerConfig.model_validate({
        "study": {"name": "levers-dry"}, "workload": {"kind": "random", "input_len": 1024, "output_len": 64}, "model": {"config_json": str(KIMI / "config.json")},
        "storage": {"url": f"sqlite:///{tmp_path / 's.db'}", "artifacts_dir": str(tmp_path / "a")},
        "service": {"launcher": "process", "command": [sys.executable, "-m", "tuner.sim", "--model-path", "kimi-k2.5-int4",
                                                       "--tp-size", "8", "--sim-gpu", TWIN, "--sim-version", "0.5.23"]}})
    text = dry_run(config, budget_s=None, max_trials=None)
    assert f"structural levers (GPU {TWIN}" in text
    assert "  fp8 KV (kv_cache_dtype): derived: auto, fp8_e4m3" in text
    assert "  DCP (dcp_size): derived: 1, 8, 4" in text
    assert "kv_cache_dtype: one of auto, fp8_e4m3" in text and "dp_size: one of 1, 8, 4" in text
