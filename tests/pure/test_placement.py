"""The best-fit placement of a simulated step (policy/placement.py) and the plan choice that uses it."""

from conftest import MB
from test_simulator import LINK, five_ops, swap

from capuchin_tf.core import synthetic
from capuchin_tf.policy import make_plan
from capuchin_tf.policy.hybrid import placed_cost
from capuchin_tf.policy.placement import live_at, place
from capuchin_tf.policy.simulator import simulate


def test_a_large_allocation_between_freed_pieces_needs_more_device_than_the_bytes_live():
    """Four 4 MiB buffers, the first and third freed: 8 MiB live and 8 MiB free, in two runs of 4 MiB. An 8 MiB
    allocation fits no run, so the space grows: 24 MiB reached for 16 MiB live at once."""
    events = [(0, 4 * MB, "a"), (1, 4 * MB, "b"), (2, 4 * MB, "c"), (3, 4 * MB, "d"), (4, -4 * MB, "a"),
              (5, -4 * MB, "c"), (6, 8 * MB, "e")]
    p = place(events)
    assert (p.live_peak, p.extent, p.fragmentation) == (16 * MB, 24 * MB, 8 * MB)
    # The last two freed instead: the space's top comes down and the 8 MiB go there.
    events = events[:4] + [(4, -4 * MB, "c"), (5, -4 * MB, "d"), (6, 8 * MB, "e")]
    assert place(events).fragmentation == 0


def test_best_fit_takes_the_smallest_run_and_small_allocations_are_not_placed():
    """A 2 MiB allocation goes into the 2 MiB hole, not the 6 MiB one, so that a 6 MiB one still fits; buffers of at
    most 64 KiB go to the small-tensor pool and are left out."""
    events = [(0, 6 * MB, "a"), (1, 1 * MB, "x"), (2, 2 * MB, "b"), (3, 1 * MB, "y"), (4, -6 * MB, "a"),
              (5, -2 * MB, "b"), (6, 2 * MB, "c"), (7, 6 * MB, "d"), (8, 64 * 1024, "small")]
    p = place(events)
    assert p.fragmentation == 0 and p.allocations == 6


def test_a_free_run_less_than_twice_an_allocation_is_taken_whole_as_bfc_does():
    """BFC splits a free chunk only when it is at least twice the request: a 4 MiB allocation in a 6 MiB hole takes
    all 6, so a 2 MiB one after it finds no hole and the space grows (2 MiB beyond the 7 live); an 8 MiB hole is
    split, and both fit in it."""
    def events(hole: int):
        return [(0, hole * MB, "a"), (1, 1 * MB, "b"), (2, -hole * MB, "a"), (3, 4 * MB, "c"), (4, 2 * MB, "d")]
    p = place(events(6))
    assert (p.live_peak, p.extent, p.fragmentation) == (7 * MB, 9 * MB, 2 * MB)
    p = place(events(8))
    assert (p.extent, p.fragmentation) == (9 * MB, 0)
    # The whole run taken is given back whole: freed, it holds the 6 MiB again.
    p = place(events(6) + [(5, -4 * MB, "c"), (6, 6 * MB, "e")])
    assert p.extent == 9 * MB


def test_the_simulated_events_pair_into_buffers_with_the_simulated_peak():
    """Every buffer of a simulated step is allocated and freed under one label (swapped out and back in: two
    buffers); with no small tensors and nothing in pieces, the placement's live peak is the simulated transient
    peak."""
    trace = five_ops()
    plan = [swap(trace, "a:0", 1, 2, "f2")]
    sim = simulate(trace, plan, LINK)
    p = place(sim.events)
    assert p.live_peak == sim.peak_bytes - trace.persistent_bytes
    allocated = sum(1 for _, d, label in sim.events if d > 0 and label == "a:0")
    assert allocated == 2  # its production and its swap-in
    for trace in (synthetic.resnet(2), synthetic.transformer(1)):
        sim = simulate(trace)
        assert place(sim.events, small_bytes=0).live_peak == sim.peak_bytes - trace.persistent_bytes


