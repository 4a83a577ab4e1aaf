"""Lowered control flow in a step's graph: which ops always run, and in which frame. Pure Python: no TensorFlow.

By the time a step's graph is optimized, TensorFlow has lowered its conds and loops into dataflow control flow
(tf-notes.md, "Control flow in the optimized graph"):
- a cond is `Switch` nodes (data, predicate) whose untaken output is *dead*, branch ops, and `Merge` nodes that
  forward whichever input is live. Any op other than `Merge` with a dead input, data or control, is dead: it does not
  run and its outputs are dead too. A `Merge` is dead only when all its data inputs are.
- a loop body runs in a frame of its own, entered through `Enter` and left through `Exit` (`NextIteration` feeds the
  next iteration back to a `Merge`). An op may take inputs from one frame only.

capuchin_tf adds control edges (the pinned order, pool gates, swap and recompute triggers), so it must know which
ops *always run* in the step's root frame: an edge from an op that may not run kills its destination whenever the
branch is not taken (an empty loss and a skipped update, with no error), and an edge into or out of a loop frame
fails with "has inputs from different frames". `analyze` answers both:
- `frame`: () for the root frame; a loop body's ops are in (*parent, frame_name) (an `Exit` is in its loop's frame;
  its output is in the parent frame);
- `guard`: a set of literals (predicate tensor, branch taken) that must all hold for the op to run; an empty guard
  means the op runs whenever the step runs. A `Merge` whose live inputs cover both branches of one predicate runs
  whenever their common part holds (a lowered cond's outputs run always); any other `Merge` gets a literal of its own
  that never resolves (it may not run). The analysis is sound: `always_runs` is never claimed for an op that can be
  dead; it may deny it for an op that in fact always runs (only costs memory management there).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
from collections.abc import Iterable, Mapping

ROOT: tuple = ()
SWITCH_OPS = frozenset({"Switch", "RefSwitch"})
MERGE_OPS = frozenset({"Merge", "RefMerge"})
ENTER_OPS = frozenset({"Enter", "RefEnter"})
EXIT_OPS = frozenset({"Exit", "RefExit"})
NEXT_ITERATION_OPS = frozenset({"NextIteration", "RefNextIteration"})
# Every op of lowered control flow: their outputs are never managed, and they are never recomputed.
CONTROL_FLOW_OPS = SWITCH_OPS | MERGE_OPS | ENTER_OPS | EXIT_OPS | NEXT_ITERATION_OPS | {"LoopCond", "ControlTrigger"}

Literal = tuple  # (predicate tensor id, branch 0/1), or ("?", merge name) for a Merge that may not run


@dataclasses.dataclass(frozen=True)
class FlowNode:
    """What the analysis needs of a node: `inputs` are data inputs as "node:slot" (or "node"), `control_inputs`
    node names, `frame_name` the `frame_name` attribute of an Enter (None otherwise)."""

    name: str
    op: str
    inputs: tuple[str, ...] = ()
    control_inputs: tuple[str, ...] = ()
    frame_name: str | None = None


def _split(ref: str) -> tuple[str, int]:
    name, _, slot = ref.partition(":")
    return name, int(slot) if slot else 0


@dataclasses.dataclass(frozen=True)
class ControlFlow:
    """The result of `analyze` (see the module docstring)."""

    frame: Mapping[str, tuple]  # node -> the frame it runs in (ROOT, or the frame names of the loops it is in)
    guard: Mapping[str, frozenset]  # node -> literals that must hold for it to run (root frame only)
    has_control_flow: bool  # any Switch, Merge, Enter or Exit at all

    def always_runs(self, name: str) -> bool:
        """Whether the node runs, exactly once, whenever the step runs: root frame, empty guard."""
        return self.frame.get(name, None) == ROOT and not self.guard.get(name, frozenset({("?", name)}))

    def may_not_run(self) -> set[str]:
        return {n for n in self.frame if not self.always_runs(n)}


def analyze(nodes: Iterable[FlowNode]) -> ControlFlow:
    """Frames and guards of every node (see the module docstring)."""
    nodes = list(nodes)
    by_name = {n.name: n for n in nodes}
    succ: dict[str, list[str]] = collections.defaultdict(list)
    missing: dict[str, int] = {}
    for n in nodes:
        preds = set()
        for ref in n.inputs:
            p = _split(ref)[0]
            if p in by_name and not (n.op in MERGE_OPS and by_name[p].op in NEXT_ITERATION_OPS):
                preds.add(p)
        preds |= {c for c in n.control_inputs if c in by_name}
        preds.discard(n.name)
        missing[n.name] = len(preds)
        for p in preds:
            succ[p].append(n.name)
    queue = collections.deque(n.name for n in nodes if missing[n.name] == 0)
    order = []
    while queue:
        name = queue.popleft()
        order.append(name)
        for s in succ[name]:
            missing[s] -= 1
            if missing[s] == 0:
                queue.append(s)

    frame: dict[str, tuple] = {}  # the frame a node runs in
    out_frame: dict[str, tuple] = {}  # the frame its outputs are in
    guard: dict[str, frozenset] = {}
    out_guard: dict[tuple[str, int], frozenset] = {}  # (node, slot) of a Switch -> its output's guard
    enters: dict[tuple, list[str]] = collections.defaultdict(list)  # loop frame -> its Enter nodes
    has_cf = any(n.op in SWITCH_OPS | MERGE_OPS | ENTER_OPS | EXIT_OPS for n in nodes)

    def data_guard(ref: str) -> frozenset:
        p, slot = _split(ref)
        return out_guard.get((p, slot), guard.get(p, frozenset()))

    for name in order:
        n = by_name[name]
        data = [r for r in n.inputs if _split(r)[0] in by_name]
        ctrl = [c for c in n.control_inputs if c in by_name]
        # frame
        in_frames = [out_frame[_split(r)[0]] for r in data if _split(r)[0] in out_frame]
        in_frames += [out_frame[c] for c in ctrl if c in out_frame]
        f = next((x for x in in_frames if x != ROOT), ROOT)
        if n.op in ENTER_OPS:
            f_in = next((out_frame[_split(r)[0]] for r in data[:1] if _split(r)[0] in out_frame), ROOT)
            frame[name] = (*f_in, n.frame_name or "?")
            out_frame[name] = frame[name]
            enters[frame[name]].append(name)
        elif n.op in EXIT_OPS:
            frame[name] = f
            out_frame[name] = f[:-1]
        else:
            frame[name] = out_frame[name] = f
        # guard
        if n.op in ENTER_OPS:
            g = frozenset().union(*(data_guard(r) for r in data), *(guard.get(c, frozenset()) for c in ctrl))
        elif n.op in EXIT_OPS:
            # The loop's output exists once the loop ends: it runs when the loop's inputs are live.
            loop = frame[name]
            g = frozenset().union(*(guard.get(e, frozenset()) for e in enters.get(loop, ())))
        elif n.op in MERGE_OPS:
            g = _merge_guard(name, [data_guard(r) for r in data
                                    if by_name[_split(r)[0]].op not in NEXT_ITERATION_OPS])
        else:
            g = frozenset().union(*(data_guard(r) for r in data), *(guard.get(c, frozenset()) for c in ctrl))
        guard[name] = g
        if n.op in SWITCH_OPS and len(data) >= 2:
            predicate = data[1] if ":" in data[1] else f"{data[1]}:0"
            out_guard[(name, 0)] = g | {(predicate, 0)}
            out_guard[(name, 1)] = g | {(predicate, 1)}
        if n.op in EXIT_OPS:
            out_guard[(name, 0)] = g
    # Nodes on a cycle (not a valid graph) or never reached: unknown, so never "always runs".
    for n in nodes:
        if n.name not in frame:
            frame[n.name] = ("?",)
            guard[n.name] = frozenset({("?", n.name)})
    return ControlFlow(frame=frame, guard=guard, has_control_flow=has_cf)


def _merge_guard(name: str, inputs: list[frozenset]) -> frozenset:
    """A Merge runs when any of its data inputs is live: the OR of their guards, written as a conjunction when the
    OR reduces to one (common part C, and two inputs whose rest is exactly (q, 0) and (q, 1)); else C plus a literal
    that never resolves."""
    if not inputs:
        return frozenset({("?", name)})
    common = frozenset.intersection(*inputs)
    rests = {g - common for g in inputs}
    if frozenset() in rests:
        return common  # one input runs whenever C holds
    singles = [next(iter(r)) for r in rests if len(r) == 1 and r and next(iter(r))[0] != "?"]
    by_predicate = collections.defaultdict(set)
    for predicate, branch in singles:
        by_predicate[predicate].add(branch)
    if any(branches >= {0, 1} for branches in by_predicate.values()):
        return common
    return common | {("?", name)}


def of_graph_def(graph_def) -> ControlFlow:
    """`analyze` of a GraphDef (any object with `.node`, each with `.name`, `.op`, `.input` and `.attr`)."""
    return analyze(
        FlowNode(name=n.name, op=n.op,
                 inputs=tuple(i for i in n.input if not i.startswith("^")),
                 control_inputs=tuple(i[1:] for i in n.input if i.startswith("^")),
                 frame_name=n.attr["frame_name"].s.decode() if n.op in ENTER_OPS else None)
        for n in graph_def.node)


class IncrementalOrder:
    """A topological order of a graph that edges are added to, refusing any edge that would close a cycle.

    capuchin_tf adds ordering edges computed from estimates of the executor's order; where an estimate is wrong, an
    edge can close a cycle (a global gradient norm makes every gradient a predecessor of every update, so gating a
    gradient's reload on an update's neighbour waits for itself), and TensorFlow refuses the whole graph. Every edge
    goes through `add_edge`, which keeps a topological order (Pearce and Kelly's dynamic topological sort: an edge
    that agrees with the order costs nothing; one that does not searches only the nodes between its ends) and
    returns False, adding nothing, when the edge would close a cycle.
    """

    def __init__(self, nodes: Iterable[str], edges: Iterable[tuple[str, str]], priority: Mapping[str, float] = None):
        self.succ: dict[str, set[str]] = collections.defaultdict(set)
        self.pred: dict[str, set[str]] = collections.defaultdict(set)
        nodes = list(nodes)
        for u, v in edges:
            if u != v:
                self.succ[u].add(v)
                self.pred[v].add(u)
        index = {n: i for i, n in enumerate(nodes)}
        prio = priority or {}
        missing = {n: len(self.pred[n]) for n in nodes}
        heap = [(prio.get(n, -1.0), index[n], n) for n in nodes if missing[n] == 0]
        heapq.heapify(heap)
        order = []
        while heap:
            _, _, n = heapq.heappop(heap)
            order.append(n)
            for s in self.succ[n]:
                missing[s] -= 1
                if missing[s] == 0:
                    heapq.heappush(heap, (prio.get(s, -1.0), index[s], s))
        if len(order) != len(nodes):
            stuck = sorted(n for n, k in missing.items() if k > 0)[:5]
            raise ValueError(f"the graph has a cycle already (nodes never ready: {stuck} ...)")
        self.ord: dict[str, float] = {n: float(i) for i, n in enumerate(order)}
        self._sorted: list[float] = [float(i) for i in range(len(order))]

    def __contains__(self, node: str) -> bool:
        return node in self.ord

    def add_node(self, node: str, after: Iterable[str] = (), before: str | None = None) -> None:
        """A new node with edges from `after` (its inputs), placed right after the latest of them, or, with `before`
        (the node it will feed) later than them, right before that node: edges added to it later from nodes between
        its inputs and its reader then agree with the order and cost nothing. Where it is placed changes no answer
        of `add_edge` or `reaches`, only what they cost."""
        after = [a for a in after if a in self.ord]
        low = max((self.ord[a] for a in after), default=-1.0)
        i = bisect.bisect_right(self._sorted, low)
        if before in self.ord and self.ord[before] > low:
            i = bisect.bisect_left(self._sorted, self.ord[before])
            high = self._sorted[i]
            low = self._sorted[i - 1] if i > 0 else high - 2.0  # the node before it: at or after every input
        else:
            high = self._sorted[i] if i < len(self._sorted) else low + 2.0
        new = (low + high) / 2
        if not low < new < high:  # no float left between them: renumber everything, spaced again
            self._renumber()
            return self.add_node(node, after, before)
        self.ord[node] = new
        self._sorted.insert(i, new)
        for a in after:
            self.succ[a].add(node)
            self.pred[node].add(a)

    def _renumber(self) -> None:
        for i, n in enumerate(sorted(self.ord, key=self.ord.__getitem__)):
            self.ord[n] = float(i)
        self._sorted = [float(i) for i in range(len(self.ord))]

    def reaches(self, u: str, v: str) -> bool:
        """Whether there is a path u -> ... -> v."""
        if u == v:
            return True
        limit = self.ord[v]
        if self.ord[u] > limit:
            return False
        stack, seen = [u], {u}
        while stack:
            for s in self.succ[stack.pop()]:
                if s == v:
                    return True
                if s not in seen and self.ord[s] < limit:
                    seen.add(s)
                    stack.append(s)
        return False

    def add_edge(self, u: str, v: str) -> bool:
        """Adds u -> v (v after u) unless it closes a cycle; True when the edge is (or already was) in the graph."""
        if u == v:
            return False
        if v in self.succ[u]:
            return True
        lo, hi = self.ord[v], self.ord[u]
        if lo < hi:
            # Forward from v among nodes not after u: reaching u closes a cycle.
            forward, stack = {v}, [v]
            while stack:
                for s in self.succ[stack.pop()]:
                    if s == u:
                        return False
                    if s not in forward and self.ord[s] < hi:
                        forward.add(s)
                        stack.append(s)
            backward, stack = {u}, [u]
            while stack:
                for p in self.pred[stack.pop()]:
                    if p not in backward and self.ord[p] > lo:
                        backward.add(p)
                        stack.append(p)
            # The nodes that must precede u keep their relative order, then the nodes after v: into the same slots.
            moved = sorted(backward, key=self.ord.__getitem__) + sorted(forward, key=self.ord.__getitem__)
            slots = sorted(self.ord[n] for n in moved)
            for n, o in zip(moved, slots):
                self.ord[n] = o
        self.succ[u].add(v)
        self.pred[v].add(u)
        return True
