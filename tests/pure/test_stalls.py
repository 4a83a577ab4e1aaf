"""The host store's stall log, read by kind (capuchin_tf/core/stalls.py)."""

import pytest

from capuchin_tf.core.stalls import StallKind, summarize


def test_late_prefetches_are_summed_per_tensor_early_ones_listed_and_waits_counted():
    log = {"name": ["a", "b", "", "a", "c"],
           "kind": [StallKind.LATE_PREFETCH, StallKind.EARLY_PREFETCH, StallKind.PASSIVE_EVICTION,
                    StallKind.LATE_PREFETCH, StallKind.EVICTED_GET],
           "start_ns": [0, 0, 0, 10, 0], "end_ns": [1_000_000_000, 5, 500_000_000, 20, 250_000_000]}
    s = summarize(log)
    assert s.late == {"a": pytest.approx(1.0 + 10e-9)}
    assert list(s.early) == ["b"]
    # the early prefetch (kind 3) is not a wait: 1 s + 10 ns + 0.5 s + 0.25 s
    assert s.waited_s == pytest.approx(1.75 + 10e-9)
    assert s.evicted == {"c": pytest.approx(0.25)}
    assert s.by_kind == {"late_prefetch": pytest.approx(1.0 + 10e-9), "passive_eviction": pytest.approx(0.5),
                         "evicted_get": pytest.approx(0.25)}


def test_an_allocation_waiting_for_a_copy_in_flight_is_a_wait():
    s = summarize({"name": [""], "kind": [StallKind.COPY_WAIT], "start_ns": [0], "end_ns": [300_000_000]})
    assert s.waited_s == pytest.approx(0.3) and s.by_kind == {"copy_wait": pytest.approx(0.3)}
    assert not s.late and not s.early and not s.evicted


def test_an_unknown_kind_is_an_error_not_a_silent_zero():
    with pytest.raises(ValueError):
        summarize({"name": ["x"], "kind": [7], "start_ns": [0], "end_ns": [1]})


def test_the_kinds_are_the_host_stores_own():
    """One list in two languages: cc/kernels/host_store.h's StallKind and this enum name the same numbers."""
    import pathlib
    import re

    header = (pathlib.Path(__file__).resolve().parents[2] / "cc" / "kernels" / "host_store.h").read_text()
    body = re.search(r"enum StallKind : int32_t \{(.*?)\};", header, re.S).group(1)
    cc = {re.sub(r"(?<!^)([A-Z])", r"_\1", name[1:]).upper(): int(value)
          for name, value in re.findall(r"(k\w+) = (\d+)", body)}
    assert cc == {k.name: k.value for k in StallKind}