def test_capuchin_costs_its_plans_with_their_placement_and_returns_the_cheapest_that_fits():
    """With the fallback, capuchin's plan is the one of the hybrid, its halves, its placed re-plan and the checkpoint
    plan with the least placed cost (its predicted step plus a copy out and in of its placed peak over the budget);
    each fits the budget by its bytes."""
    trace = synthetic.resnet(3)
    budget = trace.persistent_bytes + (trace.replayed_peak_bytes() - trace.persistent_bytes) * 6 // 10
    hybrid = make_plan(trace, budget, "capuchin", LINK)
    chosen = make_plan(trace, budget, "capuchin", LINK, fallback=True)
    assert chosen.feasible and chosen.predicted_peak_bytes <= budget
    assert placed_cost(chosen, budget) <= placed_cost(hybrid, budget)
    for policy in ("swap-only", "recompute-only", "checkpoint"):
        other = make_plan(trace, budget, policy, LINK)
        if other.feasible:
            assert placed_cost(chosen, budget) <= placed_cost(other, budget) * 1.0001, policy


def test_an_eviction_at_the_instant_of_its_production_frees_that_buffer():
    """The simulator sorts a free before an allocation at the same time, so a tensor evicted right as it is made has
    its eviction first: the buffer is of no lifetime, and the swap-in later is its only buffer (it leaked, and the
    swap-in counted twice, before buffer_events paired them)."""
    events = [(1, -4 * MB, "a"), (1, 4 * MB, "a"), (2, 4 * MB, "b"), (3, 4 * MB, "a"), (4, -4 * MB, "a"),
              (5, -4 * MB, "b")]
    p = place(events)
    assert (p.live_peak, p.extent, p.allocations) == (8 * MB, 8 * MB, 2)
    assert live_at(events, 3) == {"a": 4 * MB, "b": 4 * MB} and live_at(events, 1) == {}


def test_the_first_allocation_that_passes_a_limit_is_named_with_the_run_it_did_not_fit():
    """Two 4 MiB buffers, the first freed: a 6 MiB allocation does not fit the 4 MiB run and takes the space to 14
    MiB. Under a 12 MiB limit that allocation is the overflow (with the 4 MiB run it did not fit); under 14 MiB none."""
    from capuchin_tf.policy.placement import first_overflow

    events = [(0, 4 * MB, "a"), (1, 4 * MB, "b"), (2, -4 * MB, "a"), (3, 6 * MB, "c"), (4, 1 * MB, "d")]
    over = first_overflow(events, 12 * MB)
    assert (over.label, over.nbytes, over.top, over.largest_free, over.time) == ("c", 6 * MB, 14 * MB, 4 * MB, 3)
    assert first_overflow(events, 14 * MB) is None
    assert first_overflow(events, 14 * MB - 1).label == "c"


def test_a_plan_whose_placement_passes_the_device_covers_the_allocation_that_passes_it():
    """synthetic.resnet(2) at persistent + 0.8 of its transient peak: the hybrid's plan fits by bytes and its
    placement needs more device than the budget. With `place_within` the allocation that first passes the budget is
    covered where it is placed: one decision more, the bytes still fit, the placement within the budget. A device its
    placement already fits changes nothing."""
    from capuchin_tf.policy.hybrid import hybrid

    trace = synthetic.resnet(2)
    budget = int(trace.persistent_bytes + 0.8 * (trace.replayed_peak_bytes() - trace.persistent_bytes))
    plain = hybrid(trace, budget, LINK)
    assert plain.feasible and plain.predicted_placed_peak_bytes > budget
    covered = hybrid(trace, budget, LINK, place_within=budget)
    assert covered.feasible and covered.predicted_placed_peak_bytes <= budget
    assert len(covered.decisions) == len(plain.decisions) + 1
    roomy = plain.predicted_placed_peak_bytes
    assert hybrid(trace, budget, LINK, place_within=roomy).decisions == plain.decisions
    # capuchin's fallback weighs the covered plan with the others (at the device less the placement error) and
    # takes it here: placed lower than the hybrid, its bytes within the budget
    chosen = make_plan(trace, budget, "capuchin", LINK, fallback=True)
    assert dict(chosen.options)["fallback"] == "covered" and chosen.predicted_peak_bytes <= budget
    assert chosen.predicted_placed_peak_bytes < plain.predicted_placed_peak_bytes
