"""The synthetic trace generator follows the trace format's rules."""

import pytest

from capuchin_tf.core import synthetic
from capuchin_tf.core.access_trace import AccessTrace
from capuchin_tf.core.graph_model import Role
from capuchin_tf.core.trace_index import TraceIndex

GENERATORS = {
    "chain": lambda: synthetic.linear_chain(4),
    "resnet": lambda: synthetic.resnet(2),
    "transformer": lambda: synthetic.transformer(1),
    "transformer_tf_like": lambda: synthetic.transformer(1, tf_like=True, optimizer="adamw_ops"),
    "random": lambda: synthetic.random_model(7),
}


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_traces_follow_the_access_rules(name):
    trace = GENERATORS[name]()
    ops = {o.name: o for o in trace.ops}
    trace.graph.check()
    assert trace.step_time == pytest.approx(trace.ops[-1].end)
    roles = {o.role for o in trace.ops}
    assert {Role.FORWARD, Role.BACKWARD, Role.OPTIMIZER} <= roles
    for tid, rec in trace.tensors.items():
        info = trace.graph.tensors[tid]
        assert not info.persistent
        prod = ops[info.op]
        a0 = rec.accesses[0]
        assert a0.op == prod.name and a0.time == pytest.approx(prod.end)  # production at the producer's end
        assert rec.alloc == pytest.approx(prod.start)
        for a in rec.accesses[1:]:
            assert a.time == pytest.approx(ops[a.op].start)  # reads at the consumer's start
            assert a.op in info.consumers
        assert [a.index for a in rec.accesses] == list(range(len(rec.accesses)))
        assert rec.free == pytest.approx(ops[rec.accesses[-1].op].end)
    assert trace.memory_curve == tuple(trace.replayed_curve())
    assert trace.peak_bytes == trace.replayed_peak_bytes()
    assert trace.persistent_bytes == sum(t.nbytes for t in trace.graph.tensors.values() if t.persistent)
    assert trace.meta["flops"] > 0
    again = AccessTrace.from_json(trace.to_json())
    assert again.replayed_curve() == trace.replayed_curve()


def test_backward_ops_read_the_forward_activations():
    trace = synthetic.resnet(2)
    idx = TraceIndex(trace)
    read_back = [
        t for t, v in idx.tensors.items()
        if idx.op_role[v.prod_pos] == Role.FORWARD and any(idx.op_role[p] == Role.BACKWARD for p in v.acc_pos)
    ]
    assert {"stem/Relu:0", "block_0/relu1:0", "block_0/relu2:0", "block_1/relu1:0", "block_1/relu2:0"} <= set(read_back)
    types = {o.type for o in trace.ops if o.role == Role.BACKWARD}
    assert {"Conv2DBackpropInput", "Conv2DBackpropFilter", "ReluGrad", "AddN"} <= types


def test_stateful_random_ops_are_not_replayable():
    trace = synthetic.transformer(1, stateful_dropout=True)
    rnd = [o for o in trace.graph.ops.values() if o.type == "RandomUniform"]
    assert rnd and all(o.stateful and not o.replayable for o in rnd)


def test_bert_base_is_about_ten_thousand_tensors():
    trace = synthetic.bert_base()
    assert 9000 <= len(trace.tensors) <= 12000
    assert sum(1 for o in trace.ops if o.type == "BatchMatMulV2" and o.role == Role.FORWARD) == 24  # 12 blocks


def test_budget_fraction():
    trace = synthetic.linear_chain(2)
    transient = trace.replayed_peak_bytes() - trace.persistent_bytes
    assert synthetic.budget_fraction(trace, 0.5) == int(trace.persistent_bytes + transient / 2)
