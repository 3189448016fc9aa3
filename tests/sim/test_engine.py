"""The simulator's engine: admission, chunking, retraction, prefix reuse, host tier, runtime OOM, logs."""

from __future__ import annotations

import random
import re
from dataclasses import replace

import pytest

from tuner.sim import costmodel
from tuner.sim.clock import RealClock, VirtualClock
from tuner.sim.costmodel import CostInputs
from tuner.sim.engine import (
    WARMUP_PREFILL_TOKENS,
    Engine,
    EngineSpec,
    FinishEvent,
    RequestRejected,
    SimRequest,
    SimRuntimeOOM,
    TokenEvent,
)
from tuner.sim.gpus import get_gpu
from tuner.sim.models import load_model, weight_bytes_per_gpu

GIB = 1 << 30


def make_spec(**overrides) -> EngineSpec:
    """Llama-3.1-8B on one H100, with small, hand-picked scheduler limits."""
    model = load_model("llama-3.1-8b")
    cell = 2 * model.num_kv_heads * model.head_dim * model.num_layers * 2
    cost = CostInputs.from_specs(
        model, get_gpu("H100-80GB"), tp_size=1, kv_cell_bytes=cell, weight_bytes_per_gpu=weight_bytes_per_gpu(model, 1)
    )
    # these tests drive the scheduler with hand-picked clock readings: a request reaches it at once
    # (the request path has its own tests below)
    cost = cost.with_factors(replace(cost.factors, request_path_s=0.0, tokenize_s_per_token=0.0))
    base = dict(
        max_total_num_tokens=50_000, max_running_requests=64, chunked_prefill_size=8192, max_prefill_tokens=16384,
        page_size=1, schedule_policy="fcfs", schedule_conservativeness=1.0, enable_mixed_chunk=False,
        cuda_graph_max_bs=256, disable_radix_cache=False, context_len=131072, hicache_host_tokens=None,
        hicache_write_policy="write_through", activation_headroom_bytes=8 * GIB, cost=cost,
    )
    base.update(overrides)
    return EngineSpec(**base)


def ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, 120_000) for _ in range(n)]


def run(engine: Engine) -> list[tuple[float, object]]:
    """Run to idle on a virtual clock; events with their times."""
    return engine.run_until_idle(VirtualClock(), timeout_s=1e6)


def finishes(events) -> dict[str, FinishEvent]:
    return {ev.rid: ev for _, ev in events if isinstance(ev, FinishEvent)}


def prefill_lines(logs: list[str]) -> list[str]:
    return [line for line in logs if line.startswith("Prefill batch")]


def field(line: str, name: str) -> int:
    return int(re.search(rf"{re.escape(name)}: (\d+)", line).group(1))


def test_max_running_requests_caps_the_batch():
    logs: list[str] = []
    e = Engine(make_spec(max_running_requests=4, decode_log_interval=1), logs.append)
    rng = random.Random(1)
    for i in range(10):
        e.add_request(SimRequest(f"r{i}", ids(100, rng), 30))
    done = finishes(run(e))
    assert len(done) == 10 and all(f.completion_tokens == 30 for f in done.values())
    decode = [line for line in logs if line.startswith("Decode batch")]
    assert decode and max(field(line, "#running-req") for line in decode) == 4
    assert field(prefill_lines(logs)[0], "#new-seq") == 4


def test_max_prefill_tokens_budget_but_first_request_always_admitted():
    logs: list[str] = []
    e = Engine(make_spec(chunked_prefill_size=None, max_prefill_tokens=1000), logs.append)
    rng = random.Random(2)
    e.add_request(SimRequest("big", ids(3000, rng), 4))  # larger than the budget: admitted alone
    for i in range(3):
        e.add_request(SimRequest(f"r{i}", ids(600, rng), 4))
    run(e)
    lines = prefill_lines(logs)
    assert [field(line, "#new-token") for line in lines[:2]] == [3000, 600]
    assert all(field(line, "#new-seq") == 1 for line in lines)


def test_chunked_prefill_splits_a_long_input():
    logs: list[str] = []
    e = Engine(make_spec(chunked_prefill_size=2048), logs.append)
    e.add_request(SimRequest("long", ids(5000, random.Random(3)), 3))
    events = run(e)
    assert [field(line, "#new-token") for line in prefill_lines(logs)] == [2048, 2048, 904]
    first_token = next(t for t, ev in events if isinstance(ev, TokenEvent))
    step_time = costmodel.step_time_s
    assert first_token > step_time(e.spec.cost, costmodel.StepShape(2048, 1, 2048 * 2049 / 2, 2048, True))
    assert finishes(events)["long"].completion_tokens == 3


