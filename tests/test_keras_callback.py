"""CapuchinCallback (capuchin_tf/frontend/keras_callback.py): Keras `model.fit` trains every batch through a
ManagedStep, gives
the same bits as a plain fit, refuses what it cannot manage, and fits a model under a limit plain Keras cannot."""

import concurrent.futures

import keras
import numpy as np
import pytest
import tensorflow as tf

import capuchin_tf  # noqa: F401  (loads the op library before TensorFlow's first op)
from capuchin_tf.frontend.keras_callback import CapuchinCallback

MiB = 1 << 20


def small_model(compile_kwargs=None) -> keras.Model:
    keras.utils.set_random_seed(0)
    tf.config.experimental.enable_op_determinism()
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                  **(compile_kwargs or {}))
    return model


def data(n: int = 64):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, 32)).astype("float32"), rng.integers(0, 10, n).astype("int32")


def fit(model: keras.Model, x, callbacks=(), y=None, epochs: int = 2, batch_size: int | None = 16):
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=list(callbacks))
    return ({k: [float(v).hex() for v in vs] for k, vs in history.history.items()},
            [w.numpy().tobytes() for w in model.weights])


def phases(report: dict) -> list[list[str]]:
    return [[s["phase"] for s in entry["steps"]] for entry in report.values()]


def test_fit_with_the_callback_is_bit_for_bit_a_plain_fit():
    x, y = data()
    reference = fit(small_model(), x, y=y)
    model = small_model()
    during = None

    class Spy(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            nonlocal during
            during = during or model.train_function

    capuchin = CapuchinCallback(policy="capuchin")
    assert fit(model, x, [capuchin, Spy()], y=y) == reference
    assert phases(capuchin.report()) == [["measured"] + ["plain"] * 7]  # 2 epochs x 4 batches, one signature
    entry, = capuchin.report().values()
    assert entry["budget_bytes"] == 4096 * MiB and entry["fallback_reason"] is None
    assert during.__func__ is CapuchinCallback._managed_train_function
    assert model.train_function is not during and model.train_function is not None  # Keras' own, restored


def test_unknown_cardinality_partial_batch_and_rebuilt_train_function():
    """A dataset of unknown length (each epoch ends on StopIteration from the iterator) with a partial last batch
    (a second input signature), and a train function Keras rebuilds mid-fit; a second fit reuses the plans."""
    x, y = data(72)  # 4 batches of 16, then one of 8

    def dataset():
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(16).filter(lambda *_: True)

    assert dataset().cardinality() == tf.data.UNKNOWN_CARDINALITY
    reference = fit(small_model(), dataset(), batch_size=None)

    class Rebuild(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                self.model.make_train_function(force=True)

    model = small_model()
    capuchin = CapuchinCallback()
    with pytest.warns(UserWarning, match="ran out of data"):
        assert fit(model, dataset(), [capuchin, Rebuild()], batch_size=None) == reference
    assert sorted(phases(capuchin.report())) == [["measured", "plain"], ["measured"] + ["plain"] * 7]
    fit(model, dataset(), [capuchin], batch_size=None, epochs=1)
    assert sorted(phases(capuchin.report())) == [["measured", "plain", "plain"], ["measured"] + ["plain"] * 11]


@pytest.mark.parametrize("kwargs, error, match", [
    ({"memory_budget": "12 parsecs"}, ValueError, "unknown unit"),
    ({"memory_budget": "8TiB"}, ValueError, "larger than the device"),
    ({"policy": "lru"}, ValueError, "unknown policy 'lru'.*capuchin"),
    ({"link": "pcie9"}, ValueError, "link must be one of"),
    ({"max_replans": -1}, ValueError, "max_replans must be a non-negative integer"),
])
def test_bad_arguments_are_refused_when_the_callback_is_made(kwargs, error, match):
    with pytest.raises(error, match=match):
        CapuchinCallback(**kwargs)


@pytest.mark.parametrize("compile_kwargs, match", [
    ({"steps_per_execution": 2}, "steps_per_execution=1"),
    ({"jit_compile": True}, "compile the model with jit_compile=False"),
    ({"run_eagerly": True}, "run_eagerly=False"),
])
def test_models_the_callback_cannot_manage_are_refused(compile_kwargs, match, monkeypatch):
    # Keras turns jit_compile=True off when op determinism is on (XLA lacks deterministic kernels): let it through.
    monkeypatch.setattr("keras.src.trainers.trainer.model_supports_jit", lambda model: True)
    model = small_model(compile_kwargs)
    x, y = data(32)
    keras_train_function = None

    class Record(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            nonlocal keras_train_function
            keras_train_function = self.model.train_function

    capuchin = CapuchinCallback()
    with pytest.raises(ValueError, match=match):
        fit(model, x, [Record(), capuchin], y=y)
    assert model.train_function is keras_train_function and capuchin.report() == {}


# The 16-layer, width-512 MLP of examples/hand_swapped_mlp.py, in Keras, at batch 2048: plain fit peaks at about
# 94 MiB with 16 MiB of weights and 4 MiB of prefetched batch (measured by hand at 4096 MiB).
MLP = """
import hashlib, json
import numpy as np
import tensorflow as tf
import keras
import capuchin_tf
from capuchin_tf.frontend.keras_callback import CapuchinCallback

keras.utils.set_random_seed(0)
tf.config.experimental.enable_op_determinism()
rng = np.random.default_rng(0)
x = rng.standard_normal((2 * 2048, 512)).astype("float32")
y = rng.integers(0, 10, 2 * 2048).astype("int32")
model = keras.Sequential([keras.Input((512,))] + [keras.layers.Dense(512, activation="relu") for _ in range(16)]
                         + [keras.layers.Dense(10)])
model.compile(optimizer=keras.optimizers.SGD(0.01),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
capuchin = CapuchinCallback() if CALLBACK else None
try:
    history = model.fit(x, y, batch_size=2048, epochs=2, shuffle=False, verbose=0,
                        callbacks=[capuchin] if capuchin else [])
except tf.errors.ResourceExhaustedError:
    print(json.dumps({"ok": False}))
else:
    result = {"ok": True, "loss": [float(v).hex() for v in history.history["loss"]],
              "weights": hashlib.sha256(b"".join(w.numpy().tobytes() for w in model.weights)).hexdigest()}
    if capuchin:
        entry, = capuchin.report().values()
        result.update(swapped=entry["swapped_tensors"], fallback=entry["fallback_reason"],
                      steps=[[s["phase"], s["peak_bytes"]] for s in entry["steps"]])
    print(json.dumps(result))
"""
LIMIT_MB = 56


def test_fit_under_a_limit_plain_keras_cannot_fit(simulated_device):
    runs = {"reference": ("False", 4096), "plain": ("False", LIMIT_MB), "capuchin": ("True", LIMIT_MB)}
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        futures = {name: pool.submit(simulated_device, MLP.replace("CALLBACK", flag), limit_mb=limit)
                   for name, (flag, limit) in runs.items()}
        reference, plain, managed = (futures[name].result() for name in runs)
    assert reference["ok"] and not plain["ok"], "plain Keras must fit with enough memory and run out under the limit"
    assert managed["ok"], "the callback must fit the model under the limit"
    assert (managed["loss"], managed["weights"]) == (reference["loss"], reference["weights"])
    assert managed["swapped"] > 0 and managed["fallback"] is None
    assert [phase for phase, _ in managed["steps"]] == ["measured", "guided", "guided", "guided"]
    assert all(peak <= LIMIT_MB * MiB for _, peak in managed["steps"])
