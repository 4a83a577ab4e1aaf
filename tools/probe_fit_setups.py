"""Model.fit with CapuchinCallback on setups the project was not developed on, against plain model.fit, bit for bit.

Each setup (a Keras model, optimizer and fit arguments: sample and class weights, validation data, multiple inputs and
outputs, a custom train_step, an optimizer with EMA, gradient accumulation and clipping, ConvLSTM2D and
GroupNormalization, random augmentation layers, string inputs through TextVectorization, a 50000-row embedding, a
host function in the forward pass) is fitted for 2 epochs of 3 batches plain on a 4096 MiB simulated device, then
with the callback at a budget of `--fraction` of that run's peak on the same device (the budget below the device: the
allocator holds it, and a peak under it is the plan's). Per setup: the outcome (guided and bit for bit, a refusal
and its message, or a difference), the peaks, and the callback's report.

    .venv/bin/python tools/probe_fit_setups.py --fraction 0.85 --json out.json [--setups a,b]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
import time

SETUPS = ("mnv2-sw-val", "resnet-classweight-l2", "ema-accum-clip", "multi-io", "custom-train-step",
          "convlstm-groupnorm", "augment", "text", "sparse-embedding", "numpy-function")
DEVICE_MB = 4096

WORKER = """
import hashlib, json, os, sys, warnings
import numpy as np
import tensorflow as tf
import keras
import capuchin_tf
from capuchin_tf.frontend.keras_callback import CapuchinCallback

setup, mode, budget = {setup!r}, {mode!r}, {budget!r}
keras.utils.set_random_seed(0)
keras.config.disable_traceback_filtering()
tf.config.experimental.enable_op_determinism()
rng = np.random.default_rng(0)
N, B = 96, 32
kw = {{}}
fit_kw = {{}}
SETUP_CODE
if not kw:
    kw = dict(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=metrics)
model.compile(optimizer=opt, jit_compile=False, **kw)
cap = CapuchinCallback(memory_budget=budget * (1 << 20)) if mode == "capuchin" else None
tf.config.experimental.reset_memory_stats("CPU:0")
error = None
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        history = model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0, callbacks=[cap] if cap else [],
                            **fit_kw)
    except Exception as e:  # noqa: BLE001  (a refusal is a result)
        error = f"{{type(e).__name__}}: {{e}}"
# (a managed step resets the device's peak at its start: with the callback this is the last step's peak and what came
# after it; the report's `peaks` are each managed step's)
res = {{"setup": setup, "mode": mode, "budget_mb": budget, "ok": error is None, "error": error,
        "peak_bytes": tf.config.experimental.get_memory_info("CPU:0")["peak"],
        "warnings": [str(w.message) for w in caught if "capuchin_tf" in str(w.message)]}}
if error is None:
    res["history"] = {{k: [float(v).hex() for v in vs] for k, vs in history.history.items()}}
    res["weights_sha256"] = hashlib.sha256(b"".join(np.asarray(w.numpy()).tobytes() for w in model.weights)).hexdigest()
if cap is not None:
    res["report"] = [{{k: e.get(k) for k in ("fallback_reason", "swapped_tensors", "recomputed_tensors", "replans",
                                              "passive_only", "floor_bytes", "settled")}}
                     | {{"phases": [s["phase"] for s in e["steps"]], "peaks": [s["peak_bytes"] for s in e["steps"]]}}
                     for e in cap.report().values()]
print("RESULT " + json.dumps(res))
"""

SETUP_CODE = """if setup == "mnv2-sw-val":
    x = rng.standard_normal((N, 32, 32, 3)).astype("float32"); y = rng.integers(0, 10, N).astype("int32")
    model = keras.applications.MobileNetV2(input_shape=(32, 32, 3), weights=None, classes=10)
    opt = keras.optimizers.Adam(1e-3)
    fit_kw = dict(sample_weight=rng.random(N).astype("float32"), validation_data=(x[:32], y[:32]))
    metrics = ["accuracy"]
elif setup == "resnet-classweight-l2":
    x = rng.standard_normal((N, 32, 32, 3)).astype("float32"); y = rng.integers(0, 4, N).astype("int32")
    inp = keras.Input((32, 32, 3)); h = inp
    for f in (32, 64, 64):
        r = keras.layers.Conv2D(f, 3, padding="same", kernel_regularizer=keras.regularizers.L2(1e-4))(h)
        r = keras.layers.BatchNormalization()(r); r = keras.layers.ReLU()(r)
        r = keras.layers.Conv2D(f, 3, padding="same")(r)
        s = keras.layers.Conv2D(f, 1)(h) if h.shape[-1] != f else h
        h = keras.layers.ReLU()(keras.layers.Add()([r, s])); h = keras.layers.MaxPool2D()(h)
    out = keras.layers.Dense(4)(keras.layers.GlobalAveragePooling2D()(h))
    model = keras.Model(inp, out); opt = keras.optimizers.SGD(0.01, momentum=0.9, nesterov=True)
    fit_kw = dict(class_weight={0: 1.0, 1: 2.0, 2: 0.5, 3: 1.5}); metrics = ["accuracy"]