@pytest.mark.parametrize(("version", "pattern"), [
    ("0.5.5", r"^KV cache pool is full\. Retract requests\. #retracted_reqs: \d+, #new_token_ratio: \d\.\d{4} -> \d\.\d{4}$"),
    ("0.5.10", r"^KV cache pool is full\. Retract requests\. #retracted_reqs: \d+, #new_tokens_gained: \d+, "
               r"#new_token_ratio: \d\.\d{4} -> \d\.\d{4}$"),
])
def test_retraction_when_the_pool_fills_during_decode(version, pattern):
    logs: list[str] = []
    # 16 requests of 200 + 400 tokens need 9,600 cells; the pool has 4,000, but the decayed
    # new_token_ratio (0.7 × 400 reserved each) lets more in than fit.
    e = Engine(make_spec(max_total_num_tokens=4000, version=version), logs.append)
    rng = random.Random(4)
    for i in range(16):
        e.add_request(SimRequest(f"r{i}", ids(200, rng), 400))
    done = finishes(run(e))
    retract = [line for line in logs if "Retract" in line]
    assert retract, "expected at least one retraction"
    assert all(re.match(pattern, line) for line in retract)
    assert e.stats()["num_retractions_total"] >= len(retract)
    assert len(done) == 16 and all(f.completion_tokens == 400 for f in done.values())
    old, new = map(float, re.search(r"(\d\.\d{4}) -> (\d\.\d{4})", retract[0]).groups())
    assert new > old  # a retraction raises the ratio again


def test_new_token_ratio_decays_to_its_minimum_over_600_decode_steps():
    e = Engine(make_spec(schedule_conservativeness=1.0))
    assert e.new_token_ratio == pytest.approx(0.7)
    e.add_request(SimRequest("a", ids(10, random.Random(5)), 700))
    e.step(0.0)  # prefill
    for _ in range(300):
        e.step(0.0)
    assert e.new_token_ratio == pytest.approx(0.7 - 300 * (0.7 - 0.098) / 600)
    for _ in range(350):
        e.step(0.0)
    assert e.new_token_ratio == pytest.approx(0.7 * 0.14)
    run(e)  # the request finishes; an idle scheduler starts over from the initial ratio
    assert e.new_token_ratio == pytest.approx(0.7)


def _shared_prefix_workload(rng, groups=6, per_group=6, system=1024, question=64):
    reqs = []
    for _ in range(groups):
        prefix = ids(system, rng)
        reqs += [prefix + ids(question, rng) for _ in range(per_group)]
    rng.shuffle(reqs)
    return reqs


def _serial_hits(spec: EngineSpec, prompts: list[list[int]]) -> tuple[int, int]:
    """Send prompts one after another (each after the previous finished): (cached, prompt) tokens."""
    e = Engine(spec)
    cached = total = 0
    for i, p in enumerate(prompts):
        e.add_request(SimRequest(f"q{i}", p, 8))
        f = finishes(run(e))[f"q{i}"]
        cached += f.cached_tokens
        total += f.prompt_tokens
    return cached, total


def test_radix_cache_reuses_shared_prefixes_and_not_random_ones():
    rng = random.Random(6)
    prompts = _shared_prefix_workload(rng)
    cached, total = _serial_hits(make_spec(), prompts)
    designed = 6 * 5 * 1024 / (36 * 1088)  # every request but the first of its group reuses 1024
    assert cached / total == pytest.approx(designed, abs=0.02)
    random_prompts = [ids(1088, rng) for _ in range(20)]
    cached_r, total_r = _serial_hits(make_spec(), random_prompts)
    assert cached_r / total_r < 0.01
    cached_off, _ = _serial_hits(make_spec(disable_radix_cache=True), prompts)
    assert cached_off == 0


def test_page_size_limits_hits_to_whole_pages():
    rng = random.Random(7)
    prefix = ids(1000, rng)
    cached, _ = _serial_hits(make_spec(page_size=64), [prefix + ids(50, rng), prefix + ids(50, rng)])
    assert cached == 960  # 1000 shared tokens: 15 whole pages of 64


