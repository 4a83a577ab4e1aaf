"""Recovery and the device's memory: `recovery.compact_variables` lays the variables out again in one run of the
simulated device's memory; `recovery.Snapshot.restore` writes into the variables' own buffers and leaves them as
plain TensorFlow has them.

Each test runs in a fresh process on a simulated device (the compaction test makes the variables scattered on
purpose: each one allocated between temporaries that are freed, so that the free memory is split by them).
"""

MiB = 1 << 20

SCATTERED = """
import json
import numpy as np
import tensorflow as tf
from capuchin_tf.tf import ops
from capuchin_tf.runtime import recovery

MiB = 1 << 20
rng = np.random.default_rng(0)
shapes = [(6 * MiB // 4,), (256, 1024), (MiB // 4 + 7,), (2, 3)]
# The handles first (on the CPU device a resource handle is a small device allocation of its own, which compaction
# cannot move), then each variable's buffer between two temporaries that are freed below: the variables end up in
# the middle of the free memory, as a model's do between the temporaries of their initializers.
variables = [tf.Variable(tf.zeros([0]), shape=tf.TensorShape(None)) for _ in shapes]
counter = tf.Variable(tf.zeros([0], tf.int64), shape=tf.TensorShape(None))
half = tf.Variable(tf.zeros([0], tf.float16), shape=tf.TensorShape(None))
temporaries, before = [], []
for v, shape in zip(variables, shapes):
    temporaries.append(tf.raw_ops.Snapshot(input=np.ones(3 * MiB // 4, np.float32)))  # 3 MiB, freed below
    values = rng.standard_normal(shape).astype(np.float32)
    values.flat[0] = -0.0  # a negative zero and a NaN survive bit for bit
    values.flat[-1] = np.nan
    tf.raw_ops.AssignVariableOp(resource=v.handle, value=tf.raw_ops.Snapshot(input=values), validate_shape=False)
tf.raw_ops.AssignVariableOp(resource=counter.handle, value=tf.raw_ops.Snapshot(input=np.int64(7)),
                            validate_shape=False)
tf.raw_ops.AssignVariableOp(resource=half.handle, value=tf.raw_ops.Snapshot(input=np.float16([1.5, -2.25])),
                            validate_shape=False)
temporaries.append(tf.raw_ops.Snapshot(input=np.ones(20 * MiB // 4, np.float32)))
del temporaries
handles = [v.handle for v in variables] + [counter.handle, half.handle, variables[0].handle]
read = lambda: [v.numpy().tobytes() for v in variables + [counter, half]]
before = read()
in_use = ops.allocator_stats()["bytes_in_use"]
done = recovery.compact_variables(handles)
after = read()
stats = ops.allocator_stats()
variables[1].assign_add(tf.ones([256, 1024]))  # still a working variable
print(json.dumps({{"same": before == after, "variables": done.variables, "bytes": done.bytes,
                   "largest_before": done.largest_free_before, "largest_after": done.largest_free_after,
                   "in_use_before": in_use, "in_use_after": stats["bytes_in_use"], "limit": stats["bytes_limit"],
                   "small_pool": max(stats["small_pool_bytes_limit"], 0),
                   "shapes": [list(s) for s in shapes], "read_shapes": [list(v.numpy().shape) for v in variables],
                   "assign_ok": bool(np.array_equal(variables[1].numpy(),
                                                    np.frombuffer(before[1], np.float32).reshape(256, 1024) + 1,
                                                    equal_nan=True))}}))
"""


def test_compaction_puts_the_free_memory_in_one_run(simulated_device):
    r = simulated_device(SCATTERED.format(), limit_mb=64)
    assert r["same"], "a value changed"
    assert r["shapes"] == r["read_shapes"]
    assert r["assign_ok"]
    assert r["variables"] == 6  # the handle given twice counts once
    # Nothing left behind: each variable rounded to 256 bytes, and the small-tensor pool's region, which the pool takes
    # at its first allocation once it is on (compaction leaves it on, as in a managed call).
    assert r["in_use_after"] <= r["in_use_before"] + 6 * 256 + r["small_pool"], r
    free = r["limit"] - r["in_use_after"]
    # Before: the variables split the free memory (holes of 3 MiB below each and the run above them).
    assert r["largest_before"] < free - 10 * MiB, r
    # After: one run, but for the handles and what the small pool's region takes.
    assert r["largest_after"] >= free - 64 * 1024, r


