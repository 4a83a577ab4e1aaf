"""The simulator on hand-made traces with hand-computed timings, and its rejection of infeasible plans."""

import dataclasses

import pytest
from conftest import MB, MS

from capuchin_tf.core import synthetic
from capuchin_tf.core.device_model import DeviceModel
from capuchin_tf.core.plan import AccessRef, Plan, RecomputeDecision, SwapDecision
from capuchin_tf.core.synthetic import TraceBuilder
from capuchin_tf.core.trace_index import TraceIndex
from capuchin_tf.policy.simulator import InfeasiblePlanError, check_decisions, lower_bound_s, simulate

LINK = DeviceModel.symmetric(MB / MS)  # 1 MiB per ms: a 1 MiB copy takes 1 ms


def five_ops(gap_s=0.0, g_reads_b=True):
    """a [0,1] -> A; f1 [1,2] reads A -> B; f2 [2,6] reads B -> C; f3 [6,10] reads C -> D; g [10,11] reads D, A, C
    (and B). Times in ms with gap 0; every tensor 1 MiB."""
    b = TraceBuilder(gap_s=gap_s)
    (A,) = b.op("a", "Fill", (), (MB,), duration=1 * MS)
    (B,) = b.op("f1", "MatMul", (A,), (MB,), duration=1 * MS)
    (C,) = b.op("f2", "MatMul", (B,), (MB,), duration=4 * MS)
    (D,) = b.op("f3", "MatMul", (C,), (MB,), duration=4 * MS)
    b.op("g", "AddN", (D, A, C) + ((B,) if g_reads_b else ()), (MB,), duration=1 * MS)
    return b.build()


def ref(trace, tensor, index):
    a = trace.tensors[tensor].accesses[index]
    return AccessRef(tensor, index, a.op, a.time)


def op_ref(trace, op):
    """An access made by `op` (its first output's production)."""
    return ref(trace, f"{op}:0", 0)


def swap(trace, tensor, ev, back, trigger_op):
    return SwapDecision(
        tensor, MB, ref(trace, tensor, ev), ref(trace, tensor, back),
        None if trigger_op is None else op_ref(trace, trigger_op), 0.0, 1 * MS, 1 * MS,
    )


def recompute(trace, tensor, ev, back, ops, sources=(), trigger=None, mode="on-demand"):
    back_ref = ref(trace, tensor, back)
    return RecomputeDecision(
        tensor, MB, ref(trace, tensor, ev), back_ref, tuple(sources), tuple(ops),
        back_ref if trigger is None else op_ref(trace, trigger), mode,
        recompute_s=sum(o.duration for o in trace.ops if o.name in ops),
    )


def test_an_empty_plan_replays_the_trace():
    for trace in (synthetic.linear_chain(4), synthetic.resnet(2), synthetic.transformer(1), five_ops()):
        sim = simulate(trace)
        assert sim.peak_bytes == trace.replayed_peak_bytes()
        assert sim.step_time == pytest.approx(trace.step_time)
        assert sim.stall_s == 0 and sim.recompute_s == 0
        assert [b for _, b in sim.curve][-1] == [b for _, b in trace.replayed_curve()][-1]


def test_a_hidden_swap_frees_memory_between_its_copies_and_costs_nothing():
    t = five_ops()
    sim = simulate(t, [swap(t, "a:0", 1, 2, "f2")], LINK)
    # swap-out after f1 (ends 2 ms) takes 1 ms; the prefetch after f2 (ends 6 ms) lands at 7 ms, before g (10 ms)
    assert sim.swap_out_end["a:0"] == pytest.approx(3 * MS)
    assert sim.restore_time["a:0"] == pytest.approx(6 * MS)
    assert sim.stalls["a:0"] == 0 and sim.stall_s == 0
    assert sim.step_time == pytest.approx(t.step_time)
    base = simulate(t)
    at = lambda s, time: [b for tt, b in s.curve if tt <= time][-1]  # noqa: E731
    assert at(base, 4 * MS) - at(sim, 4 * MS) == MB  # away from 3 to 6 ms
    assert at(base, 8 * MS) == at(sim, 8 * MS)