def _host_tier_scenario(warm: int = 1, warm_new_tokens: int = 4, **overrides) -> tuple[FinishEvent, dict]:
    """Prefix A cached (by ``warm`` requests), evicted from a small device pool by other traffic,
    then asked again."""
    rng = random.Random(8)
    spec = make_spec(max_total_num_tokens=6000, **overrides)
    e = Engine(spec)
    a = ids(2000, rng)
    for i in range(warm):
        e.add_request(SimRequest(f"a1-{i}", a + ids(20, rng), warm_new_tokens))
        run(e)
    for i in range(6):  # 6 × 2,040 tokens of unrelated prompts push A out of the device pool
        e.add_request(SimRequest(f"x{i}", ids(2040, rng), 4))
        run(e)
    e.add_request(SimRequest("a2", a + ids(20, rng), 4))
    return finishes(run(e))["a2"], e.stats()


def test_host_tier_loads_evicted_prefixes_back():
    hit, stats = _host_tier_scenario(hicache_host_tokens=40_000, hicache_write_policy="write_through")
    assert hit.cached_tokens_details == {"device": 0, "host": 2000}
    assert hit.cached_tokens == 2000
    assert stats["load_back_tokens_total"] == 2000
    assert stats["evicted_tokens_total"] > 0


def test_without_host_tier_the_evicted_prefix_is_recomputed():
    miss, stats = _host_tier_scenario()
    assert miss.cached_tokens == 0 and miss.cached_tokens_details is None
    assert stats["load_back_tokens_total"] == 0


def test_write_back_copies_on_eviction_and_selective_needs_two_hits():
    hit, _ = _host_tier_scenario(hicache_host_tokens=40_000, hicache_write_policy="write_back")
    assert hit.cached_tokens_details["host"] == 2000
    selective = dict(hicache_host_tokens=40_000, hicache_write_policy="write_through_selective")
    # a one-token request inserts its prompt once (1 hit): never backed up, gone after eviction
    miss, _ = _host_tier_scenario(warm_new_tokens=1, **selective)
    assert miss.cached_tokens == 0
    # two of them give the prompt its second hit: backed up, so found on the host
    hit2, _ = _host_tier_scenario(warm=2, warm_new_tokens=1, **selective)
    assert hit2.cached_tokens_details == {"device": 0, "host": 2000}
    # write_through backs up on the first hit already
    hit1, _ = _host_tier_scenario(warm_new_tokens=1, hicache_host_tokens=40_000)
    assert hit1.cached_tokens_details["host"] == 2000


def test_load_back_costs_pcie_time_but_less_than_recomputing():
    rng = random.Random(9)
    a = ids(4000, rng)
    others = [ids(4000, rng) for _ in range(4)]

    def final_prefill(**kw) -> tuple[float, dict]:
        e = Engine(make_spec(max_total_num_tokens=9000, **kw))
        e.add_request(SimRequest("a1", a + [11], 2))
        run(e)
        for i, o in enumerate(others):
            e.add_request(SimRequest(f"x{i}", o, 2))
            run(e)
        e.add_request(SimRequest("a2", a + [12], 2))
        return e.step(0.0).duration_s, e.stats()

    t_host, stats = final_prefill(hicache_host_tokens=100_000)
    t_recompute, _ = final_prefill()
    assert stats["load_back_tokens_total"] == 4000
    assert costmodel.load_back_s(make_spec().cost, 4000) <= t_host < t_recompute


def test_runtime_oom_is_monotone_in_chunk_size():
    spec = make_spec(activation_headroom_bytes=1 * GIB)
    per_chunk = {c: costmodel.activation_bytes(spec.cost, c, 1) for c in (1024, 2048, 4096, 8192, 16384)}
    outcomes = {}
    for chunk in per_chunk:
        e = Engine(replace(spec, chunked_prefill_size=chunk))
        e.add_request(SimRequest("long", ids(20_000, random.Random(10)), 4))
        try:
            run(e)
            outcomes[chunk] = False
        except SimRuntimeOOM as oom:
            outcomes[chunk] = True
            assert oom.message.startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate ")
            assert "GPU 0 has a total capacity of" in oom.message
    assert outcomes == {c: b > 1 * GIB for c, b in per_chunk.items()}
    assert outcomes[1024] is False and outcomes[16384] is True
    flags = [outcomes[c] for c in sorted(outcomes)]
    assert flags == sorted(flags)  # once it fails, every larger chunk fails


