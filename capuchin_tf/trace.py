"""The access trace of one measured training step. Pure Python: imports no TensorFlow.

What the measured execution records, on the *ideal timeline* (times of the measured step with the stalls of
passive-mode evictions removed, i.e. what a device with enough memory would have seen):

- `ops`: every executed op, in executed order, with its start and duration;
- `tensors`: every transient tensor the step materialized, with its size, allocation and free times and its
  accesses (access 0 is its production, at the end of its producer; each later access is a read by a consumer op,
  at that op's start);
- `memory_curve`: device bytes in use over the step, as the allocator saw it;
- `peak_bytes` (the allocator's measured peak of the step), `persistent_bytes` (in use before the step: weights,
  optimizer slots, inputs), `released` (persistent buffers freed during the step), `evicted_bytes` (what passive
  mode had to evict: the paper's saving target) and `stall_time` (what was removed from the timeline).

Times are seconds from the start of the step. The paper's tensor access list (TAT) is `access_list()`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Iterable, Mapping

from capuchin_tf.graph_model import SCHEMA_VERSION, GraphModel, Role


class TraceError(ValueError):
    """The trace is malformed or of an unsupported schema version."""


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """One executed op."""

    name: str
    type: str
    start: float
    duration: float
    role: Role = Role.OTHER

    @property
    def end(self) -> float:
        return self.start + self.duration


@dataclasses.dataclass(frozen=True)
class Access:
    """One access of a tensor: index 0 is its production, later indices are reads, in time order."""

    tensor: str
    index: int
    time: float
    op: str


@dataclasses.dataclass(frozen=True)
class TensorRecord:
    """A transient tensor of the step. `free` is None when it outlives the step (an output)."""

    id: str
    nbytes: int
    alloc: float
    free: float | None
    accesses: tuple[Access, ...]

    @property
    def access_count(self) -> int:
        return len(self.accesses)

    def alive_during(self, start: float, end: float, step_end: float) -> bool:
        free = step_end if self.free is None else self.free
        return self.alloc < end and free > start


@dataclasses.dataclass(frozen=True)
class AccessTrace:
    graph: GraphModel
    ops: tuple[OpRecord, ...]
    tensors: Mapping[str, TensorRecord]
    memory_curve: tuple[tuple[float, int], ...]
    step_time: float
    peak_bytes: int
    persistent_bytes: int
    evicted_bytes: int = 0
    stall_time: float = 0.0
    budget_bytes: int | None = None
    meta: Mapping = dataclasses.field(default_factory=dict)
    # Persistent buffers freed during the step, as (time, bytes): e.g. a variable's old buffer when an update
    # copied it (copy-on-write while a read of it was still alive).
    released: tuple[tuple[float, int], ...] = ()

    # ---- derived views -------------------------------------------------------------------------------------------
    def access_list(self) -> list[Access]:
        """Every access of every tensor, in time order (the paper's tensor access list)."""
        out = [a for t in self.tensors.values() for a in t.accesses]
        out.sort(key=lambda a: (a.time, a.tensor, a.index))
        return out

    def replayed_curve(self) -> list[tuple[float, int]]:
        """Device memory over the step replayed from the tensors' lifetimes: persistent + live transient bytes.

        At equal times frees come before allocations (an op's inputs can be freed when its output is allocated only
        if they are already dead; the allocator itself orders it the same way).
        """
        events: list[tuple[float, int, int]] = []
        for t in self.tensors.values():
            events.append((t.alloc, 1, t.nbytes))
            if t.free is not None:
                events.append((t.free, 0, -t.nbytes))
        for time, nbytes in self.released:
            events.append((time, 0, -nbytes))
        events.sort()
        level = self.persistent_bytes
        curve = [(0.0, level)]
        for time, _, delta in events:
            level += delta
            curve.append((time, level))
        return curve

    def replayed_peak_bytes(self) -> int:
        return max(b for _, b in self.replayed_curve())

    def peak_time(self) -> float:
        curve = self.replayed_curve()
        return max(curve, key=lambda p: p[1])[0]

    def peak_window(self, threshold_bytes: int | None = None) -> tuple[float, float]:
        """The peak-memory period: from the first to the last time the replayed curve is above the threshold.

        Default threshold: the budget when one is set and below the peak, else 90% of the replayed peak.
        """
        curve = self.replayed_curve()
        peak = max(b for _, b in curve)
        if threshold_bytes is None:
            if self.budget_bytes is not None and self.budget_bytes < peak:
                threshold_bytes = self.budget_bytes
            else:
                threshold_bytes = int(0.9 * peak)
        above = [i for i, (_, b) in enumerate(curve) if b > threshold_bytes]
        if not above:
            t = self.peak_time()
            return (t, t)
        start = curve[above[0]][0]
        nxt = above[-1] + 1
        end = curve[nxt][0] if nxt < len(curve) else self.step_time
        return (start, end)

    def saving_target(self, budget_bytes: int, margin_bytes: int = 0) -> int:
        """Bytes to save: the larger of what passive mode evicted and (ideal peak - budget + margin) (design.md)."""
        return max(self.evicted_bytes, self.replayed_peak_bytes() - budget_bytes + margin_bytes, 0)

    # ---- JSON ----------------------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": "capuchin_tf.AccessTrace",
            "peak_bytes": self.peak_bytes,
            "persistent_bytes": self.persistent_bytes,
            "replayed_peak_bytes": self.replayed_peak_bytes(),
            "evicted_bytes": self.evicted_bytes,
            "stall_time": self.stall_time,
            "step_time": self.step_time,
            "budget_bytes": self.budget_bytes,
            "meta": dict(self.meta),
            "graph": self.graph.to_json(),
            "ops": [[o.name, o.type, o.start, o.duration, o.role.value] for o in self.ops],
            "tensors": [
                {
                    "id": t.id,
                    "nbytes": t.nbytes,
                    "alloc": t.alloc,
                    "free": t.free,
                    "accesses": [[a.index, a.time, a.op] for a in t.accesses],
                }
                for t in self.tensors.values()
            ],
            "memory_curve": [list(p) for p in self.memory_curve],
            "released": [list(p) for p in self.released],
        }

    @classmethod
    def from_json(cls, d: Mapping) -> "AccessTrace":
        if d.get("kind") != "capuchin_tf.AccessTrace":
            raise TraceError("not a capuchin_tf access trace (kind != 'capuchin_tf.AccessTrace')")
        if d.get("schema_version") != SCHEMA_VERSION:
            raise TraceError(
                f"trace schema version {d.get('schema_version')!r} is not supported (this is {SCHEMA_VERSION})"
            )
        tensors = {}
        for t in d["tensors"]:
            accesses = tuple(Access(t["id"], int(i), float(time), op) for i, time, op in t["accesses"])
            tensors[t["id"]] = TensorRecord(t["id"], int(t["nbytes"]), float(t["alloc"]), t["free"], accesses)
        return cls(
            graph=GraphModel.from_json(d["graph"]),
            ops=tuple(OpRecord(n, ty, float(s), float(du), Role(r)) for n, ty, s, du, r in d["ops"]),
            tensors=tensors,
            memory_curve=tuple((float(t), int(b)) for t, b in d["memory_curve"]),
            step_time=float(d["step_time"]),
            peak_bytes=int(d["peak_bytes"]),
            persistent_bytes=int(d["persistent_bytes"]),
            evicted_bytes=int(d.get("evicted_bytes", 0)),
            stall_time=float(d.get("stall_time", 0.0)),
            budget_bytes=d.get("budget_bytes"),
            meta=dict(d.get("meta", {})),
            released=tuple((float(t), int(b)) for t, b in d.get("released", ())),
        )

    def save(self, path: str | pathlib.Path) -> None:
        pathlib.Path(path).write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | pathlib.Path) -> "AccessTrace":
        try:
            data = json.loads(pathlib.Path(path).read_text())
        except json.JSONDecodeError as e:
            raise TraceError(f"{path}: not valid JSON ({e})") from e
        return cls.from_json(data)


def build_trace(
    graph: GraphModel,
    ops: Iterable[OpRecord],
    tensors: Iterable[TensorRecord],
    **kwargs,
) -> AccessTrace:
    """An AccessTrace with ops sorted by start time and each tensor's accesses sorted and re-indexed."""
    ops = tuple(sorted(ops, key=lambda o: (o.start, o.name)))
    recs = {}
    for t in tensors:
        acc = sorted(t.accesses, key=lambda a: (a.time, a.index))
        acc = tuple(Access(t.id, i, a.time, a.op) for i, a in enumerate(acc))
        recs[t.id] = dataclasses.replace(t, accesses=acc)
    step_time = kwargs.pop("step_time", max((o.end for o in ops), default=0.0))
    return AccessTrace(graph=graph, ops=ops, tensors=recs, step_time=step_time, **kwargs)