def test_on_the_cpu_device_a_swap_out_and_its_prefetch_delay_every_later_op_by_their_memcpy():
    t = five_ops()
    cpu = dataclasses.replace(LINK, copy_compute_bytes_per_s=MB / (MS / 4))  # a 1 MiB memcpy takes 0.25 ms of compute
    sim = simulate(t, [swap(t, "a:0", 1, 2, "f2")], cpu)
    # out after f1 (2 ms): f2 starts 0.25 ms late; the prefetch after f2: f3 and g 0.5 ms late; still no stall
    assert sim.stall_s == 0 and sim.copy_compute_s == pytest.approx(0.5 * MS)
    assert sim.op_start[2] == pytest.approx(2.25 * MS) and sim.op_start[3] == pytest.approx(6.5 * MS)
    assert sim.step_time == pytest.approx(t.step_time + 0.5 * MS)
    plan = _plan(t, [swap(t, "a:0", 1, 2, "f2")], cpu)
    assert lower_bound_s(t, plan) == pytest.approx(t.step_time + 0.5 * MS)
    assert lower_bound_s(t, plan) <= sim.step_time + 1e-12
    # on demand, the op that waits has nothing to run beside the copy: only the swap-out's memcpy delays the step
    on_demand = simulate(t, [swap(t, "a:0", 1, 2, None)], cpu)
    assert on_demand.copy_compute_s == pytest.approx(0.25 * MS)
    # the links made by name carry this machine's figure, and a plan's JSON keeps it
    native = DeviceModel.from_link("native")
    assert native.copy_compute_bytes_per_s > 0 and LINK.copy_compute_bytes_per_s is None
    assert DeviceModel.from_json(native.to_json()) == native and DeviceModel.from_json(LINK.to_json()) == LINK


def test_a_late_prefetch_stalls_the_back_access_and_delays_what_follows():
    t = five_ops()
    sim = simulate(t, [swap(t, "a:0", 1, 2, "f3")], LINK)  # issued at 10 ms, lands at 11 ms
    assert sim.stalls["a:0"] == pytest.approx(1 * MS)
    assert sim.op_start[4] == pytest.approx(11 * MS)
    assert sim.step_time == pytest.approx(t.step_time + 1 * MS)


def test_without_an_in_trigger_the_swap_in_happens_on_demand_at_the_back_access():
    t = five_ops()
    sim = simulate(t, [swap(t, "a:0", 1, 2, None)], LINK)
    assert sim.stalls["a:0"] == pytest.approx(1 * MS)
    assert sim.restore_time["a:0"] == pytest.approx(10 * MS)


def test_copies_are_serialized_per_direction():
    t = five_ops()
    plan = [swap(t, "a:0", 1, 2, "f2"), swap(t, "f1:0", 0, 1, "a")]
    # B's eviction at its production needs its back-access (f2) after it: evicted at f1's end, needed at f2 (next op)
    with pytest.raises(InfeasiblePlanError, match="f1:0"):
        simulate(t, plan, LINK)  # trigger `a` precedes B's evicted-access
    plan = [swap(t, "a:0", 1, 2, "f2"), swap(t, "f2:0", 0, 1, "f2")]
    sim = simulate(t, plan, LINK)
    assert sim.swap_out_end["a:0"] == pytest.approx(3 * MS)
    assert sim.swap_out_end["f2:0"] == pytest.approx(7 * MS)  # C out at f2's end (6 ms)
    # both prefetches issued at 6 ms; C's waits for its own swap-out (7 ms): A 6->7, C 7->8
    assert sim.restore_time["a:0"] == pytest.approx(6 * MS)
    assert sim.restore_time["f2:0"] == pytest.approx(7 * MS)
    assert sim.stalls["f2:0"] == pytest.approx(8 * MS - 6 * MS)  # f3 starts at 6 ms: late by 2 ms


