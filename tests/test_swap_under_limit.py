"""On the simulated device: a graph that runs out of memory without swapping runs with it, and gives the same bits."""



GRAPH = """
import json
import numpy as np
import tensorflow as tf
import capuchin_tf

N = 4 * 1024 * 1024          # 16 MiB float32 tensors
HELD = 8                     # activations held until the end of the step

@tf.function
def step(x, swap):
    acts, handles, after = [], [], []
    a = x
    for i in range(HELD):
        with tf.control_dependencies(after):
            a = tf.sin(a) + float(i)
        if swap and i < HELD - 1:
            handles.append(capuchin_tf.swap_out(a, name=f"a{i}"))
            after = [handles[-1]]
        else:
            acts.append(a)
    # The same accumulation in both modes, starting only after the whole forward chain: plain TensorFlow must hold
    # every activation until then. (The ordering edges also keep Grappler from re-associating the sum.)
    with tf.control_dependencies([a]):
        total = tf.zeros_like(x)
    held = [None] * len(handles) + acts
    for i, a in enumerate(held):
        with tf.control_dependencies([total]):
            a = capuchin_tf.swap_in(handles[i], tf.float32, [N]) if a is None else tf.identity(a)
        total = total + a * a
    return total

x = tf.random.stateless_uniform([N], seed=[1, 2])
result = {}
for swap in (MODES):
    step.get_concrete_function(x, swap)
    tf.config.experimental.reset_memory_stats("CPU:0")
    try:
        out = step(x, swap)
        result[str(swap)] = {"ok": True, "sha": __import__("hashlib").sha256(out.numpy().tobytes()).hexdigest(),
                             "peak": tf.config.experimental.get_memory_info("CPU:0")["peak"]}
    except tf.errors.ResourceExhaustedError as e:
        result[str(swap)] = {"ok": False, "error": "OOM when allocating" in str(e)}
print(json.dumps(result))
"""

MiB = 1 << 20
LIMIT_MB = 128


def test_plain_runs_out_of_memory_and_the_swapped_graph_runs_bit_for_bit(simulated_device):
    reference = simulated_device(GRAPH.replace("MODES", "False,"), limit_mb=1024)["False"]
    assert reference["ok"] and reference["peak"] > LIMIT_MB * MiB
    limited = simulated_device(GRAPH.replace("MODES", "False, True"), limit_mb=LIMIT_MB)
    assert limited["False"] == {"ok": False, "error": True}, "plain TensorFlow must run out of memory"
    assert limited["True"]["ok"], "the swapped graph must run under the same limit"
    assert limited["True"]["peak"] <= LIMIT_MB * MiB
    assert limited["True"]["sha"] == reference["sha"]


EVICT = """
import json
import tensorflow as tf
import capuchin_tf
from capuchin_tf.tf import ops

MiB = 1 << 20
# Eight 8 MiB blocks laid out one after the other on a 72 MiB device; then the oldest (0) and two neighbours (5, 6)
# go to the pool (their handles, small tensors, land in the free tail) and the others stay in use.
blocks = [tf.fill([2 * MiB], float(i)) for i in range(8)]
handles = {i: ops.hold(blocks[i], f"p{i}") for i in (0, 5, 6)}
for i in (0, 5, 6):
    blocks[i] = None
before = ops.host_store_stats()
ops.set_passive_mode(True)
try:
    big = tf.fill([4 * MiB], 9.0)  # 16 MiB: only evicting 5 and 6, which are adjacent, makes room
finally:
    ops.set_passive_mode(False)
after = ops.host_store_stats()
big_value = float(tf.reduce_min(big))
del big
values = {i: float(tf.reduce_max(ops.get(h, tf.float32, [2 * MiB]))) for i, h in handles.items()}
print(json.dumps({"evicted": after["passive_evicted_bytes"] - before["passive_evicted_bytes"],
                  "evictions": after["passive_evictions"] - before["passive_evictions"],
                  "big": big_value, "values": values}))
"""


def test_passive_eviction_frees_one_contiguous_run_of_the_fewest_bytes(simulated_device):
    """An allocation needs one free chunk: eviction picks the pooled tensors whose chunks, with the free ones around
    them, make a run large enough, evicting the fewest bytes (not the oldest tensors until enough bytes in total,
    which here would evict block 0 for nothing)."""
    r = simulated_device(EVICT, limit_mb=72)
    assert r["big"] == 9.0
    assert r["evicted"] == 16 * (1 << 20) and r["evictions"] == 2, r
    assert r["values"] == {"0": 0.0, "5": 5.0, "6": 6.0}


