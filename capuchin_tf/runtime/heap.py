"""The interpreter's cycle collector while capuchin_tf does its own Python work (a signature's first call, a plan
built in the background).

A full collection walks every object the collector tracks: with TensorFlow, Keras and a model loaded that is
400,000-520,000 objects (bert-4l through keras-hub), 0.2-0.5 s a walk, and a signature's first call (capture,
measured step, trace, planning) allocates enough to set off five of them (1.3-1.5 s of its 7-8 s on bert-4l), a
background build two or three (about 1 s of its time). Almost none of those objects is garbage: they are the
modules and the model.

`young_heap()` scopes that work: on entry the tracked objects are frozen (`gc.freeze`: moved where collections do not
walk them), and so are the survivors of every collection of generation 1 or 2 inside the scope, so the collections
inside walk only what the scope made since; on exit everything frozen goes back to the oldest generation
(`gc.unfreeze`), and cyclic garbage made meanwhile is found by the next full collection, as it would have been.
Nothing is kept from the collector beyond the scope. Scopes nest and overlap across threads (a build runs beside
the steps): the heap is unfrozen when the last one ends. A process whose collector is off, or that froze objects
itself, is left alone (docs/decisions.md, "The cycle collector during capuchin_tf's own work").
"""

from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_state = {"depth": 0, "owned": False}


def _freeze_survivors(phase: str, info: dict) -> None:
    if phase == "stop" and info.get("generation", 0) >= 1:
        gc.freeze()


@contextlib.contextmanager
def young_heap():
    with _lock:
        if _state["depth"] == 0:
            _state["owned"] = gc.isenabled() and gc.get_freeze_count() == 0
            if _state["owned"]:
                gc.freeze()
                gc.callbacks.append(_freeze_survivors)
        _state["depth"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["depth"] -= 1
            if _state["depth"] == 0 and _state["owned"]:
                gc.callbacks.remove(_freeze_survivors)
                gc.unfreeze()
                _state["owned"] = False