def test_max_prefill_tokens_governs_activations_when_chunking_is_off():
    spec = make_spec(activation_headroom_bytes=1 * GIB, chunked_prefill_size=None, max_prefill_tokens=16384)
    e = Engine(spec)
    rng = random.Random(11)
    for i in range(8):
        e.add_request(SimRequest(f"r{i}", ids(2000, rng), 2))
    with pytest.raises(SimRuntimeOOM):
        run(e)
    small = Engine(replace(spec, max_prefill_tokens=2048))
    for i in range(8):
        small.add_request(SimRequest(f"r{i}", ids(2000, rng), 2))
    assert len(finishes(run(small))) == 8


def test_log_line_formats_by_version():
    rng = random.Random(12)
    prompts = [ids(300, rng) for _ in range(3)]
    for version in ("0.5.5", "0.5.23"):
        logs: list[str] = []
        e = Engine(make_spec(version=version), logs.append)
        for i, p in enumerate(prompts):
            e.add_request(SimRequest(f"r{i}", p, 81))
        run(e)
        pre, dec = prefill_lines(logs), [line for line in logs if line.startswith("Decode batch")]
        assert len(dec) == 2  # 80 decode steps, one line every 40
        if version == "0.5.5":
            assert re.fullmatch(
                r"Prefill batch, #new-seq: 3, #new-token: 900, #cached-token: 0, token usage: 0\.00, "
                r"#running-req: 0, #queue-req: 0, ", pre[0])
            assert re.fullmatch(
                r"Decode batch, #running-req: 3, #token: \d+, token usage: \d\.\d\d, cuda graph: True, "
                r"gen throughput \(token/s\): \d+\.\d\d, #queue-req: 0, ", dec[0])
        else:
            assert re.fullmatch(r"Prefill batch, .*#queue-req: 0, #pending-token: 0, cuda graph: False, "
                                r"input throughput \(token/s\): \d+\.\d\d", pre[0])
            assert dec[0].endswith("#queue-req: 0")


def test_lpm_serves_the_cached_prefix_first_and_fcfs_keeps_order():
    rng = random.Random(13)
    prefix = ids(1500, rng)
    other = ids(1500, rng)
    for policy, first_cached in (("lpm", True), ("fcfs", False)):
        logs: list[str] = []
        e = Engine(make_spec(schedule_policy=policy, max_running_requests=1), logs.append)
        e.add_request(SimRequest("warm", prefix + [7], 2))
        run(e)
        logs.clear()
        e.add_request(SimRequest("x", other, 2))
        e.add_request(SimRequest("y", prefix + [9], 2))
        run(e)
        assert (field(prefill_lines(logs)[0], "#cached-token") > 0) is first_cached


def test_mixed_chunk_decodes_during_prefill():
    rng = random.Random(14)
    for mixed in (False, True):
        e = Engine(make_spec(enable_mixed_chunk=mixed, chunked_prefill_size=1024))
        e.add_request(SimRequest("running", ids(100, rng), 50))
        e.step(0.0)
        e.add_request(SimRequest("long", ids(4000, rng), 2))
        r = e.step(0.0)  # a prefill chunk of "long"
        got = [ev.rid for ev in r.events if isinstance(ev, TokenEvent)]
        assert (got == ["running"]) is mixed


def test_rejects_too_long_inputs_and_clips_max_new_tokens():
    e = Engine(make_spec(max_total_num_tokens=1000))
    # max_req_len = min(context_len - 1, 1000 - 1) = 999; max_req_input_len = 994 (§1.4)
    with pytest.raises(RequestRejected, match=r"^Input length \(994 tokens\) exceeds the maximum allowed length \(994 tokens\)\.$"):
        e.add_request(SimRequest("a", [5] * 994, 4))
    e.add_request(SimRequest("b", [5] * 900, 500))
    f = finishes(run(e))["b"]
    assert f.completion_tokens == 998 - 900 and f.finish_reason == {"type": "length", "length": 98}