MOVE = """
import json
import tensorflow as tf
import capuchin_tf
from capuchin_tf.tf import ops

MiB = 1 << 20
# Eight 8 MiB blocks one after the other on a 96 MiB device, a free tail of 32 MiB behind them. Block 0 is freed
# (the pool's handle, a small allocation, lands at the start of its hole), block 7, the last, goes to the pool, and
# block 3 is freed (an 8 MiB hole); the rest stay.
blocks = [tf.fill([2 * MiB], float(i)) for i in range(8)]
blocks[0] = None
handle = ops.hold(blocks[7], "p7")
blocks[7] = blocks[3] = None
before = ops.host_store_stats()
ops.set_passive_mode(True)
try:
    big = tf.fill([9 * MiB], 9.0)  # 36 MiB: more than the tail; block 7 and the tail together are enough
finally:
    ops.set_passive_mode(False)
after = ops.host_store_stats()
big_value = float(tf.reduce_min(big))
del big
stat = lambda k: after[k] - before[k]
back = ops.get(handle, tf.float32, [2 * MiB])
print(json.dumps({"evicted": stat("passive_evicted_bytes"), "moves": stat("device_moves"),
                  "moved": stat("device_moved_bytes"), "big": big_value,
                  "back": [float(tf.reduce_min(back)), float(tf.reduce_max(back))],
                  "kept": [float(tf.reduce_max(b)) for b in blocks if b is not None]}))
"""


def test_passive_mode_moves_a_pooled_tensor_inside_the_device_instead_of_evicting_it(simulated_device):
    """An allocation that fails for want of one free run, with the bytes free elsewhere: the pooled tensor in the way
    is copied into a hole elsewhere on the device (no copy over the link, nothing evicted) and reads back bit for
    bit (CAPUCHIN_TF_DEVICE_MOVES set); without it, it is evicted to host memory."""
    r = simulated_device(MOVE, limit_mb=96, env={"CAPUCHIN_TF_DEVICE_MOVES": "1"})
    assert r["big"] == 9.0 and r["back"] == [7.0, 7.0] and r["kept"] == [1.0, 2.0, 4.0, 5.0, 6.0], r
    assert r["evicted"] == 0 and r["moves"] == 1 and r["moved"] == 8 * MiB, r
    r = simulated_device(MOVE, limit_mb=96)
    assert r["big"] == 9.0 and r["back"] == [7.0, 7.0] and r["kept"] == [1.0, 2.0, 4.0, 5.0, 6.0], r
    assert r["evicted"] == 8 * MiB and r["moves"] == 0, r


def test_on_an_emulated_link_copies_on_demand_take_the_links_time_both_ways(simulated_device):
    """A link emulated at 32 MiB/s (the p100 regime's kind): passive mode's eviction of 16 MiB takes 0.5 s, and
    bringing the two 8 MiB tensors back on demand 0.25 s each, as planned swaps over that link do (a GPU's on-demand
    copies cross the same bus). At memcpy speed they would take milliseconds."""
    script = EVICT.replace("before = ops.host_store_stats()", "ops.set_link_bandwidth(32 * MiB)\nimport time\n"
                           "before = ops.host_store_stats()\nt0 = time.perf_counter()")
    script = script.replace("after = ops.host_store_stats()", "evict_s = time.perf_counter() - t0\n"
                            "after = ops.host_store_stats()")
    script = script.replace("values = {i:", "t1 = time.perf_counter()\nback = {i: float(tf.reduce_max(ops.get("
                            "handles[i], tf.float32, [2 * MiB]))) for i in (5, 6)}\nget_s = time.perf_counter() - t1\n"
                            "values = {i:")
    script = script.replace("for i, h in handles.items()}", "for i, h in handles.items() if i == 0}")
    script = script.replace('"big": big_value,', '"big": big_value, "evict_s": evict_s, "get_s": get_s, "back": back,')
    r = simulated_device(script, limit_mb=72)
    assert r["evicted"] == 16 * (1 << 20) and r["evictions"] == 2, r
    assert r["big"] == 9.0 and r["back"] == {"5": 5.0, "6": 6.0} and r["values"] == {"0": 0.0}
    assert 0.45 < r["evict_s"] < 3.0, r
    assert 0.45 < r["get_s"] < 3.0, r


CONCURRENT_GETS = """
import json
import tensorflow as tf
from capuchin_tf.tf import ops

N = 16 * 1024 * 1024  # 64 MiB of float32
tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})  # no merging of the identical Gets
handle = ops.hold(tf.fill([N], 3.0), "big")
filler = tf.fill([N * 7 - 1024], 1.0)  # the rest of the 512 MiB device, but 4 KiB
ops.set_passive_mode(True)
try:
    pressure = tf.fill([N // 2], 1.0)  # 32 MiB: room only where the pooled tensor is, which is evicted
finally:
    ops.set_passive_mode(False)
del pressure, filler
evicted = ops.host_store_stats()["passive_evictions"]

def readers(h):
    # Several readers of one evicted tensor, each through its own Get, free to run at once on the inter-op threads
    # (a v1-style graph: no automatic control edges between the stateful Gets, as in the rewritten steps).
    outs = []
    for _ in range(6):
        x = ops.get(h, tf.float32, [N])
        outs.append(tf.stack([tf.reduce_min(x), tf.reduce_max(x)]))
    return tf.stack(outs)

readers = tf.compat.v1.wrap_function(readers, [tf.TensorSpec([], tf.variant)])
values = [readers(handle).numpy().tolist()]
print(json.dumps({"evicted": evicted, "values": values, "swap_ins": ops.host_store_stats()["passive_swap_ins"]}))
"""


