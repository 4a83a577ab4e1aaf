"""Recovery: what a step writes, host copies of it, and what a failed attempt may have written.

A managed step that fails part-way (out of memory in a guided step, an error capuchin_tf's graph caused) must leave
the model as it was before the call, so that a retry, or a plain TensorFlow run of the same step, never applies an
update twice (design.md, "Never worse than failing loudly"). This module answers three questions on the step's
optimized GraphDef, the graph the executor runs, where conds and loops are lowered and every write is a node:

- `state_writes`: which captured resources the step may write. A write is any op that takes a resource input and is
  not a pure read (ReadVariableOp, ResourceGather, ...): variable assignments and optimizer applies, but also
  `tf.random.Generator`'s RngReadAndSkip and Keras' seed generators, in cond branches and loop bodies alike. A
  resource is found by following its handle back through Identity, Switch, Merge, Enter and Exit to the function
  argument it came in by, i.e. to one of the function's captures. A write to anything else (a resource the step
  creates, a lookup table, an iterator) cannot be undone: `StateWrites.unknown` names it, and the runtime then
  refuses to manage the step.
- `Snapshot`: host copies of those resources, taken before an attempt and assigned back after a failure.
- `possibly_written`: after an attempt failed at node X, the resources that may have been written: those of every
  writer that does not depend on X (X's descendants cannot have run).
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import tensorflow as tf

from capuchin_tf.tf import capture, ops

# Ops that take a resource and never change it.
READ_ONLY_RESOURCE_OPS = frozenset({
    "ReadVariableOp", "_ReadVariablesOp", "ResourceGather", "ResourceGatherNd", "VariableShape",
    "VarIsInitializedOp", "_Retval", "Capuchin>Hold", "Capuchin>Get",
    # Lookup tables read (Keras' TextVectorization, StringLookup, IntegerLookup in a model's step)
    "LookupTableFindV2", "LookupTableFind", "LookupTableSizeV2", "LookupTableSize", "LookupTableExportV2",
    "LookupTableExport",
})
# Ops that pass a resource handle through (to the op that uses it).
HANDLE_PASS_THROUGH_OPS = frozenset({
    "Identity", "IdentityN", "Switch", "RefSwitch", "Merge", "RefMerge", "Enter", "RefEnter", "Exit", "RefExit",
    "NextIteration", "RefNextIteration",
})


def _split(ref: str) -> tuple[str, int]:
    name, _, slot = ref.lstrip("^").partition(":")
    return name, int(slot) if slot else 0


@dataclasses.dataclass(frozen=True)
class StateWrites:
    """What a step's graph writes: writer node -> the indices (into the function's captures) of the resources it
    may write; `unknown`: writers of a resource that is not a capture (cannot be snapshotted)."""

    writers: Mapping[str, tuple[int, ...]]
    unknown: tuple[str, ...] = ()

    @property
    def captures(self) -> tuple[int, ...]:
        """Every capture index any writer may write, sorted."""
        return tuple(sorted({i for idx in self.writers.values() for i in idx}))


def _capture_sources(nodes: Mapping, args: Mapping[str, int], n_user_inputs: int, ref: str) -> set[int] | None:
    """Capture indices a resource handle `ref` may come from (through HANDLE_PASS_THROUGH_OPS); None if some path
    ends elsewhere (a resource the caller passed in, or one the step makes)."""
    found: set[int] = set()
    stack, seen = [_split(ref)], set()
    while stack:
        name, slot = stack.pop()
        if (name, slot) in seen:
            continue
        seen.add((name, slot))
        node = nodes.get(name)
        if node is None:
            return None
        if name in args:
            if args[name] < n_user_inputs:
                return None  # a resource passed in by the caller, not a capture
            found.add(args[name] - n_user_inputs)
        elif node.op in HANDLE_PASS_THROUGH_OPS:
            data = [i for i in node.input if not i.startswith("^")]
            if node.op in ("Merge", "RefMerge"):
                stack.extend(_split(i) for i in data)
            elif node.op == "IdentityN":
                stack.append(_split(data[slot]))
            elif data:
                stack.append(_split(data[0]))
        else:
            return None
    return found


def state_writes(graph_def, n_user_inputs: int) -> StateWrites:
    """The writes of a step's optimized GraphDef (see the module docstring). Its `_Arg` nodes are the function's
    inputs by index: the user's `n_user_inputs` first, then the captures."""
    nodes = {n.name: n for n in graph_def.node}
    args = {n.name: n.attr["index"].i for n in graph_def.node if n.op == "_Arg"}

    def sources(ref: str) -> set[int] | None:
        return _capture_sources(nodes, args, n_user_inputs, ref)

    writers: dict[str, tuple[int, ...]] = {}
    unknown: list[str] = []
    for node in graph_def.node:
        if node.op in READ_ONLY_RESOURCE_OPS or node.op in HANDLE_PASS_THROUGH_OPS:
            continue
        data = [i for i in node.input if not i.startswith("^")]
        indices = set()
        for k in capture.resource_inputs(node):
            if k >= len(data):
                continue
            found = sources(data[k])
            if found is None:
                unknown.append(f"{node.name} ({node.op})")
                break
            indices |= found
        else:
            if indices:
                writers[node.name] = tuple(sorted(indices))
    return StateWrites(writers=writers, unknown=tuple(unknown))