def test_a_request_that_can_never_be_admitted_is_aborted_not_left_waiting():
    """The one stall rule: waiting work, nothing running, nothing admitted -> abort the head (§1.4).

    A chunk smaller than a page never admits anything (SGLang's args forbid it; the engine is
    built directly here to reach the state)."""
    e = Engine(make_spec(max_total_num_tokens=6400, page_size=64, chunked_prefill_size=32))
    rng = random.Random(14)
    e.add_request(SimRequest("a", ids(100, rng), 50))
    e.add_request(SimRequest("b", ids(3000, rng), 5000))
    first = e.step(0.0)  # nothing runs: the head is aborted at once, with no forward time
    assert first.duration_s == 0.0 and [ev.rid for ev in first.events] == ["a"]
    events = finishes(run(e))  # ends on a virtual clock (no busy wait, no TimeoutError)
    assert set(events) == {"b"} and not e.has_work()
    reason = events["b"].finish_reason
    assert reason == {"type": "abort", "status_code": 400, "err_type": "BadRequestError",  # no chunk holds a page
                      "message": "Input length (3000 tokens) exceeds the maximum allowed length (0 tokens)."}
    assert events["b"].abort_message == reason["message"] and events["b"].completion_tokens == 0
    s = e.stats()
    assert s["num_aborted_requests_total"] == 2 and s["num_requests_total"] == 0 and s["num_used_tokens"] == 0
    assert first.events[0].abort_message.startswith("Input length (100 tokens)")


def test_no_valid_setting_stalls_the_engine():
    """Random small pools, pages, chunks, host tiers and speculative decoding with inputs of every
    length: every request finishes or is rejected up front; none is aborted as unschedulable."""
    rng = random.Random(21)
    spec0 = make_spec()
    for trial in range(100):
        page = rng.choice([1, 16, 64])
        total = rng.choice([128, 1000, 4096]) // page * page
        cost = spec0.cost
        if trial % 4 == 0:
            cost = replace(cost, spec_num_steps=3, spec_num_draft_tokens=4, spec_accept_length=2.5)
        spec = make_spec(
            max_total_num_tokens=total, page_size=page, chunked_prefill_size=rng.choice([None, 64, 128, 8192]),
            max_prefill_tokens=rng.choice([16, 16384]), enable_mixed_chunk=rng.random() < 0.3,
            schedule_conservativeness=rng.choice([0.3, 1.0, 2.0]), context_len=rng.choice([131072, 200]),
            max_running_requests=rng.choice([1, 4, 64]), hicache_host_tokens=rng.choice([None, 2 * total]),
            schedule_policy=rng.choice(["fcfs", "lpm"]), cost=cost)
        e = Engine(spec)
        for i in range(rng.randint(1, 12)):
            try:
                e.add_request(SimRequest(f"r{i}", ids(rng.randint(1, total + 10), rng), rng.choice([1, 100, 5000]),
                                         ignore_eos=rng.random() < 0.5))
            except RequestRejected:
                pass
        try:
            run(e)
        except RuntimeError as err:  # a decode step that cannot fit one token each kills the scheduler (§4.4)
            assert str(err).startswith("Decode out of memory"), err
            continue
        assert e.stats()["num_aborted_requests_total"] == 0, spec


def test_peak_activation_bytes_is_the_largest_step_since_start():
    spec = make_spec(chunked_prefill_size=4096)
    e = Engine(spec)
    assert e.stats()["peak_activation_bytes"] == 0
    rng = random.Random(20)
    e.add_request(SimRequest("big", ids(3000, rng), 3))
    run(e)
    big = costmodel.activation_bytes(spec.cost, 3000, 1)
    assert e.stats()["peak_activation_bytes"] == big > 0
    e.add_request(SimRequest("small", ids(10, rng), 50))  # a smaller prefill and graph decode add nothing
    run(e)
    assert e.stats()["peak_activation_bytes"] == big
    e.add_request(SimRequest("huge", ids(9000, rng), 1))  # chunked: the largest step is one 4,096-token chunk
    run(e)
    assert e.stats()["peak_activation_bytes"] == costmodel.activation_bytes(spec.cost, 4096, 1)


def test_ignore_eos_false_stops_early_with_a_stop_reason():
    e = Engine(make_spec())
    rng = random.Random(15)
    for i in range(20):
        e.add_request(SimRequest(f"r{i}", ids(50, rng), 100, ignore_eos=False))
    done = finishes(run(e)).values()
    stops = [f for f in done if f.finish_reason["type"] == "stop"]
    assert stops and all(f.completion_tokens < 100 for f in stops)
    assert all(f.finish_reason == {"type": "stop", "matched": 2} for f in stops)