elif setup == "ema-accum-clip":
    x = rng.standard_normal((N, 512)).astype("float32"); y = rng.integers(0, 10, N).astype("int32")
    model = keras.Sequential([keras.Input((512,))] + [keras.layers.Dense(1024, activation="gelu") for _ in range(6)]
                             + [keras.layers.Dense(10)])
    opt = keras.optimizers.AdamW(1e-3, use_ema=True, ema_overwrite_frequency=2, gradient_accumulation_steps=2,
                                 clipnorm=1.0)
    metrics = ["accuracy"]
elif setup == "multi-io":
    xa = rng.standard_normal((N, 64)).astype("float32"); xb = rng.integers(1, 500, (N, 20)).astype("int32")
    ya = rng.integers(0, 5, N).astype("int32"); yb = rng.standard_normal((N, 1)).astype("float32")
    a = keras.Input((64,), name="a"); b = keras.Input((20,), name="b", dtype="int32")
    e = keras.layers.Embedding(500, 64)(b); e = keras.layers.GRU(64)(e)
    h = keras.layers.Concatenate()([keras.layers.Dense(256, activation="relu")(a), e])
    h = keras.layers.Dense(512, activation="relu")(h); h = keras.layers.Dropout(0.3)(h)
    oa = keras.layers.Dense(5, name="cls")(h); ob = keras.layers.Dense(1, name="reg")(h)
    model = keras.Model({"a": a, "b": b}, {"cls": oa, "reg": ob}); opt = keras.optimizers.RMSprop(1e-3)
    x = {"a": xa, "b": xb}; y = {"cls": ya, "reg": yb}
    kw = dict(loss={"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "reg": "mse"},
              loss_weights={"cls": 1.0, "reg": 0.5}, metrics={"cls": ["accuracy"], "reg": ["mae"]})
    metrics = None
elif setup == "custom-train-step":
    x = rng.standard_normal((N, 28, 28, 1)).astype("float32"); y = rng.integers(0, 10, N).astype("int32")

    class M(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                p = self(x, training=True)
                decay = tf.add_n([tf.reduce_sum(w ** 2) for w in self.trainable_weights])
                loss = self.compute_loss(x=x, y=y, y_pred=p) + 1e-3 * decay
            g = tape.gradient(loss, self.trainable_weights)
            g, _ = tf.clip_by_global_norm(g, 1.0)
            self.optimizer.apply(g, self.trainable_weights)
            for m in self.metrics:
                if m.name == "loss": m.update_state(loss)
                else: m.update_state(y, p)
            return {m.name: m.result() for m in self.metrics}

    inp = keras.Input((28, 28, 1)); h = inp
    for f in (32, 64, 128):
        h = keras.layers.Conv2D(f, 3, padding="same", activation="relu")(h)
        h = keras.layers.LayerNormalization()(h); h = keras.layers.MaxPool2D()(h)
    model = M(inp, keras.layers.Dense(10)(keras.layers.Flatten()(h))); opt = keras.optimizers.Adam(1e-3)
    metrics = ["accuracy"]
elif setup == "convlstm-groupnorm":
    x = rng.standard_normal((N, 6, 16, 16, 2)).astype("float32"); y = rng.integers(0, 3, N).astype("int32")
    inp = keras.Input((6, 16, 16, 2))
    h = keras.layers.ConvLSTM2D(16, 3, padding="same", return_sequences=True)(inp)
    h = keras.layers.TimeDistributed(keras.layers.Conv2D(32, 3, padding="same"))(h)
    h = keras.layers.GroupNormalization(groups=4)(h)
    h = keras.layers.GlobalAveragePooling3D()(h)
    model = keras.Model(inp, keras.layers.Dense(3)(h)); opt = keras.optimizers.Nadam(1e-3); metrics = ["accuracy"]
elif setup == "augment":
    x = rng.standard_normal((N, 32, 32, 3)).astype("float32"); y = rng.integers(0, 10, N).astype("int32")
    inp = keras.Input((32, 32, 3))
    h = keras.layers.RandomFlip("horizontal", seed=1)(inp)
    h = keras.layers.RandomRotation(0.1, seed=2)(h)
    h = keras.layers.RandomZoom(0.1, seed=3)(h)
    for f in (32, 64, 128):
        h = keras.layers.Conv2D(f, 3, padding="same", activation="relu")(h)
        h = keras.layers.BatchNormalization()(h); h = keras.layers.MaxPool2D()(h)
    h = keras.layers.Dropout(0.25, seed=4)(keras.layers.Flatten()(h))
    model = keras.Model(inp, keras.layers.Dense(10)(h)); opt = keras.optimizers.Adam(1e-3); metrics = ["accuracy"]
elif setup == "text":
    words = np.array(["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"])
    x = np.array([" ".join(rng.choice(words, 40)) for _ in range(N)]); y = rng.integers(0, 2, N).astype("int32")
    vectorize = keras.layers.TextVectorization(max_tokens=64, output_sequence_length=40)
    vectorize.adapt(x)
    inp = keras.Input((1,), dtype="string")
    h = keras.layers.Embedding(64, 256)(vectorize(keras.layers.Reshape(())(inp)))
    h = keras.layers.Conv1D(256, 5, padding="same", activation="relu")(h)
    h = keras.layers.Bidirectional(keras.layers.LSTM(64, return_sequences=True))(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    model = keras.Model(inp, keras.layers.Dense(2)(h)); opt = keras.optimizers.Adam(1e-3); metrics = ["accuracy"]
    x = tf.constant(x.reshape(N, 1).tolist())  # a string tensor (Keras refuses numpy's fixed-width strings)
elif setup == "sparse-embedding":
    x = rng.integers(0, 50000, (N, 64)).astype("int32"); y = rng.integers(0, 10, N).astype("int32")
    inp = keras.Input((64,), dtype="int32")
    h = keras.layers.Embedding(50000, 64)(inp)
    h = keras.layers.Dense(512, activation="relu")(keras.layers.Flatten()(h))
    model = keras.Model(inp, keras.layers.Dense(10)(h)); opt = keras.optimizers.Adam(1e-3); metrics = ["accuracy"]
elif setup == "numpy-function":
    x = rng.standard_normal((N, 256)).astype("float32"); y = rng.integers(0, 10, N).astype("int32")

    def host_side(t):  # a host computation in the forward pass: tf.numpy_function, no gradient through it
        out = tf.numpy_function(lambda a: np.tanh(a).astype("float32"), [t], tf.float32)
        return tf.stop_gradient(tf.ensure_shape(out, t.shape))

    inp = keras.Input((256,))
    h = keras.layers.Dense(1024, activation="relu")(inp)
    h = keras.layers.Add()([h, keras.layers.Lambda(host_side, output_shape=(1024,))(h)])
    h = keras.layers.Dense(1024, activation="relu")(h)
    model = keras.Model(inp, keras.layers.Dense(10)(h)); opt = keras.optimizers.SGD(0.01); metrics = ["accuracy"]
else:
    raise SystemExit(f"unknown setup {setup}")"""


def run(setup: str, mode: str, budget: int | None, timeout: float) -> dict:
    from capuchin_tf.tf.simulated_device import simulated_device_env

    code = textwrap.dedent(WORKER).format(setup=setup, mode=mode, budget=budget).replace("SETUP_CODE", SETUP_CODE)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=simulated_device_env(DEVICE_MB), timeout=timeout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        return {"setup": setup, "mode": mode, "budget_mb": budget, "ok": False,
                "error": f"the worker died (exit {proc.returncode}): {proc.stderr[-2000:]}"}
    return json.loads(line[len("RESULT "):])


def outcome(plain: dict, managed: dict) -> str:
    if not plain["ok"]:
        return "plain failed"
    if managed["ok"]:
        same = (managed["history"] == plain["history"] and managed["weights_sha256"] == plain["weights_sha256"])
        if not same:
            return "MISMATCH"
        reports = managed.get("report") or []
        if any(r["fallback_reason"] for r in reports):
            return "refused, plain step ran (bit for bit)"
        return "guided, bit for bit" if all(set(r["phases"][1:]) <= {"guided"} for r in reports) else \
            "managed with passive steps, bit for bit"
    first = managed["error"].split(":", 1)[0]
    return f"refused ({first})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--fraction", type=float, default=0.85, help="the budget as a fraction of plain fit's peak")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", required=True)
    a = p.parse_args()
    from capuchin_tf.cli.common import git_commit, machine

    results = []
    for setup in a.setups.split(","):
        plain = run(setup, "plain", None, a.timeout)
        budget = int(a.fraction * plain.get("peak_bytes", 0) / 2**20) if plain["ok"] else None
        managed = run(setup, "capuchin", budget, a.timeout) if budget else {"ok": False, "error": "no budget"}
        results.append({"setup": setup, "outcome": outcome(plain, managed), "plain": plain, "capuchin": managed})
        steps = [p for r in managed.get("report") or [] for p in r["peaks"]]
        print(f"{setup}: {results[-1]['outcome']}; plain peak {plain.get('peak_bytes', 0) / 2**20:.1f} MiB, budget "
              f"{budget} MiB, managed steps' peak {max(steps, default=0) / 2**20:.1f} MiB"
              + (f"; {managed['error'][:400]}" if managed.get("error") else ""), flush=True)
    with open(a.json, "w") as f:
        json.dump({"kind": "capuchin_tf fit setups", "commit": git_commit(), "date": time.strftime("%Y-%m-%d"),
                   "machine": machine(), "device_mb": DEVICE_MB, "fraction": a.fraction, "results": results}, f,
                  indent=1)
    return 1 if any(r["outcome"] == "MISMATCH" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