def test_readers_of_one_evicted_tensor_share_one_swap_in(simulated_device):
    """Gets of the same evicted tensor on several inter-op threads: one brings it back, the others wait for it (else
    they would copy from the host buffer the first one frees: wrong bits, or a segmentation fault)."""
    r = simulated_device(CONCURRENT_GETS, limit_mb=512, env={"TF_NUM_INTEROP_THREADS": "6"})
    assert r["evicted"] == 1
    assert r["values"] == [[[3.0, 3.0]] * 6]
    assert r["swap_ins"] == 1


QUEUED_SWAP_OUTS = """
import json
import time
import tensorflow as tf
from capuchin_tf.tf import ops

# As in a managed step, small tensors go to the pool (its region taken from the device by the first one, here), so
# the swap handles (256 bytes each) do not split the free memory after the blocks.
ops.set_small_pool(True)
small = tf.zeros([16]) + 1.0
N = 4 * 1024 * 1024  # 16 MiB of float32
blocks = [tf.fill([N], float(i)) for i in range(3)]  # 48 MiB of the 64 MiB device, one after the other
ops.set_link_bandwidth({bandwidth})  # bytes/s: a 16 MiB copy takes 16 MiB / bandwidth
handles = [ops.swap_out(b, name=f"b{{i}}") for i, b in enumerate(blocks)]
del blocks  # the store holds them now: the first goes on the link, the other two wait in the queue
# Time for the copy worker to take the first block (under load it may not have taken it when the allocation comes:
# all three are then copied at once and nothing waits); its copy takes 2 s or more: still on the link after this.
time.sleep(0.5)
ops.set_passive_mode(True)
t0 = time.perf_counter()
try:
    big = tf.fill([10 * 1024 * 1024], 1.0)  # 40 MiB: only the queued blocks' memory and the free 16 MiB make a run
    fits, big_sum = True, float(tf.reduce_sum(big))
except tf.errors.ResourceExhaustedError:
    fits, big_sum = False, None
finally:
    ops.set_passive_mode(False)
waited = time.perf_counter() - t0
stats = ops.host_store_stats()
big = None
ops.set_link_bandwidth(0.0)  # the swap-ins below at full speed
values = [float(tf.reduce_max(ops.swap_in(h, tf.float32, [N]))) for h in handles[1:]]
print(json.dumps({{"fits": fits, "sum": big_sum, "waited": waited, "expedited": stats["expedited_swap_outs"],
                   "values": values}}))
"""


def test_an_allocation_takes_the_memory_of_swap_outs_still_queued_for_the_link(simulated_device):
    """Guided execution's safety net: a swap-out waiting behind others for the (emulated) link still holds its device
    buffer. An allocation that needs that memory copies the queued ones at once instead of failing or waiting for
    the copy in flight (else a step's large allocation can find the memory it needs held by queued swap-outs); the
    copies it makes take their time on the emulated link, as every copy to the host does."""
    r = simulated_device(QUEUED_SWAP_OUTS.format(bandwidth=4 << 20), limit_mb=64)  # 4 s per block on the link
    assert r["fits"] and r["sum"] == 10 * 1024 * 1024
    assert r["expedited"] == 2, r
    # the two expedited blocks' 8 s on the link; not the 3.5 s left of the block in flight before them as well
    assert 7.5 < r["waited"] < 11, r
    assert r["values"] == [1.0, 2.0], "the expedited blocks come back with their bits"


def test_an_allocation_waits_for_a_swap_out_on_the_link_when_nothing_else_helps(simulated_device):
    """When evicting and expediting are not enough, a copy in flight can still free what the allocation needs: the
    allocation waits for the next copy to finish and tries again (here 56 MiB need the memory of the block on the
    link as well as the two queued ones)."""
    r = simulated_device(QUEUED_SWAP_OUTS.format(bandwidth=8 << 20).replace("10 * 1024 * 1024", "14 * 1024 * 1024"),
                         limit_mb=64)  # 2 s per block; 56 MiB needs the first block's memory as well
    assert r["fits"] and r["sum"] == 14 * 1024 * 1024
    assert r["expedited"] == 2, r
    assert 1.0 < r["waited"] < 8, "waited for the first block's copy, not for the allocator's 10 s"
    assert r["values"] == [1.0, 2.0]