def test_abort_flush_and_stats():
    e = Engine(make_spec())
    rng = random.Random(16)
    p = ids(500, rng)
    e.add_request(SimRequest("a", p, 10))
    e.add_request(SimRequest("b", ids(500, rng), 10))
    assert e.flush_cache() is False
    assert e.abort("b") is True and e.abort("nope") is False
    run(e)
    s = e.stats()
    assert s["num_requests_total"] == 1 and s["generation_tokens_total"] == 10 and s["num_running_reqs"] == 0
    assert e.flush_cache() is True
    assert _serial_hits_on(e, p) == 0


def _serial_hits_on(e: Engine, prompt: list[int]) -> int:
    e.add_request(SimRequest("again", prompt, 2))
    return finishes(run(e))["again"].cached_tokens


def test_real_and_virtual_clocks_give_the_same_run():
    rng = random.Random(17)
    prompts = [ids(200, rng) for _ in range(3)]

    def drive(clock):
        e = Engine(make_spec())
        for i, p in enumerate(prompts):
            e.add_request(SimRequest(f"r{i}", p, 6))
        start = clock.now_s()
        return [(t - start, ev) for t, ev in e.run_until_idle(clock, timeout_s=30)]

    virtual = drive(VirtualClock(100.0))
    real = drive(RealClock())
    assert [ev for _, ev in virtual] == [ev for _, ev in real]
    # a real sleep lasts at least as long as asked, so every event is no earlier than on virtual time
    assert all(tr >= tv - 1e-9 for (tv, _), (tr, _) in zip(virtual, real, strict=True))


@pytest.mark.parametrize("overrides", [
    dict(page_size=64),
    dict(page_size=16, hicache_host_tokens=30_000, hicache_write_policy="write_back"),
    dict(hicache_host_tokens=20_000, hicache_write_policy="write_through_selective", enable_mixed_chunk=True),
    dict(chunked_prefill_size=None, schedule_policy="lpm", disable_radix_cache=False),
    dict(disable_radix_cache=True, chunked_prefill_size=512),
])
def test_pool_accounting_stays_consistent(overrides):
    """Mixed traffic (shared prefixes, long inputs, retractions) never over-commits the pool and
    leaves every cell free or evictable at the end."""
    spec = make_spec(max_total_num_tokens=12_000, max_running_requests=24, **overrides)
    e = Engine(spec)
    rng = random.Random(18)
    systems = [ids(700, rng) for _ in range(4)]
    for i in range(60):
        prompt = rng.choice(systems) + ids(rng.randint(10, 400), rng) if i % 2 else ids(rng.randint(50, 2500), rng)
        e.add_request(SimRequest(f"r{i}", prompt, rng.randint(1, 300), ignore_eos=bool(i % 3)))
    done = 0
    for _ in range(50_000):
        if not e.has_work():
            break
        done += sum(isinstance(ev, FinishEvent) for ev in e.step(0.0).events)
        s = e.stats()
        assert 0 <= s["num_used_tokens"] <= spec.max_total_num_tokens
        assert e.cache.device_tokens + e._private_total <= spec.max_total_num_tokens
        assert s["hicache_host_used_tokens"] <= (spec.hicache_host_tokens or 0)
    assert done == 60
    s = e.stats()
    assert s["num_used_tokens"] == 0 and e._private_total == 0
    assert e.cache.evictable_tokens == e.cache.device_tokens


def test_speculative_decoding_yields_accept_length_tokens_per_step():
    spec = make_spec(decode_log_interval=10)
    spec = replace(spec, cost=replace(spec.cost, spec_num_steps=3, spec_num_draft_tokens=4, spec_accept_length=2.5))
    logs: list[str] = []
    e = Engine(spec, logs.append)
    e.add_request(SimRequest("s", ids(100, random.Random(19)), 201))
    e.step(0.0)  # prefill: the first token
    steps = 0
    while e.has_work() and steps < 1000:
        e.step(0.0)
        steps += 1
    assert steps == pytest.approx(200 / 2.5, abs=1)
    line = next(line for line in logs if line.startswith("Decode batch"))
    assert "accept len: 2.50, accept rate: 0.62, cuda graph: True" in line


