"""Helpers for the pure tests: hand-made traces, including the paper's T1 -> T2 -> T3 -> T4 chain (paper.md §1.7)."""

from __future__ import annotations

import pytest

from capuchin_tf.core.graph_model import Role
from capuchin_tf.core.synthetic import TraceBuilder

MB = 1 << 20
MS = 1e-3
FWD, BWD = Role.FORWARD, Role.BACKWARD


def paper_chain(t3_backward: str | None = None, sizes=(1, 1, 1, 1), durations=(1, 1, 1, 1), stateful_op3=False):
    """x -> op1 -> T1 -> op2 -> T2 -> op3 -> T3 -> op4 -> T4 -> big -> F -> loss; backward reads T4, then T2, then T1.

    A large temporary F at the end of the forward pass makes the peak; T1, T2 and T4 are alive across it (the
    candidates); T3's last use is T4's forward op unless `t3_backward` is
    ``"after"`` (T3 is also read by a backward op after T4's back-access) or ``"before"`` (read by a backward op
    before T4's back-access)."""
    b = TraceBuilder(gap_s=1e-6)
    x = b.persistent("x", MB)
    (t1,) = b.op("op1", "MatMul", (x,), (sizes[0] * MB,), duration=durations[0] * MS)
    (t2,) = b.op("op2", "Relu", (t1,), (sizes[1] * MB,), duration=durations[1] * MS)
    (t3,) = b.op("op3", "MatMul", (t2,), (sizes[2] * MB,), duration=durations[2] * MS, stateful=stateful_op3)
    (t4,) = b.op("op4", "Relu", (t3,), (sizes[3] * MB,), duration=durations[3] * MS)
    (f,) = b.op("big", "MatMul", (t4,), (8 * MB,), duration=2 * MS)
    (loss,) = b.op("loss", "Sum", (f,), (4,), duration=0.1 * MS)
    g = loss
    if t3_backward == "before":
        (g,) = b.op("b3", "MatMul", (g, t3), (MB,), role=BWD, duration=MS)
    (g,) = b.op("b4", "ReluGrad", (g, t4), (MB,), role=BWD, duration=MS)
    if t3_backward == "after":
        (g,) = b.op("b3", "MatMul", (g, t3), (MB,), role=BWD, duration=MS)
    (g,) = b.op("b2", "ReluGrad", (g, t2), (MB,), role=BWD, duration=MS)
    (g,) = b.op("b1", "MatMul", (g, t1), (MB,), role=BWD, duration=MS)
    return b.build()


@pytest.fixture
def chain_trace():
    return paper_chain()