def possibly_written(graph_def, writes: StateWrites, failed_node: str | None) -> set[int] | None:
    """The capture indices an attempt that failed at `failed_node` may have written: those of every writer that does
    not depend on it. None when unknown (the node is not in the graph): assume everything."""
    if failed_node is None:
        return None
    successors: dict[str, list[str]] = collections.defaultdict(list)
    names = set()
    for node in graph_def.node:
        names.add(node.name)
        for i in node.input:
            successors[_split(i)[0]].append(node.name)
    if failed_node not in names:
        return None
    after, stack = {failed_node}, [failed_node]
    while stack:
        for s in successors[stack.pop()]:
            if s not in after:
                after.add(s)
                stack.append(s)
    return {i for w, idx in writes.writers.items() if w not in after for i in idx}


def failed_node(error: Exception) -> str | None:
    """The node a TensorFlow error names last (`{{node X}}`), if any."""
    m = re.findall(r"\{\{node ([^}]+)\}\}", str(error))
    return m[-1] if m else None


def variable_dtype(handle) -> tf.DType | None:
    """The dtype of the variable a captured resource handle refers to; None if it is not a variable's handle (a
    lookup table, an iterator, a mutex: nothing ReadVariableOp and AssignVariableOp can copy)."""
    found = capture.variable_shapes_and_dtypes(handle)
    if not found:
        return None
    dtype = found[0][0]
    return None if dtype in (tf.resource, tf.variant, tf.string) else dtype


# A copy that keeps the interpreter's lock (ctypes' PYFUNCTYPE: the call does not release it, where numpy's copies
# and EagerTensor.numpy() do). While a plan is built in the background, each release by the step's thread is a wait of
# up to the switch interval for the build's thread to hand the lock back: 250 variables cost 80-85 ms a snapshot
# against 5 ms quiet (docs/decisions.md, "One call for the host snapshot").
_memmove_holding_the_lock = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                              ctypes.c_size_t)(ctypes._memmove_addr)


def _host_view(value) -> np.ndarray:
    """A CPU tensor's buffer as an array, without a copy and without releasing the interpreter's lock (the buffer
    protocol); `.numpy()` (a copy) for the dtypes it does not carry (bfloat16)."""
    try:
        return np.asarray(memoryview(value))
    except (ValueError, TypeError, BufferError):
        return value.numpy()


