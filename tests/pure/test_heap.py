"""runtime.heap.young_heap: inside it the collector walks only what the scope made; after it nothing is kept from
the collector (cyclic garbage made meanwhile is collected), and a process that froze objects itself or turned the
collector off is left as it was."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

from capuchin_tf.runtime import heap


class Node:
    def __init__(self):
        self.other = None


def cycle() -> weakref.ref:
    """A reference cycle with no other referrer, found only by the cycle collector; a weak reference to it."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture(autouse=True)
def collector_as_it_was():
    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    assert frozen == 0  # the tests below need a process that froze nothing itself
    yield
    gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


def test_inside_the_scope_older_objects_and_survivors_are_not_walked_and_after_it_everything_is_again():
    before = cycle()  # garbage already when the scope starts: frozen with everything else
    with heap.young_heap():
        assert gc.get_freeze_count() > 0
        gc.collect()
        assert before() is not None  # frozen: a full collection inside does not walk it
        keep = Node()
        keep.other = keep
        kept = weakref.ref(keep)
        gc.collect(1)  # the survivors of a generation-1 collection are frozen too
        del keep
        gc.collect()
        assert kept() is not None
        fresh = cycle()  # made and dropped inside, never through a generation-1 collection
        gc.collect(0)
        assert fresh() is None  # young garbage is collected as usual
    assert gc.get_freeze_count() == 0
    assert heap._freeze_survivors not in gc.callbacks
    gc.collect()
    assert before() is None and kept() is None  # nothing was kept from the collector beyond the scope


def test_overlapping_scopes_across_threads_unfreeze_when_the_last_one_ends():
    entered, release = threading.Event(), threading.Event()

    def build():
        with heap.young_heap():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=build)
    with heap.young_heap():
        thread.start()
        assert entered.wait(10)
    assert gc.get_freeze_count() > 0  # the build's scope is still open
    garbage = cycle()
    gc.collect(1)
    release.set()
    thread.join(10)
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert garbage() is None


def test_a_process_that_froze_objects_itself_or_turned_the_collector_off_is_left_alone():
    gc.freeze()
    own = gc.get_freeze_count()
    with heap.young_heap():
        gc.collect(1)
        assert heap._freeze_survivors not in gc.callbacks
    assert gc.get_freeze_count() == own  # its own freeze stands
    gc.unfreeze()
    gc.disable()
    with heap.young_heap():
        assert gc.get_freeze_count() == 0
    assert not gc.isenabled()