def test_two_swap_outs_at_once_queue_behind_each_other():
    t = five_ops()
    # A leaves after f1 reads it and B right after f1 produces it: both swap-outs are queued at 2 ms
    plan = [swap(t, "a:0", 1, 2, "f2"), swap(t, "f1:0", 0, 1, "f1")]
    sim = simulate(t, plan, LINK)
    assert sim.swap_out_end["a:0"] == pytest.approx(3 * MS)
    assert sim.swap_out_end["f1:0"] == pytest.approx(4 * MS)  # behind A's
    assert sim.restore_time["f1:0"] == pytest.approx(4 * MS)  # its prefetch waits for its own swap-out
    assert sim.stalls["f1:0"] == pytest.approx(3 * MS)  # f2 (2 ms) waits until 5 ms
    assert sim.op_start[2] == pytest.approx(5 * MS)
    assert sim.restore_time["a:0"] == pytest.approx(9 * MS)  # after f2 (now ending at 9 ms)
    assert sim.stalls["a:0"] == pytest.approx(0.0)


def test_an_on_demand_recomputation_inserts_its_replay_before_the_back_access():
    t = five_ops()
    sim = simulate(t, [recompute(t, "f2:0", 1, 2, ["f2"], ["f1:0"])], LINK)
    assert sim.stalls["f2:0"] == pytest.approx(4 * MS)
    assert sim.recompute_s == pytest.approx(4 * MS)
    assert sim.op_start[4] == pytest.approx(14 * MS)
    assert sim.step_time == pytest.approx(t.step_time + 4 * MS)
    assert sim.restore_time["f2:0"] == pytest.approx(10 * MS)


def test_an_early_replay_in_an_idle_gap_costs_nothing():
    t = five_ops(gap_s=5 * MS)
    on_demand = simulate(t, [recompute(t, "a:0", 1, 2, ["a"])], LINK)  # A: evicted after f1, needed by g
    assert on_demand.step_time == pytest.approx(t.step_time + 1 * MS)
    early = simulate(t, [recompute(t, "a:0", 1, 2, ["a"], trigger="f2", mode="early")], LINK)
    assert early.step_time == pytest.approx(t.step_time)
    assert early.idle_before[3] == pytest.approx(4 * MS)  # 5 ms gap after f2, 1 ms used by the replay
    assert early.restore_time["a:0"] == pytest.approx(t.ops[2].end)
    late = simulate(t, [recompute(t, "a:0", 1, 2, ["a"], trigger="f3", mode="early")], LINK)
    assert late.step_time == pytest.approx(t.step_time)


def test_replay_intermediates_are_freed_and_kept_targets_stay():
    t = five_ops()
    # rebuild D (f3's output) from B via f2, f3 : C is an intermediate of the replay
    d = recompute(t, "f3:0", 0, 1, ["f2", "f3"], ["f1:0"])
    sim = simulate(t, [d], LINK)
    assert sim.recompute_s == pytest.approx(8 * MS)


