"""Same numbers or a clear refusal: what happens when something goes wrong, each case with a small step in this
process (device of 4 GiB, budgets below it are enforced by the allocator)."""

import hashlib
import json
import threading
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import capuchin_tf
from capuchin_tf.cli import models
from capuchin_tf.runtime import managed_step

MiB = 1 << 20


def digest(variables):
    h = hashlib.sha256()
    for v in variables:
        h.update(np.asarray(v.numpy()).tobytes())
    return h.hexdigest()


@pytest.fixture(autouse=True, scope="module")
def small_pool_taken():
    """The small-tensor pool (up to 8 MiB of the device) is taken at a process's first managed step: taken here, before
    any test reads what is on the device, whichever test runs first in the process (pytest-xdist)."""
    capuchin_tf.function(tf.function(lambda x: x * 2.0))(tf.ones([4]))


def budget_now(transient_mib=6):
    """What is on the device now plus `transient_mib`: for the mlp at batch 256 (13.4 MiB of weights, a transient
    peak of about 9.5 MiB) a budget that needs a plan; earlier models of this process may still be on the device."""
    return tf.config.experimental.get_memory_info("CPU:0")["current"] + transient_mib * MiB


def plain_run(name, batch, steps):
    setup = models.build(name, batch)
    losses = [float.hex(float(setup.train_step(*setup.inputs))) for _ in range(steps)]
    return losses, digest(setup.variables)


@pytest.fixture(scope="module")
def mlp_plain():
    return {steps: plain_run("mlp", 256, steps) for steps in (1, 2)}


def test_an_error_after_the_measured_step_wrote_the_variables_is_not_raised(monkeypatch, mlp_plain):
    # The measured step has applied its update when planning starts: an error there (the planner, the device model,
    # the rewrite) is not raised (a caller that retried would apply the update twice). The signature is refused with
    # one warning and runs as plain TensorFlow; the update was applied exactly once.
    def broken_plan(*args, **kwargs):
        raise RuntimeError("planner bug")

    monkeypatch.setattr(managed_step, "make_plan", broken_plan)
    monkeypatch.setattr(managed_step, "NOTHING_TO_SAVE", 0.0)  # plan even if the step fits
    setup = models.build("mlp", 256)
    step = capuchin_tf.function(setup.train_step, memory_budget=2048 * MiB)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = float.hex(float(step(*setup.inputs)))
        assert [first] == mlp_plain[1][0] and digest(setup.variables) == mlp_plain[1][1]
        second = float.hex(float(step(*setup.inputs)))
    assert [first, second] == mlp_plain[2][0] and digest(setup.variables) == mlp_plain[2][1]
    messages = [str(w.message) for w in caught if "capuchin_tf" in str(w.message)]
    assert len(messages) == 1 and "planning failed" in messages[0] and "planner bug" in messages[0]
    (report,) = step.report().values()
    assert [s["phase"] for s in report["steps"]] == ["measured", "plain"]