def test_decode_replays_the_next_captured_size_and_runs_eagerly_above_the_largest():
    """SGLang's can_run / replay_prepare (§2.1): padded up to the next captured size; above the
    largest captured size, or between sizes with padding off, eagerly (``cuda graph: False``)."""
    from tuner.sim.engine import graph_batch

    spec = make_spec(cuda_graph_max_bs=32, capture_bs=(1, 2, 4, 8, 12, 16, 24, 32))
    assert [graph_batch(spec, b) for b in (1, 3, 9, 17, 24, 25, 32, 33)] == [1, 4, 12, 24, 24, 32, 32, None]
    unpadded = replace(spec, cuda_graph_padding=False)
    assert [graph_batch(unpadded, b) for b in (8, 9, 33)] == [8, None, None]
    c = spec.cost
    padded = costmodel.decode_step_s(c, 17, 17 * 1000, eager=False, padded_bs=24)
    exact = costmodel.decode_step_s(c, 17, 17 * 1000, eager=False)
    eager = costmodel.decode_step_s(c, 33, 33 * 1000, eager=True)
    assert exact <= padded < eager

    def itl(cap: tuple[int, ...], mrr: int) -> list[str]:
        logs: list[str] = []
        e = Engine(make_spec(max_running_requests=mrr, cuda_graph_max_bs=max(cap), capture_bs=cap,
                             decode_log_interval=1), logs.append)
        rng = random.Random(2)
        for i in range(mrr):
            e.add_request(SimRequest(f"r{i}", ids(50, rng), 20))
        run(e)
        return [line for line in logs if line.startswith("Decode batch")]

    assert all("cuda graph: True" in line for line in itl((1, 2, 4, 8, 12, 16, 24, 31), 31))
    assert any("cuda graph: False" in line for line in itl((1, 2, 4, 8, 12, 16, 24), 31))


def test_request_path_delays_the_first_token_by_its_fixed_cost_and_tokenization():
    base = make_spec()
    f = replace(base.cost.factors, request_path_s=0.05, tokenize_s_per_token=1e-5)
    slow = make_spec(cost=base.cost.with_factors(f))
    firsts = []
    for spec in (base, slow):
        engine = Engine(spec)
        engine.add_request(SimRequest("a", ids(1000, random.Random(3)), 4, arrival_s=0.0, text=True))
        events = run(engine)
        firsts.append(next(t for t, ev in events if isinstance(ev, TokenEvent)))
    # the text request reaches the scheduler 50 ms + 1,000 x 10 us later; the GPU steps are the same
    assert firsts[1] - firsts[0] == pytest.approx(0.06, abs=1e-9)


def test_the_tokenizer_manager_tokenizes_one_text_request_at_a_time_and_skips_token_ids():
    base = make_spec()
    spec = make_spec(cost=base.cost.with_factors(replace(base.cost.factors, tokenize_s_per_token=1e-4, cold_prefill_s=0.0)))
    rng = random.Random(4)
    engine = Engine(spec)
    engine.add_request(SimRequest("t1", ids(1000, rng), 2, arrival_s=0.0, text=True))
    engine.add_request(SimRequest("t2", ids(1000, rng), 2, arrival_s=0.0, text=True))
    engine.add_request(SimRequest("ids", ids(1000, rng), 2, arrival_s=0.0))
    clock = VirtualClock()
    admitted: dict[str, float] = {}
    while engine.has_work():
        now = clock.now_s()
        result = engine.step(now)
        for ev in result.events:
            if isinstance(ev, TokenEvent) and ev.rid not in admitted:
                admitted[ev.rid] = now  # the prefill step that gave its first token started here
        clock.sleep(result.duration_s)
    assert admitted["ids"] == 0.0  # token ids go straight to the scheduler
    assert admitted["t1"] == pytest.approx(0.1)  # 1,000 tokens x 100 us
    assert admitted["t2"] >= 0.2 - 1e-9  # behind t1 in the tokenizer


