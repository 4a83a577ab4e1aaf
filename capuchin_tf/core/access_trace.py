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

`AccessTrace.from_json` checks the JSON against the schema before building anything: a malformed trace raises
`TraceFormatError`, whose message starts with the path of the offending field (``trace.tensors[3].nbytes``) and says
what was expected and what was found. Sizes are non-negative integers (in the graph model, -1 means "unknown"),
times non-negative seconds; executed ops are in start order, a tensor's accesses in time order, numbered 0, 1, ...
and name executed ops; a tensor is freed no earlier than it is allocated; the memory curve is in time order.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NoReturn

from capuchin_tf.core.graph_model import SCHEMA_VERSION, GraphModel, GraphModelError, Role

TRACE_KIND = "capuchin_tf.AccessTrace"


class TraceError(ValueError):
    """The trace is malformed or of an unsupported schema version."""


class TraceFormatError(TraceError):
    """A trace's JSON does not follow the schema (`AccessTrace.from_json`, `AccessTrace.load`). The message is one
    line: the path of the offending field (``trace.tensors[3].nbytes``), what was expected and what was found."""


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

    def saving_target(self, budget_bytes: int, margin_bytes: int = 0, replayed_peak: int | None = None) -> int:
        """Bytes to save: the larger of what passive mode evicted and (ideal peak - budget + margin) (design.md).
        `replayed_peak`: the trace's replayed peak when the caller has it (TraceIndex.replayed_peak). A step that ran
        under a lower budget than `budget_bytes` (meta["ran_under_bytes"]: the measured step's retry after split free
        memory) evicted for that one: its evictions count less the difference."""
        peak = self.replayed_peak_bytes() if replayed_peak is None else replayed_peak
        evicted = int(self.evicted_bytes)
        ran_under = self.meta.get("ran_under_bytes") if self.meta else None
        if ran_under and budget_bytes > ran_under:
            evicted = max(evicted - (budget_bytes - int(ran_under)), 0)
        return max(evicted, peak - budget_bytes + margin_bytes, 0)

    def retimed(self, durations: Mapping[str, float], source: str = "") -> AccessTrace:
        """The same step with the ops' durations of another run of it: `durations` (seconds per op name; an op it
        does not name keeps its own). Every time of the trace (op starts, accesses, allocations and frees, the memory
        curve, releases, the step's end) moves with the op running then: the timeline is cut at every op's start and
        end, and each piece is stretched by the duration ratio of the latest-started op covering it (a piece no op
        covers, a gap, keeps its length). The order of every event is kept. `source` is recorded in meta["retimed"].
        """
        knots = sorted({0.0, self.step_time, *(o.start for o in self.ops), *(o.end for o in self.ops)})
        # The op covering each piece [knots[j], knots[j+1]]: the latest-started one running over all of it.
        starts_at: dict[float, list[OpRecord]] = {}
        for o in self.ops:
            starts_at.setdefault(o.start, []).append(o)
        active: list[OpRecord] = []
        new = [knots[0]]
        for a, b in zip(knots, knots[1:]):
            active.extend(starts_at.get(a, ()))
            active = [o for o in active if o.end >= b]
            factor = 1.0
            if active:
                o = max(active, key=lambda o: o.start)
                if o.name in durations and o.duration > 0:
                    factor = max(float(durations[o.name]), 0.0) / o.duration
            new.append(new[-1] + (b - a) * factor)

        def at(t: float) -> float:
            j = bisect.bisect_right(knots, t) - 1
            if j < 0:
                return new[0] + (t - knots[0])
            if j >= len(knots) - 1:
                return new[-1] + (t - knots[-1])
            a, b = knots[j], knots[j + 1]
            return new[j] + (new[j + 1] - new[j]) * ((t - a) / (b - a) if b > a else 0.0)

        ops = tuple(dataclasses.replace(o, start=at(o.start), duration=max(at(o.end) - at(o.start), 0.0))
                    for o in self.ops)
        tensors = {tid: dataclasses.replace(
            t, alloc=at(t.alloc), free=None if t.free is None else at(t.free),
            accesses=tuple(dataclasses.replace(a, time=at(a.time)) for a in t.accesses))
            for tid, t in self.tensors.items()}
        meta = dict(self.meta or {})
        meta["retimed"] = {"source": source, "measured_step_s": self.step_time, "ops": len(durations)}
        return dataclasses.replace(
            self, ops=ops, tensors=tensors, memory_curve=tuple((at(t), b) for t, b in self.memory_curve),
            step_time=at(self.step_time), released=tuple((at(t), b) for t, b in self.released), meta=meta)

    # ---- JSON ----------------------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": TRACE_KIND,
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
    def from_json(cls, d: Mapping) -> AccessTrace:
        """The trace from its JSON form (`to_json`); raises TraceFormatError, naming the field, when it is malformed."""
        return _parse_trace(cls, d)

    def save(self, path: str | pathlib.Path) -> None:
        pathlib.Path(path).write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | pathlib.Path) -> AccessTrace:
        """Reads a trace file. TraceFormatError when it is not JSON or not a valid trace; OSError when unreadable."""
        raw = pathlib.Path(path).read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raise TraceFormatError(f"{path}: not valid JSON (a gzip file: decompress it first, e.g. gunzip -k)")
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError; nesting too deep
            raise TraceFormatError(f"{path}: not valid JSON ({_one_line(str(e))})") from None
        return cls.from_json(data)


