"""Placement policies on recorded guided steps, offline: each step's allocations of more than 64 KiB (the record of
`tools/probe_live_set.py`, in event order) replayed into one arena by a placement policy; the smallest arena (to 1/4
MiB) in which none fails, against the most bytes live at once. No TensorFlow.

    python3 tools/probe_placement.py docs/results/bench/2026-12-04-working-set/*-assembly-fix.json

Policies: best (best fit, lowest address: BFC's choice with every chunk split), first (first fit by address),
best-top (best fit, at the chunk's top end), split (4 MiB and more best fit at the top, the rest at the bottom),
lifetime (allocations living more than 4x the median lifetime of the step at the top, the rest at the bottom: an
oracle, the lifetimes are the record's own), bfc (best fit, lowest address, a free run split only when it is at least
twice the allocation, else taken whole: BFC's rule). A model: BFC's bins and the small pool are left out.
"""

from __future__ import annotations

import bisect
import json
import sys

MiB = 1 << 20
GRANULE = 256
POLICIES = ("best", "first", "best-top", "split", "lifetime", "bfc")
MAX_INTERNAL_FRAGMENTATION = 128 * MiB  # BFC's kMaxInternalFragmentation


def rounded(n: int) -> int:
    return max(GRANULE, (n + GRANULE - 1) // GRANULE * GRANULE)


class Arena:
    """Free runs by address; allocations split the run they take; frees coalesce with free neighbours."""

    def __init__(self, size: int, policy: str):
        self.free = [(0, size)]
        self.policy = policy

    def alloc(self, n: int, long_lived: bool) -> tuple[int, int] | None:
        n = rounded(n)
        fits = [(a, s) for a, s in self.free if s >= n]
        if not fits:
            return None
        top = (self.policy == "best-top" or (self.policy == "split" and n >= 4 * MiB)
               or (self.policy == "lifetime" and long_lived))
        if self.policy == "first":
            a, s = fits[0]
        else:
            a, s = min(fits, key=lambda c: (c[1], -c[0] if top else c[0]))
        place = a + s - n if top else a
        self.free.remove((a, s))
        if self.policy == "bfc" and s < 2 * n and s - n < MAX_INTERNAL_FRAGMENTATION:
            return a, s  # BFC gives a chunk of less than twice the request to it whole
        if place > a:
            bisect.insort(self.free, (a, place - a))
        if place + n < a + s:
            bisect.insort(self.free, (place + n, a + s - place - n))
        return place, n

    def release(self, block: tuple[int, int]) -> None:
        a, n = block
        i = bisect.bisect_left(self.free, (a, 0))
        if i < len(self.free) and self.free[i][0] == a + n:
            n += self.free.pop(i)[1]
        if i > 0 and sum(self.free[i - 1]) == a:
            a0, s0 = self.free.pop(i - 1)
            a, n = a0, s0 + n
        bisect.insort(self.free, (a, n))


def events(rec: dict) -> tuple[list[tuple[int, int, int]], int]:
    """(event index, 1 allocated / 0 freed, allocation) in order; an allocation live at the end is freed then."""
    end = max(max(rec["allocated"]), max(rec["freed"])) + 1
    ev = []
    for i, freed in enumerate(rec["freed"]):
        if freed == -2:
            continue
        ev.append((rec["allocated"][i], 1, i))
        ev.append((freed if freed >= 0 else end, 0, i))
    return sorted(ev), end


def failed_bytes(rec: dict, size: int, policy: str) -> int:
    ev, end = events(rec)
    life = [(f if f >= 0 else end) - a for a, f in zip(rec["allocated"], rec["freed"])]
    median = sorted(life)[len(life) // 2]
    arena = Arena(size, policy)
    blocks: dict[int, tuple[int, int]] = {}
    failed = 0
    for _, allocated, i in ev:
        if allocated:
            block = arena.alloc(rec["bytes"][i], life[i] > 4 * median)
            if block is None:
                failed += rec["bytes"][i]
            else:
                blocks[i] = block
        elif i in blocks:
            arena.release(blocks.pop(i))
    return failed


def live_max(rec: dict) -> int:
    level = best = 0
    for _, allocated, i in events(rec)[0]:
        level += rec["bytes"][i] if allocated else -rec["bytes"][i]
        best = max(best, level)
    return best


def smallest_arena(rec: dict, policy: str) -> int:
    lo = hi = live_max(rec)
    while failed_bytes(rec, hi, policy):
        lo, hi = hi, 2 * hi
    while hi - lo > MiB // 4:
        mid = (lo + hi) // 2
        if failed_bytes(rec, mid, policy):
            lo = mid
        else:
            hi = mid
    return hi


def main() -> int:
    for path in sys.argv[1:]:
        rec = json.load(open(path))["record"]
        most = live_max(rec)
        cells = [f"{p} {(a := smallest_arena(rec, p)) / MiB:.1f} (+{(a - most) / most * 100:.0f}%)" for p in POLICIES]
        print(f"{path.rsplit('/', 1)[-1]}: live at once {most / MiB:.1f} MiB; " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
