"""The hierarchical cache's place in the space: from the workload's reuse, by version, overridable."""

from __future__ import annotations

import optuna

from tuner.config import SpaceSection
from tuner.load.workloads import MultiTurnSpec, RandomSpec, SharedPrefixSpec, build_workload, estimate_reuse
from tuner.sglang.flags import FlagTable
from tuner.sglang.hicache import GIB, HostMemory
from tuner.study.space import decide_hicache, resolve_space
from tuner.trial import render_argv

BASE = {"mem_fraction_static": 0.85, "max_running_requests": 64, "chunked_prefill_size": 4096}


def _reuse(spec):  # noqa: ANN001, ANN202
    return estimate_reuse(build_workload(spec, seed=0))


def test_decided_from_reuse_and_working_set() -> None:
    none = decide_hicache(SpaceSection(), reuse=_reuse(RandomSpec(input_len=512, output_len=8)), device_tokens=100_000)
    assert not none.include and none.reason.startswith("left out: the workload reuses 0% of its prompt tokens")
    small = _reuse(SharedPrefixSpec(num_groups=4, prompts_per_group=8, system_prompt_len=1024, question_len=64))
    fits = decide_hicache(SpaceSection(), reuse=small, device_tokens=100_000)
    assert not fits.include and "fit in half the device pool (100,000 tokens)" in fits.reason
    big = _reuse(MultiTurnSpec(num_sessions=32, turns=4, first_input_len=2048, turn_input_len=128, output_len=64))
    pays = decide_hicache(SpaceSection(), reuse=big, device_tokens=60_000)
    assert pays.include and pays.reason.startswith("in the space: the workload reuses")
    assert "exceed half the device pool (60,000 tokens)" in pays.reason
    forced = decide_hicache(SpaceSection(hierarchical_cache=True), reuse=None)
    assert forced.include and "[space] hierarchical_cache = true" in forced.reason
    off = decide_hicache(SpaceSection(hierarchical_cache=False), reuse=big, device_tokens=60_000)
    assert not off.include and "[space] hierarchical_cache = false" in off.reason


def test_knobs_follow_the_version() -> None:
    old = decide_hicache(SpaceSection(hierarchical_cache=True), reuse=None, version="0.5.5",
                         table=FlagTable.for_version("0.5.5.post3"))
    assert old.ratio == (2.0, 4.0) and old.size is None
    assert old.write_policy == ("write_through", "write_through_selective", "write_back")
    assert old.io_backend == ("kernel", "direct") and old.mem_layout == ("layer_first", "page_first")
    host = HostMemory(mem_total_bytes=256 * GIB, mem_available_bytes=240 * GIB)
    new = decide_hicache(SpaceSection(hierarchical_cache=True), reuse=None, version="0.5.23",
                         table=FlagTable.for_version("0.5.23"), host=host, ranks=4)
    # (240 - 10 - 12.8) GiB over 4 ranks = 58 GB per rank at most; a quarter of it at least.
    assert new.ratio is None and new.size == (14, 58)
    assert new.mem_layout == ("page_first",)  # 0.5.23's default is page_first already
    blind = decide_hicache(SpaceSection(hierarchical_cache=True), reuse=None, version="0.5.23",
                           table=FlagTable.for_version("0.5.23"))
    assert blind.size is None and blind.ratio == (2.0, 4.0)  # no host reading: the ratio is searched


def test_size_space_suggests_and_renders_for_0_5_23() -> None:
    table = FlagTable.for_version("0.5.23")
    host = HostMemory(mem_total_bytes=256 * GIB, mem_available_bytes=240 * GIB)
    choice = decide_hicache(SpaceSection(hierarchical_cache=True), reuse=None, version="0.5.23", table=table,
                            host=host, ranks=4)
    space = resolve_space(SpaceSection(), BASE, hicache=choice)
    assert "hicache_size" in space.distributions() and "hicache_ratio" not in space.distributions()
    on = space.hicache_on()
    assert on["hicache_size"] == 14 and on["enable_hierarchical_cache"] is True
    study = optuna.create_study(directions=["maximize", "maximize"], sampler=optuna.samplers.RandomSampler(seed=2))
    argv = ["python", "-m", "sglang.launch_server", "--model-path", "m"]
    seen = set()
    for _ in range(12):
        trial = study.ask()
        params = space.suggest(trial)
        seen.add(params["enable_hierarchical_cache"])
        rendered = render_argv(argv, params, table)
        assert ("--hicache-size" in rendered) == params["enable_hierarchical_cache"]
        assert "--hicache-ratio" not in rendered
        if params["enable_hierarchical_cache"]:
            assert 14 <= params["hicache_size"] <= 58 and "--hicache-mem-layout" in rendered
        study.tell(trial, [1.0, 1.0])
    assert seen == {True, False}
    assert space.snap({**BASE, **on, "hicache_size": 99})["hicache_size"] == 58
