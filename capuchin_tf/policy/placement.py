"""Where a plan's buffers would go on the device: the simulator's timeline replayed through a best-fit placement.
Pure Python: no TensorFlow.

The simulator counts bytes; the device allocator (BFC) needs one free run for each buffer. When the free memory is
in pieces smaller than an allocation, a guided step evicts on demand although the plan's bytes fit (docs/decisions.md,
"A plan's placement is predicted"). This module replays a simulated step's buffers (SimulationResult.events) into one
address space, each allocation in the smallest free run that holds it, lowest address first, taking the whole run
unless it is at least twice the allocation (BFC's choice and its rule for splitting a chunk), the space growing at
its top when no run holds it. The top it reaches over the most bytes live
at once is the plan's fragmentation: what the device needs beyond the byte peak.

A model, not the allocator: BFC's bins, its region boundaries and the small-tensor pool are left out (allocations of
at most SMALL_BYTES go to the pool of their own, cc/kernels/device_allocator.h, and are not placed).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Iterator

from capuchin_tf.core.schedule import ALLOCATION_GRANULE as GRANULE  # BFC rounds every allocation up to a multiple
from capuchin_tf.core.schedule import SMALL_TENSOR_BYTES as SMALL_BYTES  # at most this: the allocator's small pool

# BFC splits a free chunk for an allocation only when the chunk is at least twice the request or the rest is at least
# this (its kMaxInternalFragmentation, 128 MiB without a fragmentation_fraction); otherwise the allocation takes the
# whole chunk (tensorflow/core/common_runtime/bfc_allocator.cc, FindChunkPtr).
MAX_INTERNAL_FRAGMENTATION = 128 << 20


def rounded(n: int) -> int:
    return max(GRANULE, (n + GRANULE - 1) // GRANULE * GRANULE)


@dataclasses.dataclass(frozen=True)
class Placement:
    """What the best-fit replay of one step found (bytes; only allocations of more than SMALL_BYTES)."""

    extent: int  # the highest address the placed buffers reach
    live_peak: int  # the most bytes of those buffers live at once
    allocations: int

    @property
    def fragmentation(self) -> int:
        """The device the placement needs beyond the bytes live at once."""
        return self.extent - self.live_peak


class _Space:
    """Free runs by address below `top`; everything at and above `top` is free."""

    def __init__(self) -> None:
        self.free: list[tuple[int, int]] = []  # (address, size), sorted by address, never adjacent
        self.top = 0

    def alloc(self, n: int) -> tuple[int, int]:
        """The address of `n` bytes and the bytes taken there: the smallest free run that holds them, lowest address
        first, split only when it is at least twice `n` (or leaves MAX_INTERNAL_FRAGMENTATION or more); else the whole
        run is taken (BFC's rule: a chunk of less than twice the request goes to it whole)."""
        best = None
        for a, s in self.free:
            if s >= n and (best is None or s < best[1]):
                best = (a, s)
                if s == n:
                    break
        if best is None:  # no run holds it: the space grows, from the run that ends at the top if there is one
            if self.free and sum(self.free[-1]) == self.top:
                a, _ = self.free.pop()
            else:
                a = self.top
            self.top = a + n
            return a, n
        a, s = best
        i = bisect.bisect_left(self.free, (a, 0))
        if s >= 2 * n or s - n >= MAX_INTERNAL_FRAGMENTATION:
            self.free[i] = (a + n, s - n)
            return a, n
        self.free.pop(i)
        return a, s

    def release(self, a: int, n: int) -> None:
        i = bisect.bisect_left(self.free, (a, 0))
        if i < len(self.free) and self.free[i][0] == a + n:  # coalesce with the run above
            n += self.free.pop(i)[1]
        if i > 0 and sum(self.free[i - 1]) == a:  # and with the run below
            a0, s0 = self.free.pop(i - 1)
            a, n, i = a0, s0 + n, i - 1
        if a + n == self.top:
            self.top = a
        else:
            self.free.insert(i, (a, n))


def buffer_events(events: Iterable[tuple[float, int, str]]) -> Iterator[tuple[float, int, str]]:
    """`events` (SimulationResult.events, in time order) as the allocations and frees of buffers, each free with the
    key of the allocation it frees: a free of a buffer not live (a persistent release, or an eviction sorted before
    the production it follows at the same instant) is dropped, and an allocation at the instant of such a dropped
    free of its label is a buffer of no lifetime, dropped with it; a label allocated again while live gets a key of
    its own."""
    live: set[str] = set()
    dropped: dict[str, float] = {}
    for when, delta, label in events:
        if delta > 0:
            if dropped.get(label) == when:
                del dropped[label]
                continue
            key = label
            while key in live:
                key += "'"
            live.add(key)
            yield when, delta, key
        elif delta < 0:
            if label in live:
                live.discard(label)
                yield when, delta, label
            else:
                dropped[label] = when


def reserve(tensor_bytes: Iterable[int]) -> int:
    """The placement error assumed before any step was measured: the largest buffer of the step (a kernel's
    temporary included). A placement that is off by as little as one buffer's run needs up to that much more device
    for it; without the room, that buffer's allocation is where a guided step evicts on demand (docs/decisions.md,
    "A placement error, assumed then learned")."""
    return max((int(n) for n in tensor_bytes), default=0)


def live_at(events: Iterable[tuple[float, int, str]], at: float) -> dict[str, int]:
    """Label -> bytes of the buffers live at time `at` (allocated at or before it, not freed by then)."""
    live: dict[str, int] = {}
    for when, delta, key in buffer_events(events):
        if when > at:
            break
        if delta > 0:
            live[key] = delta
        else:
            live.pop(key, None)
    return live


@dataclasses.dataclass(frozen=True)
class Overflow:
    """The first allocation whose placement takes the space past a limit: when, its label and bytes, the space's top
    after it, and the largest free run below the top just before it (which it did not fit)."""

    time: float
    label: str
    nbytes: int
    top: int
    largest_free: int


def allocations(events: Iterable[tuple[float, int, str]], small_bytes: int = SMALL_BYTES, largest_free: bool = False):
    """The best-fit replay of a step's buffers (`events` as in SimulationResult.events, paired by buffer_events;
    buffers of at most `small_bytes` left out), one allocation at a time: (time, label, bytes as placed, bytes live
    after it, the largest free run just before it (with `largest_free`; else 0), the space just after it: `_Space`,
    its `top` and `free` runs)."""
    space = _Space()
    where: dict[str, tuple[int, int, int]] = {}  # key -> (address, bytes taken, bytes asked)
    live = 0
    for when, delta, key in buffer_events(events):
        if delta > 0:
            if delta <= small_bytes:
                continue
            n = rounded(delta)
            largest = max((s for _, s in space.free), default=0) if largest_free else 0
            where[key] = (*space.alloc(n), n)
            live += n
            yield when, key, n, live, largest, space
        elif key in where:
            a, taken, n = where.pop(key)
            space.release(a, taken)
            live -= n


def first_overflow(events: Iterable[tuple[float, int, str]], limit_bytes: int,
                   small_bytes: int = SMALL_BYTES) -> Overflow | None:
    """The first allocation of `events` (as `place` takes them) that takes the placed space past `limit_bytes`;
    None if none does."""
    for when, key, n, _, largest, space in allocations(events, small_bytes, largest_free=True):
        if space.top > limit_bytes:
            return Overflow(time=when, label=key, nbytes=n, top=space.top, largest_free=largest)
    return None


def place(events: Iterable[tuple[float, int, str]], small_bytes: int = SMALL_BYTES) -> Placement:
    """Best-fit placement of a step's buffers (`events` as in SimulationResult.events, paired by buffer_events);
    buffers of at most `small_bytes` are left out."""
    extent = live_peak = count = 0
    for _, _, _, live, _, space in allocations(events, small_bytes):
        count += 1
        live_peak = max(live_peak, live)
        extent = max(extent, space.top)
    return Placement(extent=extent, live_peak=live_peak, allocations=count)
