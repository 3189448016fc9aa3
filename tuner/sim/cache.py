"""The simulator's prefix cache: a radix tree over token-id pages, with LRU eviction and an
optional host (CPU memory) tier, as SGLang's RadixCache and HiRadixCache behave in outline.

It keeps token *counts*, not KV data: each node owns ``len(key)`` cells of the device KV pool
when it is on the device, and as many host cells when it is backed up to the host tier. The
engine owns the pool and asks the cache to match, lock, insert and evict.

Behaviour (``shared/sglang-reference.md``):

- Keys are token ids; matching, insertion and transfers work in whole pages of ``page_size``
  tokens (§2.4 page_size, §7 "Page size").
- A request locks the path it matched (``lock_ref``); only unlocked nodes with no device-resident
  children are evicted, least recently used first (``--radix-eviction-policy lru``, §3.1).
- Hierarchical cache (§7): evicted prefixes stay in the host tier when they have a host copy. The
  write policy decides when a node gets one: ``write_through`` on its first hit, ``write_through_
  selective`` after 2 hits, ``write_back`` only when it is evicted from the device. Hits are
  counted on insertion: a new node counts as a first hit and every existing node the insert
  passes through gets one more, except for the insert of an unfinished prefill chunk
  (``HiRadixCache._inc_hit_count`` / ``_insert_helper``, ``python/sglang/srt/mem_cache/
  hiradix_cache.py``). A request inserts its prompt after its prefill and
  its whole sequence when it finishes, so a prompt reaches 2 hits once its request decodes. A later match on host-only
  nodes is loaded back to the device if it is at least ``load_back_threshold`` (10) tokens; the
  host pool evicts its own LRU host-only leaves when full.
- A device node without a host copy whose eviction cannot back it up is deleted together with
  any host-only nodes below it (they can no longer be reached by a match). This is a
  simplification of the simulator, not an SGLang fact.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["MatchResult", "PrefixCache", "WRITE_POLICIES", "LOAD_BACK_THRESHOLD_TOKENS"]

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
"""``--hicache-write-policy`` choices (§3.1)."""

LOAD_BACK_THRESHOLD_TOKENS = 10
"""Host hits shorter than this are recomputed instead of loaded back (§7)."""

_WRITE_THROUGH_THRESHOLD = MappingProxyType({"write_through": 1, "write_through_selective": 2, "write_back": 0})


class _Node:
    """One radix-tree node: ``key`` is a page-aligned run of token ids."""

    __slots__ = ("key", "children", "parent", "lock_ref", "last_access", "on_device", "on_host", "hit_count")

    def __init__(self, key: tuple[int, ...], parent: _Node | None) -> None:
        self.key = key
        self.children: dict[tuple[int, ...], _Node] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.on_device = True
        self.on_host = False
        self.hit_count = 0

    def __lt__(self, other: _Node) -> bool:  # heap tie-break
        return self.last_access < other.last_access


@dataclass(frozen=True)
class MatchResult:
    """The longest cached prefix of a token sequence.

    Attributes:
        device_tokens: Leading tokens whose KV is on the device.
        host_tokens: Tokens after those that are only in the host tier.
        device_node: Deepest matched device-resident node (lock this to protect the device part).
        last_node: Deepest matched node overall (device or host-only).
    """

    device_tokens: int
    host_tokens: int
    device_node: _Node
    last_node: _Node


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two sequences (binary search on C-level slice compares)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixCache:
    """Radix prefix cache over the device KV pool, with an optional host tier.

    Args:
        page_size: Tokens per KV page (``--page-size``, §2.4); matches are whole pages.
        disabled: ``--disable-radix-cache``: nothing is ever matched or kept.
        host_capacity_tokens: Host-tier size in tokens (§7 host pool sizing), or None for no
            hierarchical cache.
        write_policy: ``--hicache-write-policy`` (one of :data:`WRITE_POLICIES`).
        load_back_threshold: Minimum host hit, tokens, worth loading back (§7: 10).

    Raises:
        ValueError: Unknown write policy or a page size below 1.
    """

    def __init__(
        self,
        page_size: int = 1,
        *,
        disabled: bool = False,
        host_capacity_tokens: int | None = None,
        write_policy: str = "write_through",
        load_back_threshold: int = LOAD_BACK_THRESHOLD_TOKENS,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache write policy {write_policy!r} is not one of {WRITE_POLICIES}")
        self.page_size = page_size
        self.disabled = disabled
        self.host_capacity_tokens = host_capacity_tokens
        self.write_policy = write_policy
        self.load_back_threshold = load_back_threshold
        self._threshold = _WRITE_THROUGH_THRESHOLD[write_policy]
        self._tick = 0
        self.reset()

    # ------------------------------------------------------------------ state

    def reset(self) -> None:
        """Drop every cached prefix on both tiers (``/flush_cache``); counters are kept."""
        self.root = _Node((), None)
        self.root.lock_ref = 1
        self.device_tokens = 0
        """Device pool cells held by the tree, tokens."""
        self.evictable_tokens = 0
        """Device cells held by unlocked nodes, tokens."""
        self.host_used_tokens = 0
        """Host-tier cells in use, tokens."""
        if not hasattr(self, "evicted_tokens_total"):
            self.evicted_tokens_total = 0
            self.load_back_tokens_total = 0
            self.backed_up_tokens_total = 0

    @property
    def hierarchical(self) -> bool:
        """Whether the host tier is on."""
        return self.host_capacity_tokens is not None and not self.disabled

    def _touch(self) -> int:
        self._tick += 1
        return self._tick

    # ------------------------------------------------------------------ match / lock

    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        """Find the longest cached, page-aligned prefix of ``tokens``.

        A partly matched node is split at the page boundary, as SGLang does, so the result can be
        locked exactly. Matched nodes become most recently used.

        Args:
            tokens: Token ids (the request's input minus its last token, by the caller's choice).

        Returns:
            The device part, the host-only part after it, and the nodes to lock.
        """
        node = self.root
        if self.disabled:
            return MatchResult(0, 0, node, node)
        if not isinstance(tokens, tuple):
            tokens = tuple(tokens)
        page = self.page_size
        pos = 0
        n = len(tokens)
        device_len = 0
        device_node = node
        tick = self._touch()
        while n - pos >= page:
            child = node.children.get(tuple(tokens[pos : pos + page]))
            if child is None:
                break
            klen = len(child.key)
            common = _common_prefix_len(child.key, tokens[pos : pos + klen])
            common -= common % page
            if common == 0:
                break
            if common < klen:
                child = self._split(child, common)
            child.last_access = tick
            node = child
            pos += common
            if child.on_device:  # device nodes are closed upwards: a device node's parent is too
                device_len = pos
                device_node = child
            if common < klen:
                break
        return MatchResult(device_len, pos - device_len, device_node, node)

    def _split(self, child: _Node, k: int) -> _Node:
        """Split ``child`` after ``k`` tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.key[:k], parent)
        upper.lock_ref = child.lock_ref
        upper.on_device = child.on_device
        upper.on_host = child.on_host
        upper.hit_count = child.hit_count
        upper.last_access = child.last_access
        parent.children[child.key[: self.page_size]] = upper
        child.key = child.key[k:]
        child.parent = upper
        upper.children[child.key[: self.page_size]] = child
        return upper

    def lock(self, node: _Node) -> None:
        """Protect ``node`` and its ancestors from eviction (one more reference)."""
        while node is not self.root:
            if node.lock_ref == 0 and node.on_device:
                self.evictable_tokens -= len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: _Node) -> None:
        """Release one reference taken by :meth:`lock` on ``node``."""
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0 and node.on_device:
                self.evictable_tokens += len(node.key)
            node = node.parent  # type: ignore[assignment]

    # ------------------------------------------------------------------ insert

    def insert(self, tokens: Sequence[int], *, chunked: bool = False) -> tuple[int, _Node]:
        """Insert the page-aligned prefix of ``tokens`` whose KV a request has computed.

        Args:
            tokens: Token ids; only whole pages are inserted.
            chunked: The insert of an unfinished prefill chunk, which counts no hits.

        Returns:
            ``(new_device_tokens, last_node)``: cells the tree took over from the request (the
            rest of the request's cells for this prefix were duplicates, now free), and the node
            ending the inserted prefix (for the caller to lock).
        """
        node = self.root
        if self.disabled:
            return 0, node
        if not isinstance(tokens, tuple):
            tokens = tuple(tokens)
        page = self.page_size
        n = len(tokens) - len(tokens) % page
        pos = 0
        new_tokens = 0
        tick = self._touch()
        while pos < n:
            child = node.children.get(tuple(tokens[pos : pos + page]))
            if child is None:
                leaf = _Node(tuple(tokens[pos:n]), node)
                leaf.last_access = tick
                node.children[leaf.key[:page]] = leaf
                self.device_tokens += n - pos
                self.evictable_tokens += n - pos
                new_tokens += n - pos
                if self._threshold != 0 and not chunked:
                    self._inc_hit(leaf)
                return new_tokens, leaf
            klen = len(child.key)
            common = _common_prefix_len(child.key, tokens[pos : min(n, pos + klen)])
            common -= common % page  # >= one page: the child was found by its first page
            if common < klen:
                child = self._split(child, common)
            child.last_access = tick
            if not child.on_device:  # host-only: the request's cells revive it on the device
                child.on_device = True
                self.device_tokens += common
                new_tokens += common
                if child.lock_ref == 0:
                    self.evictable_tokens += common
            elif not chunked:
                self._inc_hit(child)
            node = child
            pos += common
        return new_tokens, node

    # ------------------------------------------------------------------ host tier

    def _inc_hit(self, node: _Node) -> None:
        if not self.hierarchical or self._threshold == 0 or node.on_host:
            return
        node.hit_count += 1
        if node.hit_count >= self._threshold:
            self._backup(node)

    def _backup(self, node: _Node) -> bool:
        """Copy ``node`` to the host tier, evicting host LRU leaves if needed."""
        assert self.host_capacity_tokens is not None
        need = len(node.key)
        free = self.host_capacity_tokens - self.host_used_tokens
        if free < need:
            self.evict_host(need - free)
            if self.host_capacity_tokens - self.host_used_tokens < need:
                return False
        node.on_host = True
        self.host_used_tokens += need
        self.backed_up_tokens_total += need
        return True

    def load_back(self, match: MatchResult) -> int:
        """Mark the host-only part of ``match`` device-resident again.

        The caller must have locked ``match.last_node`` and made ``match.host_tokens`` device
        cells free first.

        Returns:
            Tokens loaded back (``match.host_tokens``).
        """
        node = match.last_node
        loaded = 0
        while node is not match.device_node and node is not self.root:
            if not node.on_device:
                node.on_device = True
                self.device_tokens += len(node.key)
                loaded += len(node.key)
                if node.lock_ref == 0:
                    self.evictable_tokens += len(node.key)
            node = node.parent  # type: ignore[assignment]
        self.load_back_tokens_total += loaded
        return loaded

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host cells by deleting LRU host-only leaves.

        Returns:
            Host tokens freed (may be fewer when everything left is locked or on the device).
        """
        heap = [
            n for n in self._iter_nodes() if n.on_host and not n.on_device and not n.children and n.lock_ref == 0
        ]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            x = heapq.heappop(heap)
            parent = x.parent
            freed += len(x.key)
            self._delete_subtree(x)
            if (
                parent is not None
                and parent is not self.root
                and parent.on_host
                and not parent.on_device
                and not parent.children
                and parent.lock_ref == 0
            ):
                heapq.heappush(heap, parent)
        return freed

    # ------------------------------------------------------------------ device eviction

    def _iter_nodes(self) -> list[_Node]:
        out: list[_Node] = []
        stack = list(self.root.children.values())
        while stack:
            x = stack.pop()
            out.append(x)
            stack.extend(x.children.values())
        return out

    @staticmethod
    def _device_leaf(x: _Node) -> bool:
        return x.on_device and x.lock_ref == 0 and not any(c.on_device for c in x.children.values())

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device cells, least recently used unlocked leaves first.

        With the host tier, a node with a host copy (or one ``write_back`` can copy now) stays in
        the tree as host-only; otherwise it is deleted.

        Returns:
            Device tokens freed (fewer when not enough is evictable).
        """
        if num_tokens <= 0 or self.evictable_tokens <= 0:
            return 0
        heap: list[tuple[int, int, _Node]] = []  # (last_access, tie-break, node): C-level compares
        stack = list(self.root.children.values())
        while stack:
            x = stack.pop()
            children = x.children
            if children:
                stack.extend(children.values())
                if x.on_device and x.lock_ref == 0 and not any(c.on_device for c in children.values()):
                    heap.append((x.last_access, len(heap), x))
            elif x.on_device and x.lock_ref == 0:
                heap.append((x.last_access, len(heap), x))
        heapq.heapify(heap)
        tie = len(heap)
        freed = 0
        while heap and freed < num_tokens:
            _, _, x = heapq.heappop(heap)
            parent = x.parent
            size = len(x.key)
            if self.hierarchical and (x.on_host or (self.write_policy == "write_back" and self._backup(x))):
                x.on_device = False
                self.device_tokens -= size
                self.evictable_tokens -= size
            else:
                self._delete_subtree(x)
            freed += size
            if parent is not None and parent is not self.root and self._device_leaf(parent):
                tie += 1
                heapq.heappush(heap, (parent.last_access, tie, parent))
        self.evicted_tokens_total += freed
        return freed

    def _delete_subtree(self, x: _Node) -> None:
        """Remove ``x`` and everything under it from the tree, releasing their cells."""
        parent = x.parent
        assert parent is not None
        del parent.children[x.key[: self.page_size]]
        stack = [x]
        while stack:
            y = stack.pop()
            size = len(y.key)
            if y.on_device:
                self.device_tokens -= size
                if y.lock_ref == 0:
                    self.evictable_tokens -= size
            if y.on_host:
                self.host_used_tokens -= size
            stack.extend(y.children.values())