# ---- validation of the JSON form ------------------------------------------------------------------------------------
_ROLES = tuple(r.value for r in Role)
_ROLE_TEXT = "one of " + ", ".join(repr(r) for r in _ROLES)
_SIZE = "a non-negative integer"
_SECONDS = "a non-negative number (seconds)"


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _show(v: Any) -> str:
    """A value as the message names it: JSON words for null and booleans, the length of lists, short reprs."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, Mapping):
        return "an object"
    if isinstance(v, (list, tuple)):
        return f"a list of {len(v)} item{'' if len(v) == 1 else 's'}"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _fail(path: str, expected: str, got: Any) -> NoReturn:
    raise TraceFormatError(f"{path}: expected {expected}, got {_show(got)}")


def _key(d: Mapping, key: str, path: str) -> Any:
    if key not in d:
        raise TraceFormatError(f"{path}: missing required key {key!r}")
    return d[key]


def _object(v: Any, path: str) -> Mapping:
    if not isinstance(v, Mapping):
        _fail(path, "a JSON object", v)
    return v


def _list(v: Any, path: str, expected: str = "a JSON list") -> Sequence:
    if not isinstance(v, (list, tuple)):
        _fail(path, expected, v)
    return v


def _entry(v: Any, path: str, fields: tuple[str, ...]) -> Sequence:
    """A fixed-length list such as ``[index, time, op]``."""
    if not isinstance(v, (list, tuple)) or len(v) != len(fields):
        _fail(path, "[" + ", ".join(fields) + "]", v)
    return v


def _string(v: Any, path: str) -> str:
    if not isinstance(v, str):
        _fail(path, "a string", v)
    return v


def _strings(v: Any, path: str) -> tuple[str, ...]:
    return tuple(_string(x, f"{path}[{i}]") for i, x in enumerate(_list(v, path, "a JSON list of strings")))


def _bool(v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        _fail(path, "true or false", v)
    return v


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_INT_MAX = 2**63 - 1  # TensorFlow's sizes are int64


def _integer(v: Any, path: str, minimum: int = 0, expected: str = _SIZE) -> int:
    """An integer in [minimum, 2**63 - 1]; an integral float (1024.0) counts as one."""
    if _is_number(v) and (isinstance(v, int) or (math.isfinite(v) and v.is_integer())) and v >= minimum:
        if v <= _INT_MAX:
            return int(v)
        expected = f"{expected} of at most 2**63 - 1"
    _fail(path, expected, v)


def _seconds(v: Any, path: str, expected: str = _SECONDS) -> float:
    if _is_number(v) and v >= 0:
        try:
            f = float(v)
        except OverflowError:  # an integer beyond any float
            f = math.inf
        if math.isfinite(f):
            return f
    _fail(path, expected, v)


def _role(v: Any, path: str) -> Role:
    if isinstance(v, str) and v in _ROLES:
        return Role(v)
    _fail(path, _ROLE_TEXT, v)


def _check_graph(g: Any) -> GraphModel:
    """Checks the graph model's JSON field by field, then builds it with GraphModel.from_json (whose reference
    check, e.g. an op naming an unknown tensor, is reported under ``trace.graph``)."""
    path = "trace.graph"
    g = _object(g, path)
    names: dict[str, int] = {}
    for i, o in enumerate(_list(_key(g, "ops", path), f"{path}.ops")):
        p = f"{path}.ops[{i}]"
        o = _object(o, p)
        name = _string(_key(o, "name", p), f"{p}.name")
        if name in names:
            raise TraceFormatError(f"{p}.name: duplicate op name {name!r} (also {path}.ops[{names[name]}])")
        names[name] = i
        _string(_key(o, "type", p), f"{p}.type")
        for k in ("inputs", "control_inputs", "outputs"):
            if k in o:
                _strings(o[k], f"{p}.{k}")
        if "role" in o:
            _role(o["role"], f"{p}.role")
        for k in ("stateful", "replayable", "always_runs"):
            if k in o:
                _bool(o[k], f"{p}.{k}")
    ids: dict[str, int] = {}
    for i, t in enumerate(_list(_key(g, "tensors", path), f"{path}.tensors")):
        p = f"{path}.tensors[{i}]"
        t = _object(t, p)
        tid = _string(_key(t, "id", p), f"{p}.id")
        if tid in ids:
            raise TraceFormatError(f"{p}.id: duplicate tensor id {tid!r} (also {path}.tensors[{ids[tid]}])")
        ids[tid] = i
        _string(_key(t, "op", p), f"{p}.op")
        if "dtype" in t:
            _string(t["dtype"], f"{p}.dtype")
        shape = t.get("shape")
        if shape is not None:
            dims = _list(shape, f"{p}.shape", "null (unknown rank) or a JSON list of integers (-1: unknown dimension)")
            for j, n in enumerate(dims):
                _integer(n, f"{p}.shape[{j}]", minimum=-1, expected="an integer >= -1 (-1: unknown dimension)")
        if "nbytes" in t:
            _integer(t["nbytes"], f"{p}.nbytes", minimum=-1, expected=f"{_SIZE} or -1 (unknown)")
        if "consumers" in t:
            _strings(t["consumers"], f"{p}.consumers")
        if "persistent" in t:
            _bool(t["persistent"], f"{p}.persistent")
    try:
        return GraphModel.from_json(g)
    except GraphModelError as e:
        raise TraceFormatError(f"{path}: {_one_line(str(e))}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a field this check does not know of
        raise TraceFormatError(f"{path}: malformed ({type(e).__name__}: {_one_line(str(e))})") from None


def _parse_trace(cls: type, d: Any) -> AccessTrace:
    _object(d, "trace")
    if d.get("kind") != TRACE_KIND:
        raise TraceFormatError(
            f"trace.kind: not a capuchin_tf access trace (expected {TRACE_KIND!r}, got {_show(d.get('kind'))})"
        )
    if d.get("schema_version") != SCHEMA_VERSION:
        raise TraceFormatError(
            f"trace.schema_version: trace schema version {_show(d.get('schema_version'))} is not supported "
            f"(this is {SCHEMA_VERSION})"
        )
    peak_bytes = _integer(_key(d, "peak_bytes", "trace"), "trace.peak_bytes")
    persistent_bytes = _integer(_key(d, "persistent_bytes", "trace"), "trace.persistent_bytes")
    evicted_bytes = _integer(d.get("evicted_bytes", 0), "trace.evicted_bytes")
    stall_time = _seconds(d.get("stall_time", 0.0), "trace.stall_time")
    step_time = _seconds(_key(d, "step_time", "trace"), "trace.step_time")
    budget_bytes = d.get("budget_bytes")
    if budget_bytes is not None:
        budget_bytes = _integer(budget_bytes, "trace.budget_bytes", expected=f"null (no budget) or {_SIZE}")
    meta = dict(_object(d.get("meta", {}), "trace.meta"))
    graph = _check_graph(_key(d, "graph", "trace"))

    ops: list[OpRecord] = []
    pos: dict[str, int] = {}
    for i, o in enumerate(_list(_key(d, "ops", "trace"), "trace.ops")):
        p = f"trace.ops[{i}]"
        _entry(o, p, ("name", "type", "start", "duration", "role"))
        name = _string(o[0], f"{p}[0] (name)")
        if name in pos:
            raise TraceFormatError(f"{p}[0] (name): op {name!r} appears twice in the executed ops "
                                   f"(also trace.ops[{pos[name]}])")
        pos[name] = i
        start = _seconds(o[2], f"{p}[2] (start)")
        if ops and start < ops[-1].start:
            raise TraceFormatError(f"{p}[2] (start): ops are in executed order, so their start times never go "
                                   f"backwards, but {start!r} is before {ops[-1].start!r}, the start of "
                                   f"trace.ops[{i - 1}]")
        ops.append(OpRecord(name, _string(o[1], f"{p}[1] (type)"), start, _seconds(o[3], f"{p}[3] (duration)"),
                            _role(o[4], f"{p}[4] (role)")))

    tensors: dict[str, TensorRecord] = {}
    where: dict[str, int] = {}
    for i, t in enumerate(_list(_key(d, "tensors", "trace"), "trace.tensors")):
        p = f"trace.tensors[{i}]"
        t = _object(t, p)
        tid = _string(_key(t, "id", p), f"{p}.id")
        if tid in where:
            raise TraceFormatError(f"{p}.id: duplicate tensor id {tid!r} (also trace.tensors[{where[tid]}])")
        where[tid] = i
        nbytes = _integer(_key(t, "nbytes", p), f"{p}.nbytes")
        alloc = _seconds(_key(t, "alloc", p), f"{p}.alloc")
        free = _key(t, "free", p)
        if free is not None:
            free = _seconds(free, f"{p}.free", f"null (alive at the step's end) or {_SECONDS}")
            if free < alloc:
                raise TraceFormatError(f"{p}.free: a tensor is freed after it is allocated, but {free!r} is before "
                                       f"its alloc {alloc!r}")
        accesses: list[Access] = []
        for j, a in enumerate(_list(_key(t, "accesses", p), f"{p}.accesses")):
            q = f"{p}.accesses[{j}]"
            _entry(a, q, ("index", "time", "op"))
            if not (_is_number(a[0]) and a[0] == j):
                _fail(f"{q}[0] (index)", f"{j} (accesses are numbered 0, 1, ... in time order)", a[0])
            time = _seconds(a[1], f"{q}[1] (time)")
            if accesses and time < accesses[-1].time:
                raise TraceFormatError(f"{q}[1] (time): accesses are in time order, but {time!r} is before "
                                       f"{accesses[-1].time!r}, the time of access {j - 1}")
            op = _string(a[2], f"{q}[2] (op)")
            if op not in pos:
                raise TraceFormatError(f"{q}[2] (op): {_show(op)} is not an executed op of the trace (trace.ops)")
            accesses.append(Access(tid, j, time, op))
        tensors[tid] = TensorRecord(tid, nbytes, alloc, free, tuple(accesses))

    curve: list[tuple[float, int]] = []
    for i, point in enumerate(_list(_key(d, "memory_curve", "trace"), "trace.memory_curve")):
        p = f"trace.memory_curve[{i}]"
        _entry(point, p, ("time", "bytes"))
        time = _seconds(point[0], f"{p}[0] (time)")
        if curve and time < curve[-1][0]:
            raise TraceFormatError(f"{p}[0] (time): the memory curve is in time order, but {time!r} is before "
                                   f"{curve[-1][0]!r}, the time of trace.memory_curve[{i - 1}]")
        curve.append((time, _integer(point[1], f"{p}[1] (bytes)")))

    released: list[tuple[float, int]] = []
    for i, r in enumerate(_list(d.get("released", ()), "trace.released")):
        p = f"trace.released[{i}]"
        _entry(r, p, ("time", "bytes"))
        released.append((_seconds(r[0], f"{p}[0] (time)"), _integer(r[1], f"{p}[1] (bytes)")))

    return cls(
        graph=graph,
        ops=tuple(ops),
        tensors=tensors,
        memory_curve=tuple(curve),
        step_time=step_time,
        peak_bytes=peak_bytes,
        persistent_bytes=persistent_bytes,
        evicted_bytes=evicted_bytes,
        stall_time=stall_time,
        budget_bytes=budget_bytes,
        meta=meta,
        released=tuple(released),
    )


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