NOT_SIMULATED = """
import json
import tensorflow as tf
from capuchin_tf.runtime import recovery
v = tf.Variable([1.0, 2.0])
print(json.dumps({{"done": recovery.compact_variables([v.handle]) is None, "value": v.numpy().tolist()}}))
"""


def test_compaction_needs_the_simulated_device():
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_CPU_")}
    out = subprocess.run([sys.executable, "-c", NOT_SIMULATED.format()], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r == {"done": True, "value": [1.0, 2.0]}


RESTORE = """
import json
import numpy as np
import tensorflow as tf
from capuchin_tf.tf import ops
from capuchin_tf.runtime import recovery

MiB = 1 << 20
in_use = lambda: ops.allocator_stats()["bytes_in_use"]
original = np.arange(MiB // 4, dtype=np.float32)
v = tf.Variable(tf.raw_ops.Snapshot(input=original))  # 1 MiB on the device
snapshot = recovery.Snapshot([v.handle], [0]).take()
v.assign_add(tf.ones([MiB // 4]))
before = in_use()
snapshot.restore()
restored = in_use()
read = v.read_value()  # a read aliases the variable's buffer, unless the variable copies on read
after_read = in_use()
same = bool(np.array_equal(read.numpy(), original))
del read
v.assign_sub(tf.ones([MiB // 4]))  # an update in place (no reader left), unless it copies on read
after_update = in_use()
print(json.dumps({{"before": before, "restored": restored, "after_read": after_read, "after_update": after_update,
                   "same": same}}))
"""


def test_a_restore_writes_in_place_and_leaves_reads_and_updates_in_place(simulated_device):
    # A restore by ResourceStridedSliceAssign put the variable in copy-on-read mode for good: each later read then
    # allocated a copy of it, and each update a new buffer (TensorFlow's EnsureSparseVariableAccess).
    r = simulated_device(RESTORE.format(), limit_mb=64)
    assert r["same"]
    assert r["restored"] == r["before"], r  # into the variable's own buffer
    assert r["after_read"] == r["restored"], r  # the read aliases the variable
    assert r["after_update"] == r["restored"], r  # the update writes in place


def test_compaction_leaves_variables_the_step_has_not_initialized_yet(simulated_device):
    # A variable created while the step is traced is initialized at its first call, after compaction: left alone.
    r = simulated_device("""
import json
import tensorflow as tf
from capuchin_tf.runtime import recovery
from tensorflow.python.ops import resource_variable_ops
ready = tf.Variable([1.0, 2.0])
uninitialized = resource_variable_ops.UninitializedVariable(shape=[4], dtype=tf.float32)
done = recovery.compact_variables([ready.handle, uninitialized.handle])
print(json.dumps({"moved": done.variables, "value": ready.numpy().tolist(),
                  "still": bool(uninitialized.is_initialized())}))
""", limit_mb=64)
    assert r == {"moved": 1, "value": [1.0, 2.0], "still": False}


MOMENTUM = """
import json
import numpy as np
import keras
import tensorflow as tf
import capuchin_tf
from capuchin_tf.tf import measure

MiB = 1 << 20
keras.utils.set_random_seed(0)
tf.config.experimental.enable_op_determinism()

def setup():
    w = tf.Variable(tf.random.stateless_normal([512, 512], seed=[1, 2]))  # 1 MiB, and a 1 MiB momentum slot
    m = tf.Variable(tf.zeros([4]))  # assigned a new value every step, as BatchNormalization's moving statistics
    opt = keras.optimizers.SGD(0.01, momentum=0.9)
    opt.build([w])
    x = tf.random.stateless_normal([256, 512], seed=[3, 4])

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            h = x @ w
            loss = tf.reduce_sum(h * h)
        opt.apply_gradients([(tape.gradient(loss, w), w)])
        m.assign(m * 0.5 + tf.reduce_mean(h))
        return loss

    return step, x, [w, m] + list(opt.variables)

step, x, variables = setup()
_, plain_trace = measure.measure_step(step, (x,), passive=False)
plain_losses = [float(step(x)) for _ in range(2)]
plain = [v.numpy().tobytes() for v in variables]

step, x, variables = setup()
managed = capuchin_tf.function(step, memory_budget=48 * MiB)
losses = [float(managed(x)) for _ in range(3)]
state = next(iter(managed.states().values()))
print(json.dumps({{"plain_released": len(plain_trace.released),
                   "released": [b for _, b in state.trace.released],
                   "same": [a.hex() for a in losses[1:]] == [a.hex() for a in plain_losses]
                           and [v.numpy().tobytes() for v in variables] == plain,
                   "phases": [h.phase for h in state.history]}}))
"""


def test_a_managed_step_assigns_variables_in_place(simulated_device):
    # AssignVariableOp takes over its value's buffer: Keras' momentum slots and any `var.assign(expr)` move to wherever
    # the value was computed, every step, out of the run compaction laid them out in (ResNet50V2: 273 buffers, 90.7 MiB
    # per step). The managed step writes them into their own buffers (rewrite.assignments_in_place).
    r = simulated_device(MOMENTUM.format(), limit_mb=256)
    assert r["plain_released"] >= 2, r  # plain TensorFlow moves the slot and `m` (the test can fail)
    assert r["released"] == [], r
    assert r["same"], r
    assert r["phases"][0] == "measured", r


REPEATED = """
import json
import numpy as np
import tensorflow as tf
from capuchin_tf.runtime import recovery

a = tf.Variable(np.arange(6, dtype=np.float32))
b = tf.Variable(np.int64(7))
c = tf.Variable(np.ones(3, np.float16), shape=tf.TensorShape(None))
d = tf.Variable([1.5, -2.0], dtype=tf.bfloat16)  # no buffer protocol for bfloat16: read through .numpy()
e = tf.Variable([True, False])
snapshot = recovery.Snapshot([a.handle, b.handle, c.handle, d.handle, e.handle], [0, 1, 2, 3, 4])
seen, kept = [], []
for step in range(3):
    snapshot.take()  # the first reads one variable at a time, the later ones in one call
    kept.append([id(v) for v in snapshot.values.values()])
    a.assign_add(tf.ones(6)); b.assign_add(1); c.assign(np.full(step + 4, 2.5, np.float16))
    d.assign_add(tf.ones(2, tf.bfloat16)); e.assign(tf.logical_not(e))
    snapshot.restore()
    seen.append([a.numpy().tolist(), int(b.numpy()), c.numpy().tolist(), d.numpy().astype(float).tolist(),
                 e.numpy().tolist()])
    a.assign_add(tf.fill([6], 10.0)); b.assign_add(100)  # the step that ran: the next snapshot takes these
    d.assign_add(tf.fill([2], tf.constant(10.0, tf.bfloat16))); e.assign([step % 2 == 0, True])
    c.assign(np.full(step + 2, 0.5, np.float16))  # ... and c of another shape each time
print(json.dumps({"seen": seen, "reused": kept[1][:2] == kept[2][:2], "one_call": snapshot._read is not None}))
"""


def test_each_snapshot_holds_the_values_at_its_own_take_and_restores_them_whatever_changed_since(simulated_device):
    # From the second snapshot on the values come from one TensorFlow call and land in the last snapshot's host
    # arrays; a restore must give the values of the latest take, also for a variable whose shape changed since.
    r = simulated_device(REPEATED, limit_mb=64)
    assert r["one_call"] and r["reused"]
    assert r["seen"] == [
        [[0, 1, 2, 3, 4, 5], 7, [1, 1, 1], [1.5, -2.0], [True, False]],
        [[10, 11, 12, 13, 14, 15], 107, [0.5, 0.5], [11.5, 8.0], [True, True]],
        [[20, 21, 22, 23, 24, 25], 207, [0.5, 0.5, 0.5], [21.5, 18.0], [False, True]],
    ], r