def test_an_element_wise_replayed_op_takes_its_dead_inputs_buffer():
    """The masked-LM head's replay: logits (MatMul) then LogSoftmax over them, 20 MiB each. The replayed logits are
    read by nothing after the LogSoftmax, and the replay's tensors are in no pool, so TensorFlow computes the
    LogSoftmax in the logits' buffer: the replay holds 20 MiB, not 40 (seen on the transformer b32: the guided step's
    allocator record shows one 20 MiB buffer for the replayed logits, log-softmax and exp). A cumulative sum in its
    place cannot."""

    def head(op_type):
        b = TraceBuilder()
        w = b.persistent("w", MB)
        (h,) = b.op("h", "MatMul", (w,), (MB,), duration=MS)
        (logits,) = b.op("logits", "MatMul", (h, w), (20 * MB,), duration=2 * MS)
        (ls,) = b.op("ls", op_type, (logits,), (20 * MB,), duration=MS)
        (g,) = b.op("gather", "GatherV2", (ls,), (MB,), duration=MS)
        (pad,) = b.op("pad", "MatMul", (g,), (10 * MB,), duration=MS)  # while the log-softmax is away
        (e,) = b.op("exp", "Exp", (ls, pad), (MB,), duration=MS)
        b.op("end", "AddN", (e, h), (MB,), duration=MS)
        return b.build()

    peaks = {}
    for op_type in ("LogSoftmax", "Cumsum"):
        t = head(op_type)
        d = RecomputeDecision("ls:0", 20 * MB, ref(t, "ls:0", 1), ref(t, "ls:0", 2), ("h:0",), ("logits", "ls"),
                              ref(t, "ls:0", 2), "on-demand", recompute_s=3 * MS)
        assert [x.op for x in t.tensors["ls:0"].accesses] == ["ls", "gather", "exp"]
        sim = simulate(t, [d], LINK)
        pad, exp = (next(i for i, o in enumerate(t.ops) if o.name == n) for n in ("pad", "exp"))
        peaks[op_type] = sim.max_bytes_between(sim.op_end[pad], sim.op_start[exp]) - t.persistent_bytes
    # From pad's end to exp's start: h and pad (11 MiB) beside the replay's 20 MiB of logits and their log-softmax in
    # the same buffer, then exp's output (1 MiB) beside the rebuilt tensor; with a cumulative sum, 40 MiB at once.
    assert peaks["LogSoftmax"] == 11 * MB + 20 * MB + 1 * MB
    assert peaks["Cumsum"] == 11 * MB + 40 * MB


# ---- infeasible plans ----------------------------------------------------------------------------------------------
def test_a_recompute_source_that_is_not_resident_is_rejected_by_name():
    t = five_ops(g_reads_b=False)  # B dies at f2: it cannot feed a replay before g
    with pytest.raises(InfeasiblePlanError, match=r"source 'f1:0'.*") as e:
        simulate(t, [recompute(t, "f2:0", 1, 2, ["f2"], ["f1:0"])], LINK)
    assert "f2:0" in str(e.value)


def test_a_source_that_is_itself_evicted_is_rejected():
    t = five_ops()
    plan = [recompute(t, "f2:0", 1, 2, ["f2"], ["f1:0"]), swap(t, "f1:0", 1, 2, None)]
    with pytest.raises(InfeasiblePlanError, match="f1:0"):
        simulate(t, plan, LINK)


def test_a_tensor_read_while_swapped_out_without_a_swap_in_is_rejected():
    t = five_ops()
    bad = dataclasses.replace(swap(t, "a:0", 0, 2, "f2"))  # evicted at production: f1 reads it before g
    with pytest.raises(InfeasiblePlanError, match=r"'a:0' is read by op 'f1'"):
        simulate(t, [bad], LINK)


def test_a_trigger_that_does_not_precede_the_back_access_is_rejected():
    t = five_ops()
    with pytest.raises(InfeasiblePlanError, match=r"'a:0': in-trigger op 'g' does not precede"):
        simulate(t, [swap(t, "a:0", 1, 2, "g")], LINK)
    with pytest.raises(InfeasiblePlanError, match=r"'a:0': in-trigger op 'a' precedes its evicted-access"):
        simulate(t, [swap(t, "a:0", 1, 2, "a")], LINK)
    early = recompute(t, "f2:0", 1, 2, ["f2"], ["f1:0"], trigger="g", mode="early")
    with pytest.raises(InfeasiblePlanError, match=r"'f2:0': recompute trigger op 'g' does not precede"):
        simulate(t, [early], LINK)


def test_replaying_an_op_that_cannot_be_replayed_is_rejected():
    b = TraceBuilder()
    (A,) = b.op("rng", "RandomUniform", (), (MB,), stateful=True)
    (B,) = b.op("f", "Relu", (A,), (MB,))
    b.op("g", "Mul", (A, B), (MB,))
    b.op("h", "Mul", (A,), (MB,))
    t = b.build()
    with pytest.raises(InfeasiblePlanError, match=r"'rng:0': op 'rng' cannot be replayed exactly"):
        simulate(t, [recompute(t, "rng:0", 1, 2, ["rng"])], LINK)


