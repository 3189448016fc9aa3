"""The simulator's radix prefix cache: pages, splits, locks, LRU eviction and the host tier."""

from __future__ import annotations

import pytest

from tuner.sim.cache import PrefixCache


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_matches_whole_pages_only():
    c = PrefixCache(page_size=4)
    new, _ = c.insert(seq(0, 10))
    assert new == 8 and c.device_tokens == 8  # the 2-token tail is not a page
    assert c.match_prefix(seq(0, 10)).device_tokens == 8
    assert c.match_prefix(seq(0, 7)).device_tokens == 4
    assert c.match_prefix([0, 1, 2, 99] + seq(4, 6)).device_tokens == 0


def test_split_on_partial_match_keeps_both_branches():
    c = PrefixCache()
    c.insert(seq(0, 100))
    new, _ = c.insert(seq(0, 60) + seq(1000, 40))
    assert new == 40 and c.device_tokens == 140
    assert c.match_prefix(seq(0, 100)).device_tokens == 100
    assert c.match_prefix(seq(0, 60) + seq(1000, 40)).device_tokens == 100
    assert c.match_prefix(seq(0, 60) + [5]).device_tokens == 60


def test_lru_eviction_spares_recently_used_and_locked_nodes():
    c = PrefixCache()
    c.insert(seq(0, 100))       # A
    c.insert(seq(1000, 100))    # B
    c.insert(seq(2000, 100))    # C
    c.match_prefix(seq(0, 100))  # A is now the most recent
    locked = c.match_prefix(seq(1000, 100)).device_node
    c.lock(locked)              # B is in use
    assert c.evictable_tokens == 200
    assert c.evict(50) == 100   # whole nodes: C, the least recent unlocked one
    assert c.match_prefix(seq(2000, 100)).device_tokens == 0
    assert c.match_prefix(seq(0, 100)).device_tokens == 100
    assert c.evict(1000) == 100  # only A is left to evict; B is locked
    assert c.match_prefix(seq(1000, 100)).device_tokens == 100
    c.unlock(locked)
    assert c.evictable_tokens == 100 and c.evict(1000) == 100 and c.device_tokens == 0
    assert c.evicted_tokens_total == 300


def test_disabled_cache_never_matches():
    c = PrefixCache(disabled=True)
    assert c.insert(seq(0, 100))[0] == 0
    assert c.match_prefix(seq(0, 100)).device_tokens == 0


def test_write_through_keeps_evicted_prefix_on_host_and_loads_it_back():
    c = PrefixCache(host_capacity_tokens=1000, write_policy="write_through")
    c.insert(seq(0, 300))
    assert c.host_used_tokens == 300  # backed up on its first hit (its insertion)
    c.evict(300)
    m = c.match_prefix(seq(0, 300))
    assert (m.device_tokens, m.host_tokens) == (0, 300)
    c.lock(m.last_node)
    assert c.load_back(m) == 300
    assert c.device_tokens == 300 and c.evictable_tokens == 0 and c.load_back_tokens_total == 300
    assert c.match_prefix(seq(0, 300)).device_tokens == 300


def test_write_back_copies_only_on_eviction():
    c = PrefixCache(host_capacity_tokens=1000, write_policy="write_back")
    c.insert(seq(0, 300))
    assert c.host_used_tokens == 0
    c.evict(300)
    assert c.host_used_tokens == 300 and c.match_prefix(seq(0, 300)).host_tokens == 300


@pytest.mark.parametrize(("inserts", "backed_up"), [(1, False), (2, True)])
def test_write_through_selective_needs_two_hits(inserts, backed_up):
    c = PrefixCache(host_capacity_tokens=1000, write_policy="write_through_selective")
    for _ in range(inserts):
        c.insert(seq(0, 300))
    c.insert(seq(0, 300), chunked=True)  # unfinished prefill chunks count no hits
    c.evict(300)
    assert (c.match_prefix(seq(0, 300)).host_tokens == 300) is backed_up


def test_full_host_tier_evicts_its_own_lru_leaves():
    c = PrefixCache(host_capacity_tokens=500)
    c.insert(seq(0, 300))
    c.evict(300)                     # A: host only
    c.insert(seq(1000, 300))         # B: backing it up needs A's host cells
    assert c.host_used_tokens == 300
    assert c.match_prefix(seq(0, 300)).host_tokens == 0
    assert c.match_prefix(seq(1000, 300)).device_tokens == 300


def test_evicting_an_unbacked_node_drops_host_children():
    c = PrefixCache(host_capacity_tokens=10_000, write_policy="write_through_selective")
    c.insert(seq(0, 100))
    c.insert(seq(0, 100))            # the shared prefix: 2 hits, backed up
    c.insert(seq(0, 100) + seq(500, 100))
    c.insert(seq(0, 100) + seq(500, 100))  # the branch: 2 hits, backed up
    c.evict(200)
    m = c.match_prefix(seq(0, 100) + seq(500, 100))
    assert (m.device_tokens, m.host_tokens) == (0, 200)
    assert c.device_tokens == 0 and c.host_used_tokens == 200


def test_reset_empties_both_tiers_but_keeps_counters():
    c = PrefixCache(host_capacity_tokens=1000)
    c.insert(seq(0, 100))
    c.evict(100)
    c.reset()
    assert c.device_tokens == 0 and c.host_used_tokens == 0 and c.evicted_tokens_total == 100
    assert c.match_prefix(seq(0, 100)).host_tokens == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="write policy"):
        PrefixCache(write_policy="write_sometimes")
    with pytest.raises(ValueError, match="page_size"):
        PrefixCache(page_size=0)
