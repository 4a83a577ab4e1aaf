"""The runtime's errors and what they quote: the out-of-memory line, what the device's bytes in use were, and what a
planning failure keeps (its trace and its error, for `python -m capuchin_tf plan --replay`)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import re
import traceback
from collections.abc import Mapping

from capuchin_tf import _version
from capuchin_tf.core.budget import format_bytes

FAILURE_KIND = "capuchin_tf planning failure"


# Paragraphs of a TensorFlow graph error that frame its message rather than say it.
_FRAME = ("Graph execution error", "Detected at node", "Detected unsupported operations", "<stack traces", "File \"")
_NODE = re.compile(r"\[\[\{\{node ([^}]+)\}\}\]\]|Detected at node '?([^'\s]+)'? defined at")


def oom_line(error: Exception) -> str:
    """The line of an error's message that says what could not be allocated, else what went wrong, at most 300
    characters: what the CLIs and CapuchinError quote. A TensorFlow graph error's first line is only "Graph execution
    error:" and its stack follows: its message is the first paragraph after them, with the node it names."""
    text = str(error)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()] or [""]
    oom = next((ln for ln in lines if "OOM when allocating" in ln), None)
    if oom is not None:
        return oom[:300]
    if not lines[0].startswith(_FRAME):
        return lines[0][:300]
    first = None
    for paragraph in re.split(r"\n\s*\n", text):
        said = [ln.strip() for ln in paragraph.splitlines() if ln.strip()]
        if not said or said[0].startswith('File "'):  # a frame of the stack and its code line
            continue
        while said and said[0].startswith(_FRAME):
            said.pop(0)
        if said and not said[0].startswith("[["):
            first = said[0]
            break
    if first is None:
        return lines[0][:300]
    node = _NODE.search(text)
    name = next((g for g in node.groups() if g), None) if node else None
    return (f"{first} (node {name})" if name and name not in first else first)[:300]


def in_use_breakdown(in_use: int, start_bytes: int, stats: Mapping) -> str:
    """What the device's `in_use` bytes at an allocation's refusal were: the persistent state in use when the step
    started, the tensors of capuchin_tf's pool that ops running or waiting to run held, those only the pool held (it
    could have evicted them: they were not where the allocation needed room), and the rest: what capuchin_tf does not
    manage (op temporaries and workspaces, tensors of cond branches and loop bodies, tensors it did not pool, copies
    of variables an update made)."""
    persistent = min(start_bytes, in_use)
    # A pooled tensor can be counted twice: in the small-tensor pool's region (persistent state once the pool is taken)
    # or as a view of an input of the step. So the pool's share is never more than what is left after the persistent
    # state: the pool's share is an upper bound, what capuchin_tf does not manage a lower one.
    shared = min(stats.get("refused_store_shared", 0), in_use - persistent)
    idle = min(stats.get("refused_store_idle", 0), in_use - persistent - shared)
    other = in_use - persistent - shared - idle
    parts = [f"{format_bytes(persistent)} persistent state (variables, optimizer slots, the step's inputs)",
             f"{format_bytes(shared)} of pooled tensors that running or waiting ops held"]
    if idle:
        parts.append(f"{format_bytes(idle)} of pooled tensors elsewhere on the device")
    parts.append(f"{format_bytes(other)} that capuchin_tf does not manage (op temporaries and workspaces, tensors of "
                 "cond branches and loop bodies, tensors it did not pool)")
    return ", ".join(parts)


class CapuchinError(RuntimeError):
    """A managed step failed in a way capuchin_tf cannot recover from, or (strict) a step it cannot manage; the
    message says what, and whether anything was written."""


class BudgetError(CapuchinError):
    """The memory budget is below what the step can ever need (raised before anything runs), or the measured step
    could not complete under it (raised with the variables as they were)."""


class Refusal(Exception):
    """Why capuchin_tf does not manage a signature (internal: ManagedStep._refuse turns it into one warning)."""


def keep_planning_failure(directory: str | os.PathLike, trace, error: BaseException, *, budget_bytes: int,
                          policy: str, planner_options: Mapping, device_model, signature: str = "") -> pathlib.Path:
    """Writes what planning failed on into a new directory under `directory`: the trace (``trace.json``) and
    ``failure.json`` (the error and its traceback, the budget, policy, planner options and device model the planner
    had), so that ``python -m capuchin_tf plan --replay DIR`` plans it again as the runtime did. Returns that
    directory. OSError when it cannot be written."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    root = pathlib.Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    for n in range(1000):
        path = root / f"planning-failure-{stamp}-{os.getpid()}-{n}"
        try:
            path.mkdir()
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"no free name for a planning failure under {root}")
    trace.save(path / "trace.json")
    record = {
        "kind": FAILURE_KIND, "schema_version": 1, "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "capuchin_tf_version": _version.__version__, "signature": signature,
        "error": f"{type(error).__name__}: {error}",
        "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__)),
        "budget_bytes": int(budget_bytes), "policy": policy, "planner_options": dict(planner_options),
        "device_model": dataclasses.asdict(device_model),
        "replay": f"python -m capuchin_tf plan --replay {path}",
    }
    (path / "failure.json").write_text(json.dumps(record, indent=1, default=repr))
    return path