def test_malformed_decisions_are_rejected_with_the_tensor_named():
    t = five_ops()
    idx = TraceIndex(t)
    good = swap(t, "a:0", 1, 2, "f2")
    with pytest.raises(InfeasiblePlanError, match="two decisions"):
        check_decisions(idx, [good, good])
    with pytest.raises(InfeasiblePlanError, match="'nope:0'"):
        check_decisions(idx, [dataclasses.replace(good, tensor="nope:0")])
    wrong_op = dataclasses.replace(good, back_access=dataclasses.replace(good.back_access, op="f3"))
    with pytest.raises(InfeasiblePlanError, match=r"'a:0': back-access 2 is made by op 'g', not 'f3'"):
        check_decisions(idx, [wrong_op])
    on_demand_elsewhere = dataclasses.replace(recompute(t, "f2:0", 1, 2, ["f2"]), trigger=op_ref(t, "f3"))
    with pytest.raises(InfeasiblePlanError, match="'f2:0'"):
        check_decisions(idx, [on_demand_elsewhere])
    not_producing = recompute(t, "f2:0", 1, 2, ["f1"])
    with pytest.raises(InfeasiblePlanError, match="'f2:0': none of its replayed ops produces it"):
        check_decisions(idx, [not_producing])


def _plan(trace, decisions, link=LINK):
    return Plan("hand", 0, link, tuple(decisions), True, 0, 0.0, trace.step_time)


def test_the_lower_bound_adds_replays_and_is_at_least_each_copy_directions_busy_time():
    t = five_ops()  # 11 ms of dense compute
    assert lower_bound_s(t, _plan(t, [])) == pytest.approx(11 * MS)
    replay = [recompute(t, "f2:0", 1, 2, ["f2"], ["f1:0"])]
    assert lower_bound_s(t, _plan(t, replay)) == pytest.approx(15 * MS)
    assert simulate(t, replay, LINK).step_time == pytest.approx(15 * MS)  # on demand: the bound is reached
    slow = DeviceModel.symmetric(MB / (20 * MS))  # a 1 MiB copy takes 20 ms, longer than the step
    hidden = [swap(t, "a:0", 1, 2, "f1")]
    assert lower_bound_s(t, _plan(t, hidden, slow)) == pytest.approx(20 * MS)
    assert simulate(t, hidden, slow).step_time >= 20 * MS
    # a hidden swap on the fast link costs nothing: the bound is the step
    assert lower_bound_s(t, _plan(t, [swap(t, "a:0", 1, 2, "f2")])) == pytest.approx(11 * MS)


def test_the_lower_bound_lets_idle_gaps_absorb_a_replay():
    t = five_ops(gap_s=5 * MS)  # 11 ms of compute in a 31 ms step
    early = [recompute(t, "a:0", 1, 2, ["a"], trigger="f2", mode="early")]
    bound = lower_bound_s(t, _plan(t, early))
    assert bound == pytest.approx(t.step_time) and t.step_time > 12 * MS
    assert simulate(t, early, LINK).step_time == pytest.approx(bound)


def test_the_hybrid_sheds_the_decision_the_simulator_names_and_keeps_the_rest():
    """A greedy round can keep a replay whose source another decision evicts (recompute.py keeps a chosen target's
    old chain rather than lose it): the hybrid drops the decision the simulator names, not the whole plan, and never
    passes the simulator's error on while a named decision is left to drop."""
    from capuchin_tf.policy.common import simulate_feasible as _simulate_feasible

    t = five_ops()
    keep = swap(t, "f1:0", 1, 2, None)
    plan = [recompute(t, "f2:0", 1, 2, ["f2"], ["f1:0"]), keep]
    decisions, sim = _simulate_feasible(t, plan, LINK, None)
    assert decisions == [keep] and sim.step_time > 0
    t = five_ops(g_reads_b=False)
    decisions, _ = _simulate_feasible(t, [recompute(t, "f2:0", 1, 2, ["f2"], ["f1:0"])], LINK, None)
    assert decisions == []