def test_scheduler_recv_interval_takes_new_requests_in_every_n_decode_steps():
    """SGLang's SchedulerRecvSkipper (0.5.5): during decode, requests are received when the count of
    decode steps since the last intake reaches --scheduler-recv-interval."""
    def admitted_after(interval: int) -> int:
        engine = Engine(make_spec(scheduler_recv_interval=interval))
        rng = random.Random(5)
        engine.add_request(SimRequest("long", ids(64, rng), 200, arrival_s=0.0))
        clock = VirtualClock()
        steps = 0  # step 0 prefills "long", then it decodes
        while True:
            now = clock.now_s()
            if steps == 2:  # a request arrives while the first one decodes
                engine.add_request(SimRequest("new", ids(64, rng), 4, arrival_s=now))
            before = engine.stats()["num_running_reqs"]
            result = engine.step(now)
            clock.sleep(result.duration_s)
            if engine.stats()["num_running_reqs"] > before and steps >= 2:
                return steps - 2
            steps += 1
    assert admitted_after(1) == 0  # the next step takes it in (the default)
    # the prefill (weight 1000) makes step 1 take requests in and reset the counter; steps 1.. are
    # decode steps (weight 1 each), so the next intake is step 9: the request that arrived before
    # step 2 waits 7 steps
    assert admitted_after(8) == 7


def test_the_overlap_scheduler_schedules_a_request_that_arrives_mid_step_one_batch_later():
    """SGLang's event_loop_overlap chooses the next batch while the GPU runs the current one: a
    request arriving during a decode step misses the next batch too (0.5.5 scheduler.py)."""
    def prefill_step(overlap: bool) -> int:
        engine = Engine(make_spec(overlap_schedule=overlap))
        rng = random.Random(7)
        engine.add_request(SimRequest("long", ids(64, rng), 50, arrival_s=0.0))
        clock = VirtualClock()
        for step in range(20):
            now = clock.now_s()
            if step == 3:  # while "long" decodes (steps 1..)
                engine.add_request(SimRequest("new", ids(64, rng), 4, arrival_s=now))
            before = engine.stats()["num_running_reqs"]
            clock.sleep(engine.step(now).duration_s)
            if step >= 3 and engine.stats()["num_running_reqs"] > before:
                return step
        raise AssertionError("never admitted")
    assert prefill_step(False) == 3
    assert prefill_step(True) == 4


def test_the_first_real_prefill_batch_of_a_fresh_server_pays_the_cold_cost_once():
    """A fresh server's first prefill batch longer than SGLang's start-up warm-up costs
    ``cold_prefill_s`` more, once: the warm-up (8 tokens) and health checks leave it cold, so a
    served simulator and the offline evaluation see the same first real batch."""
    base = make_spec()
    spec = make_spec(cost=base.cost.with_factors(replace(base.cost.factors, cold_prefill_s=0.5)))
    rng = random.Random(7)

    def prefill_s(engine: Engine, rid: str, n: int) -> float:
        engine.add_request(SimRequest(rid, ids(n, rng), 1, arrival_s=0.0))
        result = engine.step(0.0)
        while engine.has_work():
            engine.step(0.0)
        return result.duration_s

    never_cold = make_spec(cost=base.cost.with_factors(replace(base.cost.factors, cold_prefill_s=0.0)))
    fresh, ref = Engine(spec), Engine(never_cold)
    assert prefill_s(fresh, "warmup", WARMUP_PREFILL_TOKENS) == pytest.approx(prefill_s(ref, "warmup", WARMUP_PREFILL_TOKENS))
    first, second = prefill_s(fresh, "a", 1000), prefill_s(fresh, "b", 1000)
    assert first == pytest.approx(second + 0.5, rel=0.01)
    assert second == pytest.approx(prefill_s(ref, "a", 1000), rel=0.01)


def test_dp_attention_decode_replays_the_graph_of_its_busiest_rank():
    """Under DP attention a decode step replays the CUDA graph of the busiest rank's batch
    (0.5.5 ``cuda_graph_runner.py`` ``can_run``: ``max(global_num_tokens_cpu)``): 256 requests over
    8 ranks are 32 a rank, inside 64-wide graphs, where the whole batch is not."""
    base = make_spec()
    logs: list[str] = []
    spec = make_spec(max_running_requests=256, cuda_graph_max_bs=64, decode_log_interval=1, max_total_num_tokens=200_000,
                     cost=base.cost.with_parallel(dp_size=8))
    e = Engine(spec, logs.append)
    rng = random.Random(3)
    for i in range(256):
        e.add_request(SimRequest(f"r{i}", ids(32, rng), 12))
    run(e)
    full = [line for line in logs if line.startswith("Decode batch, #running-req: 256,")]
    assert full and all("cuda graph: True" in line for line in full)