def _copy_holding_the_lock(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src for arrays of one shape and dtype, by one memmove that keeps the interpreter's lock when both
    are contiguous (np.copyto otherwise)."""
    if dst.flags.c_contiguous and src.flags.c_contiguous and dst.nbytes == src.nbytes:
        if dst.nbytes:
            _memmove_holding_the_lock(dst.ctypes.data, src.ctypes.data, dst.nbytes)
    else:
        np.copyto(dst, src)


class Snapshot:
    """Host copies of resource variables, given by their handles (a function's captures)."""

    def __init__(self, handles: Sequence, indices: Iterable[int]):
        self.handles = list(handles)
        self.indices = tuple(indices)
        self.dtypes = {}
        for i in self.indices:
            dtype = variable_dtype(self.handles[i])
            if dtype is None:
                raise ValueError(f"capture {i} is a resource that is not a variable")
            self.dtypes[i] = dtype
        self.values: dict[int, np.ndarray] = {}
        self._read = None

    def take(self) -> Snapshot:
        """Copies every variable's value to host memory. From the second snapshot on, the values are read by one
        TensorFlow call (a function of ReadVariableOps, each output the variable's own buffer, nothing allocated)
        rather than one call a variable: the step's thread hands the interpreter's lock over at each TensorFlow call,
        and while a plan is built in the background each handover can wait for the build's thread. The first
        snapshot (the measured step's) reads them one by one: the function costs 0.2-0.5 s to make (docs/decisions.md,
        "One call for the host snapshot")."""
        if not self.indices:
            self.values = {}
            return self
        if not self.values:
            read = [tf.raw_ops.ReadVariableOp(resource=self.handles[i], dtype=self.dtypes[i]) for i in self.indices]
        else:
            if self._read is None:  # the handles are captured: a call with no arguments binds nothing in Python
                pairs = [(self.handles[i], self.dtypes[i]) for i in self.indices]
                self._read = tf.function(lambda: [tf.raw_ops.ReadVariableOp(resource=h, dtype=d) for h, d in pairs],
                                         autograph=False)
            read = self._read()
        values = {}
        for i, value in zip(self.indices, read):
            value = _host_view(value)
            kept = self.values.get(i)
            # The last snapshot's host buffers are reused when the value keeps its shape: writing pages already
            # mapped costs a copy; new ones cost a page fault every 4 KiB on top of it.
            if kept is not None and kept.shape == value.shape and kept.dtype == value.dtype:
                _copy_holding_the_lock(kept, value)
                values[i] = kept
            else:
                values[i] = np.array(value, copy=True)
        self.values = values
        return self

    def restore(self, only: Iterable[int] | None = None) -> None:
        """Assigns the copies back: to every resource, or to those whose index is in `only`."""
        only = None if only is None else set(only)
        for i, value in self.values.items():
            if only is not None and i not in only:
                continue
            # Written into the variable's own buffer (ops.assign_in_place), so that a restore allocates nothing on
            # the device and moves no variable (restored variables scattered over the device split its free
            # memory). Not AssignVariableOp: it takes over its value's buffer, here host memory backed by the numpy
            # array. Not ResourceStridedSliceAssign: it puts the variable in copy-on-read mode for good, after which
            # every read of the variable copies it and every update copies it to a new buffer, in every later step,
            # and those copies split the free memory too (docs/decisions.md, "A failed attempt restores only what it
            # may have written, in place, before anything else").
            ops.assign_in_place(self.handles[i], tf.constant(value, dtype=self.dtypes[i]))


@dataclasses.dataclass(frozen=True)
class Compaction:
    """What `compact_variables` did: how many variables it laid out again and their bytes, and the device's largest
    free run before and after."""

    variables: int
    bytes: int
    largest_free_before: int
    largest_free_after: int


def shared_variable_bytes(handles: Sequence) -> int:
    """The bytes the variables among `handles` will own that the device does not hold yet: variables that share one
    buffer (TensorFlow initializes every zeros slot of a shape from one cached zeros tensor: Adam's m and v, EMA copies,
    gradient accumulators) each take a buffer of their own at their first write, and when compact_variables lays them
    out. What counts as persistent state before the step has run is `current` plus these."""
    buffers: dict[int, list[int]] = {}
    for h in _variable_handles(handles):
        value = tf.raw_ops.ReadVariableOp(resource=h, dtype=variable_dtype(h))._numpy()  # the buffer itself on CPU
        if value.nbytes:
            buffers.setdefault(value.__array_interface__["data"][0], []).append(value.nbytes)
    return sum(sum(sizes) - max(sizes) for sizes in buffers.values())


def _variable_handles(handles: Sequence) -> list:
    """The initialized variables among `handles`, each once (one a step creates is initialized at its first call)."""
    seen, out = set(), []
    for h in handles:
        if id(h) in seen or variable_dtype(h) is None:
            continue
        if not bool(tf.raw_ops.VarIsInitializedOp(resource=h)):
            continue
        seen.add(id(h))
        out.append(h)
    return out


def compact_variables(handles: Sequence) -> Compaction | None:
    """Lays the variables among `handles` (a function's captures) out again in one run of the simulated device's
    memory, largest first, and returns what it did; None when the device is not the simulated one (no memory map to
    read) or there is nothing to move. Values and shapes are unchanged, bit for bit.

    Why: a model's variables are placed wherever BFC's best fit put them while the model was built, between the
    temporaries of their initializers; when those temporaries are freed, the variables stay scattered, and the holes
    between them are all the room a step has. On a device the size of the budget, a step can then fail for want of
    one free run of a few MiB with far more free in pieces (docs/decisions.md, "Variables are laid out again before
    the measured step"). Freed and allocated again one after the other, the variables fill one run, and the step's
    free memory is one run too.

    How: host copies of every variable; each variable set to an empty tensor (its buffer freed); then, largest first,
    each allocated again from its copy. With the largest free run then at least the variables' bytes (the usual case:
    the device holds little else between steps), every allocation fits (BFC on the simulated device splits chunks
    exactly, and best fit leaves that run at least as large as what is still to come). Otherwise an allocation can
    fail: then the variables not yet placed adopt their host copies (values intact, outside the device) and
    CompactionError is raised. The small-tensor pool is off while the variables are placed, and on after (the state
    of a managed call).
    """
    stats = ops.allocator_stats()
    if not stats["wrapped"] or stats["largest_free"] < 0:
        return None
    variables = _variable_handles(handles)
    if not variables:
        return None
    dtypes = [variable_dtype(h) for h in variables]
    values = [np.array(tf.raw_ops.ReadVariableOp(resource=h, dtype=d), copy=True) for h, d in zip(variables, dtypes)]
    order = sorted(range(len(variables)), key=lambda i: -values[i].nbytes)
    moved = sum(v.nbytes for v in values)
    before = stats["largest_free"]
    ops.set_small_pool(False)  # every variable on the device proper, whatever its size (the pool is for transients)
    try:
        for h, d in zip(variables, dtypes):
            tf.raw_ops.AssignVariableOp(resource=h, value=tf.zeros([0], d), validate_shape=False)
        try:
            for i in order:
                # A device copy of the host value (Snapshot allocates it), which the variable takes over
                # (AssignVariableOp adopts its value's buffer): one allocation per variable, one after the other.
                copy = tf.raw_ops.Snapshot(input=tf.constant(values[i], dtype=dtypes[i]))
                tf.raw_ops.AssignVariableOp(resource=variables[i], value=copy, validate_shape=False)
                del copy
        except tf.errors.ResourceExhaustedError as e:
            for h, d, value in zip(variables, dtypes, values):
                if tf.raw_ops.VariableShape(input=h).numpy().tolist() != list(value.shape):
                    tf.raw_ops.AssignVariableOp(resource=h, value=tf.constant(value, dtype=d), validate_shape=False)
            raise CompactionError(
                f"capuchin_tf: the device's memory is split so that its {len(variables)} variables "
                f"({moved / 2**20:.2f} MiB) could not be laid out again in it ({e.message.splitlines()[0]}); their "
                "values are unchanged") from e
    finally:
        ops.set_small_pool(True)
    return Compaction(len(variables), moved, before, ops.allocator_stats()["largest_free"])


class CompactionError(RuntimeError):
    """`compact_variables` could not allocate the variables again (see there)."""
