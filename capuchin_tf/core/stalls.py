"""The host store's stall log, read: what a step waited for, by kind.

The kinds are those the host store logs (cc/kernels/host_store.h, `StallKind`; the same numbers); `summarize` turns a
drained log (capuchin_tf.tf.ops.drain_stalls: arrays `name`, `kind`, `start_ns`, `end_ns`) into what the runtime's
feedback needs. Pure: imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence


class StallKind(enum.IntEnum):
    PASSIVE_EVICTION = 0  # passive mode evicted pooled tensors to make room for an allocation (no tensor named)
    EVICTED_GET = 1  # a Get brought back a tensor passive mode had evicted
    LATE_PREFETCH = 2  # a swap-in waited for its prefetch's copy
    EARLY_PREFETCH = 3  # a prefetched tensor was evicted again before its swap-in read it
    COPY_WAIT = 4  # an allocation waited for a copy in flight to free device memory (passive mode; no tensor named)
    DEVICE_MOVE = 5  # passive mode moved pooled tensors inside the device to make a free run (no tensor named)


# What the step waited for (and so not computing): evictions, on-demand swap-ins, late prefetches, copies in flight
# and moves inside the device.
WAITING_KINDS = frozenset({StallKind.PASSIVE_EVICTION, StallKind.EVICTED_GET, StallKind.LATE_PREFETCH,
                           StallKind.COPY_WAIT, StallKind.DEVICE_MOVE})


@dataclasses.dataclass(frozen=True)
class StallSummary:
    late: Mapping[str, float]  # tensor -> seconds its swap-in waited for its copy (LATE_PREFETCH)
    early: Sequence[str]  # tensors prefetched too early (EARLY_PREFETCH), in log order
    waited_s: float  # seconds of every waiting kind
    evicted: Mapping[str, float] = dataclasses.field(default_factory=dict)  # tensor -> seconds bringing it back took
    by_kind: Mapping[str, float] = dataclasses.field(default_factory=dict)  # kind name (lower case) -> seconds waited


def summarize(stalls: Mapping[str, Sequence]) -> StallSummary:
    late: dict[str, float] = {}
    evicted: dict[str, float] = {}
    early: list[str] = []
    waited_ns = 0
    by_kind: dict[str, float] = {}
    for name, kind, start, end in zip(stalls["name"], stalls["kind"], stalls["start_ns"], stalls["end_ns"]):
        kind = StallKind(int(kind))
        if kind == StallKind.LATE_PREFETCH:
            late[str(name)] = late.get(str(name), 0.0) + (int(end) - int(start)) / 1e9
        elif kind == StallKind.EVICTED_GET:
            evicted[str(name)] = evicted.get(str(name), 0.0) + (int(end) - int(start)) / 1e9
        elif kind == StallKind.EARLY_PREFETCH:
            early.append(str(name))
        if kind in WAITING_KINDS:
            waited_ns += int(end) - int(start)
            by_kind[kind.name.lower()] = by_kind.get(kind.name.lower(), 0.0) + (int(end) - int(start)) / 1e9
    return StallSummary(late=late, early=early, waited_s=waited_ns / 1e9, evicted=evicted, by_kind=by_kind)