def test_a_planning_failure_is_kept_for_a_replay(monkeypatch, tmp_path, mlp_plain, capsys):
    # keep_failures: the trace and error of a planning failure are kept, the warning says where, and `plan --replay`
    # plans the kept trace again with the budget, policy and device model the runtime had (here the real planner,
    # which plans it: the failure was the patched one's).
    from capuchin_tf.cli import main
    from capuchin_tf.policy.simulator import InfeasiblePlanError

    def broken_plan(*args, **kwargs):
        raise InfeasiblePlanError("tensor 'x:0' is read while evicted")

    monkeypatch.setattr(managed_step, "make_plan", broken_plan)
    monkeypatch.setattr(managed_step, "NOTHING_TO_SAVE", 0.0)
    setup = models.build("mlp", 256)
    step = capuchin_tf.function(setup.train_step, memory_budget=2048 * MiB, keep_failures=tmp_path / "kept")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = float.hex(float(step(*setup.inputs)))
    assert [first] == mlp_plain[1][0] and digest(setup.variables) == mlp_plain[1][1]
    (message,) = [str(w.message) for w in caught if "capuchin_tf" in str(w.message)]
    (kept,) = (tmp_path / "kept").iterdir()
    assert f"kept in {kept}" in message and "InfeasiblePlanError" in message
    (report,) = step.report().values()
    assert report["kept_failure"] == str(kept)
    record = json.loads((kept / "failure.json").read_text())
    assert record["budget_bytes"] == 2048 * MiB and record["policy"] == "capuchin"
    assert record["planner_options"] == {"fallback": True} and "broken_plan" in record["traceback"]
    capsys.readouterr()
    assert main.main(["plan", "--replay", str(kept), "--json", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "it failed with InfeasiblePlanError" in out and "planned this time" in out
    assert json.loads((tmp_path / "plan.json").read_text())["budget_bytes"] == 2048 * MiB
    # Broken on purpose: the replay fails and says how.
    record["planner_options"] = {"no_such_option": 1}
    (kept / "failure.json").write_text(json.dumps(record))
    assert main.main(["plan", "--replay", str(kept)]) == 1
    assert "no_such_option" in capsys.readouterr().err


def test_strict_raises_with_the_variables_as_they_were(monkeypatch, mlp_plain):
    def broken_plan(*args, **kwargs):
        raise RuntimeError("planner bug")

    monkeypatch.setattr(managed_step, "make_plan", broken_plan)
    monkeypatch.setattr(managed_step, "NOTHING_TO_SAVE", 0.0)
    setup = models.build("mlp", 256)
    before = digest(setup.variables)
    step = capuchin_tf.function(setup.train_step, memory_budget=2048 * MiB, strict=True)
    with pytest.raises(capuchin_tf.CapuchinError, match="planning failed"):
        step(*setup.inputs)
    assert digest(setup.variables) == before


def test_a_plan_cache_that_cannot_be_written_is_a_warning(tmp_path, mlp_plain):
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("a file where the cache directory should be")
    setup = models.build("mlp", 256)
    step = capuchin_tf.function(setup.train_step, memory_budget=budget_now(), plan_cache=str(blocker / "plans"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [float.hex(float(step(*setup.inputs))) for _ in range(2)]
    assert losses == mlp_plain[2][0] and digest(setup.variables) == mlp_plain[2][1]
    assert any("could not be cached" in str(w.message) for w in caught)


def test_an_error_of_capuchin_graph_restores_and_falls_back_once(monkeypatch, mlp_plain):
    # An error of the measured graph that the plain step does not have: the variables are restored, the plain step
    # runs, and the signature is refused with one warning naming the error.
    from capuchin_tf.tf import measure

    def broken(*args, **kwargs):
        raise tf.errors.InvalidArgumentError(None, None, "node capuchin/get/x has inputs from different frames")

    monkeypatch.setattr(measure, "measure_step", broken)
    setup = models.build("mlp", 256)
    step = capuchin_tf.function(setup.train_step, memory_budget=budget_now())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [float.hex(float(step(*setup.inputs))) for _ in range(2)]
    assert losses == mlp_plain[2][0] and digest(setup.variables) == mlp_plain[2][1]
    messages = [str(w.message) for w in caught if "capuchin_tf" in str(w.message)]
    assert len(messages) == 1 and "different frames" in messages[0]


def test_the_step_own_error_is_raised_and_nothing_is_marked(monkeypatch):
    # An error of the step itself (here a failed check on the inputs) is the user's: raised, and the next call is
    # measured again, not run as plain TensorFlow forever.
    v = tf.Variable(tf.ones([64, 64]))

    @tf.function
    def step(x):
        with tf.control_dependencies([tf.debugging.assert_all_finite(x, "inputs must be finite")]):
            v.assign_add(tf.matmul(x, v) * 1e-3)
        return tf.reduce_sum(v)

    managed = capuchin_tf.function(step, memory_budget=budget_now(4))
    with pytest.raises(tf.errors.InvalidArgumentError, match="inputs must be finite"):
        managed(tf.fill([64, 64], np.nan))
    assert float(v.numpy()[0, 0]) == 1.0
    managed(tf.ones([64, 64]))
    (report,) = managed.report().values()
    assert report["steps"][0]["phase"] == "measured" and report["fallback_reason"] is None


def test_a_step_that_reads_a_lookup_table_is_managed():
    # A lookup table read (Keras' TextVectorization, StringLookup) writes nothing: the step is measured and guided like
    # any other, bit for bit, not refused as state capuchin_tf cannot restore (it was, before the table's read ops were
    # known as reads). Op determinism: the embedding's sparse update sums duplicate rows in a thread-dependent order
    # without it, in plain TensorFlow too.
    tf.config.experimental.enable_op_determinism()

    def build():
        keras.utils.set_random_seed(0)
        lookup = keras.layers.StringLookup(vocabulary=["alpha", "beta", "gamma", "delta"])
        layers = [keras.layers.Embedding(lookup.vocabulary_size(), 256), keras.layers.Dense(256, activation="relu"),
                  keras.layers.Dense(256, activation="relu")]
        head = keras.layers.Dense(4)
        optimizer = keras.optimizers.SGD(0.1)
        variables = []

        @tf.function
        def step(words, labels):
            with tf.GradientTape() as tape:
                h = lookup(words)
                for layer in layers:
                    h = layer(h)
                logits = head(tf.reduce_mean(h, axis=1))
                loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
            variables[:] = [v for layer in layers + [head] for v in layer.trainable_variables]
            optimizer.apply(tape.gradient(loss, variables), variables)
            return loss

        return step, variables

    words = tf.constant([["alpha", "gamma", "beta", "zeta"] * 16] * 64)  # 4 MiB a [64, 64, 256] activation
    labels = tf.constant(np.arange(64) % 4, tf.int32)
    step, variables = build()
    plain = [float.hex(float(step(words, labels))) for _ in range(3)]
    expected = digest(variables)
    step, variables = build()
    managed = capuchin_tf.function(step, memory_budget=budget_now(16))  # a transient peak of about 16 MiB
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [float.hex(float(managed(words, labels))) for _ in range(3)] == plain
    assert digest(variables) == expected
    assert not [str(w.message) for w in caught if "capuchin_tf" in str(w.message)]
    (report,) = managed.report().values()
    assert [s["phase"] for s in report["steps"]] == ["measured", "guided", "guided"], report
    assert report["swapped_tensors"] + report["recomputed_tensors"] > 0, report


def test_a_step_that_writes_state_capuchin_cannot_restore_is_refused_before_it_runs():
    table = tf.lookup.experimental.MutableHashTable(tf.int64, tf.float32, default_value=0.0)
    v = tf.Variable(1.0)

    @tf.function
    def step(x):
        table.insert(tf.constant([1], tf.int64), tf.reshape(x, [1]))
        v.assign_add(x)
        return v

    managed = capuchin_tf.function(step, memory_budget=budget_now(4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert float(managed(tf.constant(2.0))) == 3.0
    messages = [str(w.message) for w in caught if "capuchin_tf" in str(w.message)]
    assert len(messages) == 1 and "cannot copy and restore" in messages[0] and "LookupTableInsert" in messages[0]
    (report,) = managed.report().values()
    assert [s["phase"] for s in report["steps"]] == ["plain"]
    strict = capuchin_tf.function(step, memory_budget=budget_now(4), strict=True)
    with pytest.raises(capuchin_tf.CapuchinError, match="cannot copy and restore"):
        strict(tf.constant(2.0))
    assert float(v.numpy()) == 3.0


def test_a_step_that_writes_a_summary_is_refused_with_what_to_do(tmp_path):
    # A summary written in the step (tf.summary's ops, here the raw op: TensorBoard is not installed) is refused like
    # any write capuchin_tf cannot restore, and the warning says how to keep the step managed.
    writer = tf.summary.create_file_writer(str(tmp_path))
    v = tf.Variable(1.0)

    @tf.function
    def step(x):
        v.assign_add(x)
        tf.raw_ops.WriteScalarSummary(writer=writer._resource, step=tf.constant(0, tf.int64), tag="v", value=v)
        return v

    managed = capuchin_tf.function(step, memory_budget=budget_now(4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert float(managed(tf.constant(2.0))) == 3.0
    (message,) = [str(w.message) for w in caught if "capuchin_tf" in str(w.message)]
    assert "WriteScalarSummary" in message and "write summaries outside the managed step" in message


def test_decisions_are_per_input_shape_and_bounded():
    # An input signature with open dimensions is one concrete function for every batch size; a batch-16 decision
    # must not be reused at batch 4096. Each shape is measured and planned on its own, at most max_signatures
    # of them (the least recently used goes, with one warning).
    v = tf.Variable(tf.ones([32, 32]))

    @tf.function(input_signature=[tf.TensorSpec([None, 32], tf.float32)])
    def step(x):
        v.assign_add(tf.matmul(x, x, transpose_a=True) * 1e-6)
        return tf.reduce_sum(v)

    managed = capuchin_tf.function(step, memory_budget=budget_now(4), max_signatures=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in (16, 4096, 16, 64):
            managed(tf.ones([batch, 32]))
    keys = list(managed.report())
    assert len(keys) == 2 and "[64, 32]" in keys[-1] and "[16, 32]" in keys[0]
    assert sum("input signatures" in str(w.message) for w in caught) == 1
    phases = {k: [s["phase"] for s in r["steps"]] for k, r in managed.report().items()}
    assert phases[keys[0]][0] == "measured" and len(phases[keys[0]]) == 2


def test_the_plan_cache_key_covers_shapes_attributes_variables_and_versions():
    from capuchin_tf.runtime.signature import SignatureState

    def make(n):
        v = tf.Variable(tf.ones([n, n]), name="w")

        @tf.function
        def step(x):
            v.assign_sub(0.1 * tf.matmul(x, v))
            return tf.reduce_sum(v)

        return step, (tf.ones([n, n]),)

    keys = []
    for n in (4, 8):
        step, args = make(n)
        managed = capuchin_tf.function(step, memory_budget=budget_now(4))
        state = SignatureState(concrete=step.get_concrete_function(*args))
        keys.append(managed._cache_key(state, args))
    assert keys[0].digest() != keys[1].digest()
    assert keys[0].variables != keys[1].variables and keys[0].capuchin_tf_version == capuchin_tf.__version__
    # the same model traced again (a restarted job) gets the same key
    step, args = make(4)
    managed = capuchin_tf.function(step, memory_budget=budget_now(4))
    again = managed._cache_key(SignatureState(concrete=step.get_concrete_function(*args)), args)
    assert again.graph_fingerprint == keys[0].graph_fingerprint


def test_two_threads_running_managed_steps_each_get_their_own_measurement_and_plan(mlp_plain):
    # The profiler, passive mode and the allocator's budget are process-wide: two managed steps running at once
    # collided in the profiler and both went on as plain TensorFlow, silently. One runs at a time now.
    setups = [models.build("mlp", 256) for _ in range(2)]
    budget = budget_now()
    steps = [capuchin_tf.function(s.train_step, memory_budget=budget) for s in setups]
    results, errors = [None, None], []

    def run(i):
        try:
            results[i] = [float.hex(float(steps[i](*setups[i].inputs))) for _ in range(2)]
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(2):
        assert results[i] == mlp_plain[2][0] and digest(setups[i].variables) == mlp_plain[2][1]
        (report,) = steps[i].report().values()
        assert [s["phase"] for s in report["steps"]] == ["measured", "guided"], report


def test_a_budget_below_what_the_step_needs_at_once_names_what_was_in_use():
    # A float16 MatMul on the CPU converts its inputs and output to float32 inside the kernel (Eigen): about 10 MiB of
    # temporaries no graph shows (2 MiB, then 6.12 MiB for x), so the working-set floor passes and the measured step
    # runs out of memory in both its runs. The error splits what was in use into the persistent state, the pool's
    # tensors and what capuchin_tf does
    # not manage (here those temporaries), and the variable is as it was.
    w = tf.Variable(tf.cast(tf.random.stateless_normal([784, 512], seed=[1, 2]), tf.float16))
    x = tf.cast(tf.random.stateless_normal([2048, 784], seed=[3, 4]), tf.float16)

    @tf.function
    def step(x):
        y = tf.matmul(x, w)
        w.assign_sub(tf.cast(tf.reduce_mean(y), tf.float16) * tf.ones_like(w) * 1e-3)
        return tf.cast(tf.reduce_sum(y), tf.float32)  # no float32 copy of y in the graph

    before = digest([w])
    budget = budget_now(transient_mib=7)  # above the MatMul's 5.8 MiB of inputs and output
    managed = capuchin_tf.function(step, memory_budget=budget)
    with pytest.raises(capuchin_tf.BudgetError) as caught:
        managed(x)
    message = str(caught.value)
    assert "could not evict (" in message, message
    assert "persistent state" in message and "that capuchin_tf does not manage" in message, message
    value, unit = message.split(" that capuchin_tf does not manage")[0].rsplit(", ", 1)[-1].split()
    assert unit == "MiB" and float(value) >= 1.0, message  # the kernel's first float32 temporary
    assert "op 'MatMul' asked for 6.12 MiB" in message, message  # the float32 copy of x
    assert digest([w]) == before


def test_optimizer_slots_that_share_a_buffer_count_in_the_floor():
    # Keras starts an optimizer's zeros slots of one shape as one cached zeros tensor: until their first write, Adam's m
    # and v and the gradient accumulators of a weight share its buffer, and the device holds a third of what they will
    # own (AdamW with EMA and gradient accumulation through model.fit: 28 MiB on the device, 110 MiB laid out). A
    # budget below what they will own is refused before anything runs.
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(4096, use_bias=False), keras.layers.Dense(10)])
    optimizer = keras.optimizers.AdamW(1e-3, gradient_accumulation_steps=2)
    x, y = tf.ones([32, 1024]), tf.zeros([32], tf.int32)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    train_step.get_concrete_function(x, y)  # the slots exist, sharing buffers
    weight = 1024 * 4096 * 4
    before = [v.numpy().tobytes() for v in model.variables]
    step = capuchin_tf.function(train_step, memory_budget=budget_now(0) + 3 * weight)
    with pytest.raises(capuchin_tf.BudgetError, match="share one buffer until their first write.*nothing was run"):
        step(x, y)
    assert [v.numpy().tobytes() for v in model.variables] == before
