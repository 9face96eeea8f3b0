"""Eviction policies of the expert cache, shared by the live cache and the simulator.

A policy scores the resident expert blocks; the block with the lowest score among those not
pinned (in use by the running layer, or being read) is evicted. Blocks are numbered
b = j * E + e (MoE layer index j of M, expert e of E). Time is counted two ways: `clock`,
one tick per access, and `token`, the number of the token (decode step) being run.

    lru            score = clock of the last access
    lfu            score = accesses since the run began (kept across evictions), then the last
                   access's clock (ties go to the least recently used)
    least-stale    score = token of the last access, then the position of the block's layer in
                   the layer cycle seen from the running layer: among blocks last used by the
                   same token, the one whose layer comes round again last (the running layer,
                   then the layers before it) goes first. Token-granular recency that knows
                   the layers are visited in order.
    freq-weighted  score = an exponentially decayed access count, half-life HALF_LIFE tokens:
                   frequency that forgets, so a block popular a long time ago loses to one
                   popular now

Shapes: M MoE layers, E experts per layer, N slots of the cache.
"""
from __future__ import annotations

import numpy as np

__all__ = ["POLICIES", "Policy", "make_policy", "HALF_LIFE", "SlotTable", "CacheFullError"]

POLICIES = ("lru", "lfu", "least-stale", "freq-weighted")
HALF_LIFE = 8.0                  # tokens, of freq-weighted's decayed count (docs/memory.md)


class Policy:
    """Scores of n_blocks blocks; `access` on every use (hit or miss, in order), `victim`
    to choose the slot to free."""

    name = "lru"

    def __init__(self, n_layers: int, n_experts: int):
        self.M, self.E = int(n_layers), int(n_experts)
        n = self.M * self.E
        self.clock = 0
        self.token = 0
        self.layer = 0                                  # the running MoE layer index j
        self.last = np.zeros(n, np.float64)             # clock of the last access
        self.count = np.zeros(n, np.float64)
        self.last_token = np.zeros(n, np.float64)

    def access(self, block: int) -> None:
        self.clock += 1
        self.last[block] = self.clock
        self.count[block] += 1
        self.last_token[block] = self.token

    def scores(self, blocks: np.ndarray) -> np.ndarray:
        """float64 scores of the blocks (N,): the lowest is evicted first."""
        return self.last[blocks]

    def victim(self, slot_block: np.ndarray, pinned: np.ndarray) -> int:
        """The slot to evict: slot_block int64 (N,) the block in each slot (-1: empty),
        pinned bool (N,) slots that must stay. An empty slot first; -1 when every slot is
        pinned."""
        free = np.flatnonzero((slot_block < 0) & ~pinned)
        if free.size:
            return int(free[0])
        s = self.scores(slot_block)
        s[pinned] = np.inf
        i = int(np.argmin(s))
        return -1 if pinned[i] else i


class LFU(Policy):
    name = "lfu"

    def scores(self, blocks):
        return self.count[blocks] * 2.0**32 + self.last[blocks]


class LeastStale(Policy):
    name = "least-stale"

    def scores(self, blocks):
        layer = blocks // self.E
        ahead = (layer - self.layer - 1) % self.M          # layers until the block's comes round
        return self.last_token[blocks] * self.M + (self.M - 1 - ahead)


class FreqWeighted(Policy):
    name = "freq-weighted"

    def __init__(self, n_layers: int, n_experts: int):
        super().__init__(n_layers, n_experts)
        self.decayed = np.zeros(self.M * self.E, np.float64)   # value at last_token

    def access(self, block: int) -> None:
        age = self.token - self.last_token[block]
        self.decayed[block] = self.decayed[block] * 0.5 ** (age / HALF_LIFE) + 1.0
        super().access(block)

    def scores(self, blocks):
        age = self.token - self.last_token[blocks]
        return self.decayed[blocks] * 0.5 ** (age / HALF_LIFE) + self.last[blocks] * 1e-12


_CLASSES = {"lru": Policy, "lfu": LFU, "least-stale": LeastStale, "freq-weighted": FreqWeighted}


def make_policy(name: str, n_layers: int, n_experts: int) -> Policy:
    """A fresh policy by name (one of POLICIES)."""
    try:
        cls = _CLASSES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r} (expected one of "
                         f"{', '.join(POLICIES)})") from None
    return cls(n_layers, n_experts)


class CacheFullError(RuntimeError):
    """Every slot is pinned: the cache is smaller than one layer call needs."""


class SlotTable:
    """Which block lies in which of N slots, and the lookups that fill them.

    The live cache (colibri.experts.expert_cache) and the simulator (colibri.tools.cache_sim) both
    run every layer call through `lookup`, so they make the same decisions on the same
    routing. `busy` marks slots being read (by a prefetch): never evicted until cleared.
    """

    def __init__(self, n_slots: int, policy: Policy):
        self.policy = policy
        self.slot_block = np.full(int(n_slots), -1, np.int64)             # (N,)
        self.block_slot = np.full(policy.M * policy.E, -1, np.int64)      # (M*E,)
        self.pinned = np.zeros(int(n_slots), bool)
        self.busy = np.zeros(int(n_slots), bool)

    @property
    def n_slots(self) -> int:
        return self.slot_block.size

    def begin_call(self) -> None:
        """A new forward call (a token, in a decode): the policies' token clock moves on."""
        self.policy.token += 1

    def lookup(self, j: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, list]:
        """Layer j's accesses ids int (T, K) in (t, k) order -> (slots int32 (T, K), hit
        bool (T, K), loads [(slot, block, evicted block or -1)] to read in). The slots stay pinned until the next
        lookup; an evicted block's slot is reused."""
        pol = self.policy
        pol.layer = j
        self.pinned[:] = False
        E = pol.E
        slots = np.empty(ids.shape, np.int32)
        hit = np.zeros(ids.shape, bool)
        loads = []
        for t in range(ids.shape[0]):
            for k in range(ids.shape[1]):
                b = j * E + int(ids[t, k])
                s = int(self.block_slot[b])
                if s >= 0:
                    hit[t, k] = True
                else:
                    s, old = self.claim(b, self.pinned)
                    loads.append((s, b, old))
                self.pinned[s] = True
                pol.access(b)
                slots[t, k] = s
        return slots, hit, loads

    def claim(self, block: int, keep: np.ndarray) -> tuple[int, int]:
        """(slot, evicted block or -1) for `block` (not resident): an empty slot or the
        policy's victim among the slots neither in `keep` nor busy."""
        s = self.policy.victim(self.slot_block, keep | self.busy)
        if s < 0:
            raise CacheFullError(f"the expert cache's {self.n_slots} slots are all in use by "
                                 f"the running layer: it needs more slots")
        old = int(self.slot_block[s])
        if old >= 0:
            self.block_slot[old] = -1
        self.slot_block[s] = block
        self.block_slot[block] = s
        return s, old
