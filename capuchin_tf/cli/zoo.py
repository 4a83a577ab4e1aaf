"""The conformance zoo: training steps as users write them, each run under a budget and checked bit for bit.

    python -m capuchin_tf bench zoo [--cases NAME,...|--ci] [--steps 5] [--fraction 0.5] [--timeout 900]
        [--json docs/results/zoo.json] [--markdown docs/zoo.md]

Each case is a training step buildable through `capuchin_tf.cli.models.build(name, batch)` (names `zoo/...` are built
here; the quick and standard tiers keep their own names), so the `bench` worker runs it in a fresh process. Per case
(docs/zoo.md):

1. plain TensorFlow (policy `tf`) on a 16 GiB device: persistent bytes, peak, losses, variables digest, step times;
2. budget = persistent + fraction x transient peak (`capuchin_tf.core.budget.fraction_budget_mb`);
3. `capuchin_tf.function(memory_budget=budget, policy="capuchin", link="native")` on a device of exactly the budget,
   the model built from the plain run's initial values (`models.initial_values`: its initializers do not run on the
   device, whose size could otherwise decide whether the model builds);
4. the same on a device of twice the budget.

Each run is classified (`classify`): `guided`, `refused`, `floor`, `fragmented`, `no-build`, `mismatch`, `crash`,
`over-budget`, or `partial` (bit for bit and under the budget, but not every step after the measured one guided). The
JSON is written after each case; the markdown table replaces the part of --markdown between the two `zoo-table` markers.

The case definitions import TensorFlow and Keras only when a case is built, and never capuchin_tf's op library (as
`models`); the classification and the table are pure Python.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import json
import os
import pathlib
import re
import statistics
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from capuchin_tf.cli.common import git_commit, machine
from capuchin_tf.core.budget import MiB

PREFIX = "zoo/"
PLAIN_DEVICE_MB = 16384  # the plain run's device (16 GiB): enough for every case
OUTCOMES = ("guided", "refused", "partial", "floor", "fragmented", "no-build", "over-budget", "crash", "mismatch")
FAILING_OUTCOMES = ("mismatch", "crash")  # the command's exit code is 1 when a run has one of these
MARK_BEGIN = "<!-- zoo-table: begin (written by `python -m capuchin_tf bench zoo --markdown`) -->"
MARK_END = "<!-- zoo-table: end -->"


# --------------------------------------------------------------------------------------------------------------------
# The cases.


@dataclasses.dataclass(frozen=True)
class Case:
    """One zoo case: a model name `models.build` takes, at the batch the zoo runs it."""

    name: str  # "zoo/efficientnetb0", or a benchmark tier's model name ("resnet50")
    batch: int
    group: str  # "applications", "layers", "setups", "tiers"
    description: str
    ci: bool = False  # one of the fast cases of `--ci` (tests/test_zoo.py)
    needs: str | None = None  # an optional module the case needs ("keras_hub")


# keras.applications: (class name, input size, classes, optimizer, batch). Sizes: the smallest each model takes
# (32 px; Xception 71, InceptionV3 and InceptionResNetV2 75), so that a step takes seconds on 2 cores. Keras 3 has no
# RegNet (keras.applications lost it in Keras 3), so there is none here.
_APPLICATIONS: dict[str, tuple[str, int, int, str, int]] = {
    "mobilenet": ("MobileNet", 32, 100, "sgd", 32),
    "mobilenetv2": ("MobileNetV2", 32, 100, "sgd", 32),
    "mobilenetv3small": ("MobileNetV3Small", 32, 100, "adam", 32),
    "mobilenetv3large": ("MobileNetV3Large", 32, 100, "rmsprop", 32),
    "efficientnetb0": ("EfficientNetB0", 32, 100, "adam", 32),
    "efficientnetb1": ("EfficientNetB1", 32, 100, "sgd", 32),
    "efficientnetv2b0": ("EfficientNetV2B0", 32, 100, "adam", 32),
    "efficientnetv2b1": ("EfficientNetV2B1", 32, 100, "momentum", 32),
    "resnet50": ("ResNet50", 32, 100, "momentum", 16),
    "resnet101": ("ResNet101", 32, 100, "sgd", 16),
    "resnet152": ("ResNet152", 32, 100, "sgd", 16),
    "resnet50v2": ("ResNet50V2", 32, 100, "momentum", 16),
    "resnet101v2": ("ResNet101V2", 32, 100, "sgd", 16),
    "densenet121": ("DenseNet121", 32, 100, "momentum", 32),
    "densenet169": ("DenseNet169", 32, 100, "sgd", 32),
    "inceptionv3": ("InceptionV3", 75, 100, "rmsprop", 16),
    "inceptionresnetv2": ("InceptionResNetV2", 75, 100, "sgd", 16),
    "xception": ("Xception", 71, 100, "adam", 16),
    "nasnetmobile": ("NASNetMobile", 32, 100, "sgd", 32),
    "convnexttiny": ("ConvNeXtTiny", 32, 100, "adamw", 16),
    "vgg16": ("VGG16", 32, 100, "sgd", 32),
    "vgg19": ("VGG19", 32, 100, "momentum", 32),
}

_OPTIMIZERS: dict[str, str] = {
    "sgd": "SGD(0.01)",
    "momentum": "SGD(0.01, momentum 0.9)",
    "adam": "Adam(1e-3)",
    "adamw": "AdamW(1e-3, weight decay 0.05)",
    "rmsprop": "RMSprop(1e-3)",
}

# The training set-ups and Keras layer models: name -> (batch, description, in --ci).
_CUSTOM: dict[str, tuple[int, str, bool]] = {
    "lstm": (64, "LSTM(256) over 64 steps of 32 features (a While loop), 10 classes, Adam", False),
    "gru": (64, "GRU(256) over 64 steps of 32 features (a While loop), 10 classes, Adam", False),
    "bilstm": (32, "Bidirectional(LSTM(128), return_sequences) + mean over time, 64 steps of 32 features, 10 "
                   "classes, Adam", False),
    "conv1d": (128, "Conv1D stack over 256 steps of 8 channels, global max pool, 10 classes, SGD", False),
    "conv3d": (16, "Conv3D stack (8, 16, 16 filters) over a 24x24x24x1 volume, global average pool, 10 classes, "
                   "SGD", False),
    "masked-transformer": (32, "2-layer encoder (hidden 64, 4 heads) over padded tokens: Embedding(mask_zero) and "
                               "an explicit attention mask, MultiHeadAttention, LayerNormalization, dropout, "
                               "masked mean pooling, 10 classes, Adam", False),
    "mixed-float16": (2048, "MLP (784-512x8-10) under mixed_float16 with keras.optimizers.LossScaleOptimizer(SGD) "
                            "(its update in a cond on finite gradients; scale_loss in the step)", False),
    "mixed-bfloat16": (2048, "MLP (784-512x8-10) under mixed_bfloat16, Adam", False),
    "clip-global-norm": (2048, "MLP (784-512x8-10), tf.clip_by_global_norm(grads, 0.5), SGD momentum", True),
    "grad-accum": (2048, "MLP (784-512x8-10), gradients summed into variables and applied in a tf.cond every 2 steps "
                         "(then zeroed), SGD", True),
    "gan": (2048, "MLP GAN: generator 64-256-512-784 (tanh, BatchNorm) and discriminator 784-512-256-1, two Adam "
                  "optimizers in one step; returns d_loss + g_loss", False),
    "random-generator": (2048, "MLP (784-512x8-10) with tf.random.Generator noise added to its inputs, SGD", True),
    "dropout": (2048, "MLP (784-512x8-10) with GaussianNoise and Dropout after every layer, SGD", False),
    "finite-guard": (2048, "MLP (784-512x8-10) whose step applies the update in a user's tf.cond on a finite loss, "
                           "SGD momentum", True),
    "cnn-dropout": (128, "small CNN @32x32 with Dropout, SpatialDropout2D and GaussianNoise, SGD", False),
    "cnn-mixed-float16": (64, "small CNN @32x32 under mixed_float16 with LossScaleOptimizer(SGD)", False),
}

_LAYER_MODELS = ("lstm", "gru", "bilstm", "conv1d", "conv3d", "masked-transformer")
_CI_APPLICATIONS: tuple[str, ...] = ()  # a keras.applications case takes 100 s or more: none in CI

# The benchmark tiers (capuchin_tf.cli.models), at the batches the project measures them.
_TIERS: dict[str, int] = {
    "mlp": 2048, "cnn": 128, "transformer": 32, "dropout-bn": 128,
    "resnet50": 32, "vgg16": 32, "inceptionv3": 32, "densenet121": 32, "bert-4l": 32,
}


def _cases() -> dict[str, Case]:
    out: dict[str, Case] = {}
    for key, (cls, size, classes, opt, batch) in _APPLICATIONS.items():
        out[PREFIX + key] = Case(PREFIX + key, batch, "applications",
                                 f"keras.applications.{cls} @{size}x{size}, {classes} classes, {_OPTIMIZERS[opt]}",
                                 ci=key in _CI_APPLICATIONS)
    for key, (batch, description, ci) in _CUSTOM.items():
        group = "layers" if key in _LAYER_MODELS else "setups"
        out[PREFIX + key] = Case(PREFIX + key, batch, group, description, ci=ci)
    for name, batch in _TIERS.items():
        out[name] = Case(name, batch, "tiers", f"benchmark tier model {name!r} (capuchin_tf.cli.models)",
                         needs="keras_hub" if name.startswith("bert") else None)
    return out


CASES: dict[str, Case] = _cases()
CI_CASES: tuple[str, ...] = tuple(n for n, c in CASES.items() if c.ci)
GROUPS = ("applications", "layers", "setups", "tiers")


def is_zoo_model(name: str) -> bool:
    return name.startswith(PREFIX) and name in CASES


def select(spec: str | None = None, ci: bool = False) -> list[Case]:
    """The cases of `--cases` (names or group names, comma-separated; default all) or of `--ci`. Raises ValueError
    for an unknown name."""
    if ci:
        return [CASES[n] for n in CI_CASES]
    if not spec:
        return list(CASES.values())
    out: list[Case] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if item in GROUPS:
            out += [c for c in CASES.values() if c.group == item]
        elif item in CASES or PREFIX + item in CASES:
            out.append(CASES[item if item in CASES else PREFIX + item])
        else:
            raise ValueError(f"unknown zoo case {item!r}; valid: {', '.join(GROUPS)}, {', '.join(CASES)}")
    return list(dict.fromkeys(out))


def describe() -> str:
    width = max(len(n) for n in CASES)
    lines = [f"{'case':<{width}}  {'batch':>5}  {'group':<12}  ci  description"]
    for c in CASES.values():
        lines.append(f"{c.name:<{width}}  {c.batch:>5}  {c.group:<12}  {'*' if c.ci else ' '}   {c.description}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------------
# Building a case (imports TensorFlow and Keras).


def build(name: str, batch: int, seed: int = 0):
    """The case `name` ("zoo/...") as a `models.TrainingSetup` for batch `batch` (what `models.build` returns)."""
    import keras
    import tensorflow as tf

    if not is_zoo_model(name):
        raise ValueError(f"unknown zoo case {name!r}; valid: {', '.join(n for n in CASES if n.startswith(PREFIX))}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive integer, got {batch!r}")
    keras.utils.set_random_seed(seed)
    tf.config.experimental.enable_op_determinism()
    key = name[len(PREFIX):]
    if key in _APPLICATIONS:
        spec = _application(key, batch, seed)
    else:
        spec = _BUILDERS[key](batch, seed)
    return _finish(name, batch, seed, spec)


@dataclasses.dataclass
class _Spec:
    """What a case builder returns: the step as a user writes it and everything it touches."""

    model: Any  # the main keras.Model
    optimizer: Any  # the main optimizer (already built)
    data: dict  # input name -> tensor, in the step's argument order
    step: Callable  # step(*inputs) -> scalar loss
    groups: list  # [(variables, role)]: every variable the step may read or write, by role
    models: list = dataclasses.field(default_factory=list)  # every keras.Model (seed generators); default [model]
    optimizers: list = dataclasses.field(default_factory=list)  # every optimizer; default [optimizer]
    autograph: bool = False


def _optimizer(kind: str):
    import keras

    return {
        "sgd": lambda: keras.optimizers.SGD(0.01),
        "momentum": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
        "adam": lambda: keras.optimizers.Adam(1e-3),
        "adamw": lambda: keras.optimizers.AdamW(1e-3, weight_decay=0.05),
        "rmsprop": lambda: keras.optimizers.RMSprop(1e-3),
    }[kind]()


def _standard(model, optimizer, data: dict, loss_fn: Callable, extra_groups=()) -> _Spec:
    """The plain step (models.standard_step): forward under a GradientTape, gradients, apply_gradients."""
    from capuchin_tf.cli import models

    step = models.standard_step(model, optimizer, tuple(data), loss_fn)
    return _Spec(model, optimizer, data, step, _model_groups(model, optimizer) + list(extra_groups))


def _model_groups(model, *optimizers) -> list:
    groups = [(model.trainable_variables, "trainable"), (model.non_trainable_variables, "non_trainable")]
    return groups + [(o.variables, "optimizer") for o in optimizers]


def _application(key: str, batch: int, seed: int) -> _Spec:
    import keras

    from capuchin_tf.cli import models

    cls, size, classes, opt, _ = _APPLICATIONS[key]
    model = getattr(keras.applications, cls)(include_top=True, weights=None, input_shape=(size, size, 3),
                                             classes=classes, classifier_activation=None)
    data = {"images": models._images(batch, size, seed), "labels": models._class_labels(batch, classes, seed)}

    def loss_fn(images, labels):
        return models._sparse_ce(labels, model(images, training=True))

    return _standard(model, _optimizer(opt), data, loss_fn)


def _small_cnn(classes: int = 10, dropout: bool = False, size: int = 32, name: str = "small_cnn"):
    """conv 32-32, pool, conv 64-64, pool, conv 128, global pool, dense; the set-ups' model."""
    import keras

    inp = keras.Input((size, size, 3), name="images")
    x = inp
    if dropout:
        x = keras.layers.GaussianNoise(0.1, name="noise")(x)
    for stage, filters in enumerate((32, 64), start=1):
        for i in (1, 2):
            x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu", name=f"conv{stage}_{i}")(x)
        x = keras.layers.MaxPooling2D(2, name=f"pool{stage}")(x)
        if dropout:
            x = keras.layers.SpatialDropout2D(0.2, name=f"spatial_dropout{stage}")(x)
    x = keras.layers.Conv2D(128, 3, padding="same", activation="relu", name="conv3")(x)
    x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    if dropout:
        x = keras.layers.Dropout(0.5, name="dropout")(x)
    out = keras.layers.Dense(classes, dtype="float32", name="logits")(x)  # float32 logits under mixed precision
    return keras.Model(inp, out, name=name)


def _image_data(batch: int, seed: int, classes: int = 10, size: int = 32) -> dict:
    from capuchin_tf.cli import models

    return {"images": models._images(batch, size, seed), "labels": models._class_labels(batch, classes, seed)}


def _ce(labels, logits):
    import tensorflow as tf

    from capuchin_tf.cli import models

    return models._sparse_ce(labels, tf.cast(logits, tf.float32))


# ---- Keras layer models ---------------------------------------------------------------------------------------------
def _sequences(batch: int, seed: int, steps: int = 64, features: int = 32) -> dict:
    import tensorflow as tf

    from capuchin_tf.cli import models

    x = tf.random.stateless_normal((batch, steps, features), models._data_seed(seed, 11))
    return {"sequences": x, "labels": models._class_labels(batch, 10, seed)}


def _rnn(layer_cls: str, batch: int, seed: int) -> _Spec:
    import keras

    inp = keras.Input((64, 32), name="sequences")
    x = getattr(keras.layers, layer_cls)(256, name=layer_cls.lower())(inp)
    out = keras.layers.Dense(10, name="logits")(x)
    model = keras.Model(inp, out, name=layer_cls.lower())

    def loss_fn(sequences, labels):
        return _ce(labels, model(sequences, training=True))

    return _standard(model, keras.optimizers.Adam(1e-3), _sequences(batch, seed), loss_fn)


def _lstm(batch: int, seed: int) -> _Spec:
    return _rnn("LSTM", batch, seed)


def _gru(batch: int, seed: int) -> _Spec:
    return _rnn("GRU", batch, seed)


def _bilstm(batch: int, seed: int) -> _Spec:
    import keras

    inp = keras.Input((64, 32), name="sequences")
    x = keras.layers.Bidirectional(keras.layers.LSTM(128, return_sequences=True), name="bilstm")(inp)
    x = keras.layers.GlobalAveragePooling1D(name="mean")(x)
    out = keras.layers.Dense(10, name="logits")(x)
    model = keras.Model(inp, out, name="bilstm")

    def loss_fn(sequences, labels):
        return _ce(labels, model(sequences, training=True))

    return _standard(model, keras.optimizers.Adam(1e-3), _sequences(batch, seed), loss_fn)


def _conv1d(batch: int, seed: int) -> _Spec:
    import keras

    inp = keras.Input((256, 8), name="signals")
    x = keras.layers.Conv1D(32, 5, padding="same", activation="relu", name="conv1")(inp)
    x = keras.layers.Conv1D(64, 5, strides=2, padding="same", activation="relu", name="conv2")(x)
    x = keras.layers.Conv1D(64, 3, padding="same", activation="relu", name="conv3")(x)
    x = keras.layers.GlobalMaxPooling1D(name="max")(x)
    out = keras.layers.Dense(10, name="logits")(x)
    model = keras.Model(inp, out, name="conv1d")
    data = _sequences(batch, seed, steps=256, features=8)
    data = {"signals": data.pop("sequences"), "labels": data["labels"]}

    def loss_fn(signals, labels):
        return _ce(labels, model(signals, training=True))

    return _standard(model, keras.optimizers.SGD(0.01), data, loss_fn)


def _conv3d(batch: int, seed: int) -> _Spec:
    import keras
    import tensorflow as tf

    from capuchin_tf.cli import models

    inp = keras.Input((24, 24, 24, 1), name="volumes")
    x = keras.layers.Conv3D(8, 3, padding="same", activation="relu", name="conv1")(inp)
    x = keras.layers.Conv3D(16, 3, strides=2, padding="same", activation="relu", name="conv2")(x)
    x = keras.layers.Conv3D(16, 3, padding="same", activation="relu", name="conv3")(x)
    x = keras.layers.GlobalAveragePooling3D(name="gap")(x)
    out = keras.layers.Dense(10, name="logits")(x)
    model = keras.Model(inp, out, name="conv3d")
    data = {"volumes": tf.random.stateless_normal((batch, 24, 24, 24, 1), models._data_seed(seed, 12)),
            "labels": models._class_labels(batch, 10, seed)}

    def loss_fn(volumes, labels):
        return _ce(labels, model(volumes, training=True))

    return _standard(model, keras.optimizers.SGD(0.01), data, loss_fn)


def _masked_transformer(batch: int, seed: int) -> _Spec:
    import keras
    import tensorflow as tf

    from capuchin_tf.cli import models

    seq, vocab, hidden, heads, ffn = 64, 1000, 64, 4, 256

    class PositionEmbedding(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.supports_masking = True

        def build(self, input_shape):
            self.embeddings = self.add_weight(name="embeddings", shape=(input_shape[1], input_shape[2]),
                                              initializer="random_normal")

        def call(self, x):
            return x + self.embeddings[None, :, :]

    tokens = keras.Input((seq,), dtype="int32", name="token_ids")
    padding = keras.ops.not_equal(tokens, 0)
    attention_mask = keras.ops.logical_and(padding[:, :, None], padding[:, None, :])
    x = keras.layers.Embedding(vocab, hidden, mask_zero=True, name="token_embedding")(tokens)
    x = PositionEmbedding(name="position_embedding")(x)
    for i in range(2):
        attn = keras.layers.MultiHeadAttention(heads, hidden // heads, dropout=0.1, name=f"attention_{i}")(
            x, x, attention_mask=attention_mask)
        x = keras.layers.LayerNormalization(name=f"attention_norm_{i}")(keras.layers.Add()([x, attn]))
        y = keras.layers.Dense(ffn, activation="gelu", name=f"ffn_in_{i}")(x)
        y = keras.layers.Dropout(0.1, name=f"ffn_dropout_{i}")(keras.layers.Dense(hidden, name=f"ffn_out_{i}")(y))
        x = keras.layers.LayerNormalization(name=f"ffn_norm_{i}")(keras.layers.Add()([x, y]))
    weights = keras.ops.cast(padding, "float32")[:, :, None]
    pooled = keras.ops.sum(x * weights, axis=1) / keras.ops.maximum(keras.ops.sum(weights, axis=1), 1.0)
    out = keras.layers.Dense(10, name="logits")(pooled)
    model = keras.Model(tokens, out, name="masked_transformer")
    # Sequences of 16..64 tokens (ids 1..vocab-1), zero-padded at the end.
    ids = tf.random.stateless_uniform((batch, seq), models._data_seed(seed, 13), minval=1, maxval=vocab,
                                      dtype=tf.int32)
    lengths = tf.random.stateless_uniform((batch, 1), models._data_seed(seed, 14), minval=16, maxval=seq + 1,
                                          dtype=tf.int32)
    ids = tf.where(tf.range(seq)[None, :] < lengths, ids, 0)
    data = {"token_ids": ids, "labels": models._class_labels(batch, 10, seed)}

    def loss_fn(token_ids, labels):
        return _ce(labels, model(token_ids, training=True))

    return _standard(model, keras.optimizers.Adam(1e-3), data, loss_fn)


# ---- training set-ups ---------------------------------------------------------------------------------------------
# Most run on an MLP: its largest op reads and writes a few MiB while a step keeps dozens, so half the transient peak
# is well above what any one op needs (a small CNN's convolution gradients need 20-30 MiB of workspace each, too close
# to half its transient peak at batches that run in seconds). cnn-dropout and cnn-mixed-float16 keep the CNN.
MLP_DEPTH, MLP_WIDTH = 8, 512


def _mlp_net(dropout: bool = False, name: str = "mlp"):
    """784 - 512 x 8 (relu) - 10 logits (float32 under mixed precision); optionally GaussianNoise and Dropout."""
    import keras

    inp = keras.Input((784,), name="features")
    x = inp
    if dropout:
        x = keras.layers.GaussianNoise(0.1, name="noise")(x)
    for i in range(MLP_DEPTH):
        x = keras.layers.Dense(MLP_WIDTH, activation="relu", name=f"dense_{i + 1}")(x)
        if dropout:
            x = keras.layers.Dropout(0.2, name=f"dropout_{i + 1}")(x)
    out = keras.layers.Dense(10, dtype="float32", name="logits")(x)
    return keras.Model(inp, out, name=name)


def _mlp_data(batch: int, seed: int) -> dict:
    import tensorflow as tf

    from capuchin_tf.cli import models

    return {"features": tf.random.stateless_normal((batch, 784), models._data_seed(seed, 1)),
            "labels": models._class_labels(batch, 10, seed)}


def _with_policy(policy: str, make: Callable):
    import keras

    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        return make()
    finally:
        keras.config.set_dtype_policy(previous)


def _loss_scaled(model, data: dict) -> _Spec:
    """mixed_float16's recipe: LossScaleOptimizer, the loss scaled in the step, the update unscaled by apply."""
    import keras
    import tensorflow as tf

    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01))
    trainable = list(model.trainable_variables)
    optimizer.build(trainable)

    def step(x, labels):
        with tf.GradientTape() as tape:
            loss = _ce(labels, model(x, training=True))
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, trainable)
        optimizer.apply_gradients(zip(grads, trainable))  # unscales; applies only when every gradient is finite
        return loss

    return _Spec(model, optimizer, data, step, _model_groups(model, optimizer))


def _mixed_float16(batch: int, seed: int) -> _Spec:
    return _loss_scaled(_with_policy("mixed_float16", _mlp_net), _mlp_data(batch, seed))


def _cnn_mixed_float16(batch: int, seed: int) -> _Spec:
    return _loss_scaled(_with_policy("mixed_float16", _small_cnn), _image_data(batch, seed))


def _mixed_bfloat16(batch: int, seed: int) -> _Spec:
    import keras

    model = _with_policy("mixed_bfloat16", _mlp_net)

    def loss_fn(features, labels):
        return _ce(labels, model(features, training=True))

    return _standard(model, keras.optimizers.Adam(1e-3), _mlp_data(batch, seed), loss_fn)


def _mlp_momentum():
    """The MLP, SGD with momentum built on its trainable variables, and its loss and gradients for a batch: the start
    of the cases whose step does something of its own with the gradients."""
    import keras
    import tensorflow as tf

    model = _mlp_net()
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    trainable = list(model.trainable_variables)
    optimizer.build(trainable)

    def gradients(x, labels):
        with tf.GradientTape() as tape:
            loss = _ce(labels, model(x, training=True))
        return loss, tape.gradient(loss, trainable)

    return model, optimizer, trainable, gradients


def _clip_global_norm(batch: int, seed: int) -> _Spec:
    import tensorflow as tf

    model, optimizer, trainable, gradients = _mlp_momentum()

    def step(x, labels):
        loss, grads = gradients(x, labels)
        grads, _ = tf.clip_by_global_norm(grads, 0.5)
        optimizer.apply_gradients(zip(grads, trainable))
        return loss

    return _Spec(model, optimizer, _mlp_data(batch, seed), step, _model_groups(model, optimizer))


ACCUMULATION_STEPS = 2


def _grad_accum(batch: int, seed: int) -> _Spec:
    import keras
    import tensorflow as tf

    model = _mlp_net()
    optimizer = keras.optimizers.SGD(0.01)
    trainable = list(model.trainable_variables)
    optimizer.build(trainable)
    accumulators = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False, name=f"accum_{i}")
                    for i, v in enumerate(trainable)]
    micro_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="micro_steps")

    def step(x, labels):
        with tf.GradientTape() as tape:
            loss = _ce(labels, model(x, training=True))
        grads = tape.gradient(loss, trainable)
        for a, g in zip(accumulators, grads):
            a.assign_add(g)
        count = micro_steps.assign_add(1)

        def apply():
            optimizer.apply_gradients(zip([a / ACCUMULATION_STEPS for a in accumulators], trainable))
            for a in accumulators:
                a.assign(tf.zeros_like(a))
            return tf.constant(True)

        tf.cond(tf.equal(count % ACCUMULATION_STEPS, 0), apply, lambda: tf.constant(False))
        return loss

    groups = _model_groups(model, optimizer) + [(accumulators + [micro_steps], "accumulator")]
    return _Spec(model, optimizer, _mlp_data(batch, seed), step, groups)


def _gan(batch: int, seed: int) -> _Spec:
    import keras
    import tensorflow as tf

    noise_dim = 64
    z = keras.Input((noise_dim,), name="noise")
    g = z
    for i, units in enumerate((256, 512), start=1):
        g = keras.layers.Dense(units, use_bias=False, name=f"g_dense{i}")(g)
        g = keras.layers.LeakyReLU(0.2)(keras.layers.BatchNormalization(name=f"g_bn{i}")(g))
    g = keras.layers.Dense(784, activation="tanh", name="g_out")(g)
    generator = keras.Model(z, g, name="generator")
    sample = keras.Input((784,), name="sample")
    d = sample
    for i, units in enumerate((512, 256), start=1):
        d = keras.layers.LeakyReLU(0.2)(keras.layers.Dense(units, name=f"d_dense{i}")(d))
    d = keras.layers.Dense(1, name="d_logit")(d)
    discriminator = keras.Model(sample, d, name="discriminator")
    g_opt = keras.optimizers.Adam(2e-4, beta_1=0.5)
    d_opt = keras.optimizers.Adam(2e-4, beta_1=0.5)
    g_vars, d_vars = list(generator.trainable_variables), list(discriminator.trainable_variables)
    g_opt.build(g_vars)
    d_opt.build(d_vars)

    def bce(target, logits):
        return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=tf.fill(tf.shape(logits), target),
                                                                      logits=logits))

    def step(real, noise):
        with tf.GradientTape() as d_tape, tf.GradientTape() as g_tape:
            fake = generator(noise, training=True)
            real_logits = discriminator(real, training=True)
            fake_logits = discriminator(fake, training=True)
            d_loss = bce(1.0, real_logits) + bce(0.0, fake_logits)
            g_loss = bce(1.0, fake_logits)
        d_grads = d_tape.gradient(d_loss, d_vars)
        g_grads = g_tape.gradient(g_loss, g_vars)
        d_opt.apply_gradients(zip(d_grads, d_vars))
        g_opt.apply_gradients(zip(g_grads, g_vars))
        return d_loss + g_loss

    from capuchin_tf.cli import models

    data = {"real": tf.random.stateless_uniform((batch, 784), models._data_seed(seed, 1), minval=-1.0, maxval=1.0),
            "noise": tf.random.stateless_normal((batch, noise_dim), models._data_seed(seed, 15))}
    groups = _model_groups(generator, g_opt) + _model_groups(discriminator, d_opt)
    return _Spec(generator, g_opt, data, step, groups, models=[generator, discriminator], optimizers=[g_opt, d_opt])


def _random_generator(batch: int, seed: int) -> _Spec:
    import keras
    import tensorflow as tf

    model = _mlp_net()
    rng = tf.random.Generator.from_seed(seed + 7)

    def loss_fn(features, labels):
        noisy = features + rng.normal(features.shape, stddev=0.1)
        return _ce(labels, model(noisy, training=True))

    return _standard(model, keras.optimizers.SGD(0.01), _mlp_data(batch, seed), loss_fn, [([rng.state], "rng")])


def _dropout(batch: int, seed: int) -> _Spec:
    import keras

    model = _mlp_net(dropout=True)

    def loss_fn(features, labels):
        return _ce(labels, model(features, training=True))

    return _standard(model, keras.optimizers.SGD(0.01), _mlp_data(batch, seed), loss_fn)


def _cnn_dropout(batch: int, seed: int) -> _Spec:
    import keras

    model = _small_cnn(dropout=True)

    def loss_fn(images, labels):
        return _ce(labels, model(images, training=True))

    return _standard(model, keras.optimizers.SGD(0.01), _image_data(batch, seed), loss_fn)


def _finite_guard(batch: int, seed: int) -> _Spec:
    import tensorflow as tf

    model, optimizer, trainable, gradients = _mlp_momentum()

    def step(x, labels):
        loss, grads = gradients(x, labels)

        def apply():
            optimizer.apply_gradients(zip(grads, trainable))
            return tf.constant(True)

        tf.cond(tf.math.is_finite(loss), apply, lambda: tf.constant(False))  # skip a step whose loss is inf/nan
        return loss

    return _Spec(model, optimizer, _mlp_data(batch, seed), step, _model_groups(model, optimizer))


_BUILDERS: dict[str, Callable[[int, int], _Spec]] = {
    "lstm": _lstm, "gru": _gru, "bilstm": _bilstm, "conv1d": _conv1d, "conv3d": _conv3d,
    "masked-transformer": _masked_transformer, "mixed-float16": _mixed_float16, "mixed-bfloat16": _mixed_bfloat16,
    "clip-global-norm": _clip_global_norm, "grad-accum": _grad_accum, "gan": _gan,
    "random-generator": _random_generator, "dropout": _dropout, "finite-guard": _finite_guard,
    "cnn-dropout": _cnn_dropout, "cnn-mixed-float16": _cnn_mixed_float16,
}
assert set(_BUILDERS) == set(_CUSTOM)


def _finish(name: str, batch: int, seed: int, spec: _Spec):
    """Traces the step once and checks that every resource it captures is one of `spec.groups`' variables (as
    `models.build` does): the variables digest then covers everything the step can change."""
    import tensorflow as tf

    from capuchin_tf.cli import models

    names = tuple(spec.data)
    inputs = tuple(tf.convert_to_tensor(spec.data[k]) for k in names)
    input_spec = tuple(tf.TensorSpec(t.shape, t.dtype, name=k) for k, t in zip(names, inputs))
    train_step = tf.function(spec.step, input_signature=input_spec, jit_compile=False, autograph=spec.autograph)

    all_models = spec.models or [spec.model]
    variables, roles, written_variables, unused = models.step_variables(name, train_step, all_models, spec.groups)

    trainable = [models._unwrap(v) for m in all_models for v in m.trainable_variables]
    input_size = tuple(int(d) for d in inputs[0].shape[1:])
    optimizers = spec.optimizers or [spec.optimizer]
    info = {
        "tier": "zoo",
        "description": CASES[name].description,
        "input_size": input_size,
        "input_names": names,
        "params": sum(int(v.shape.num_elements()) for v in trainable),
        "optimizer": ", ".join(type(o).__name__ for o in optimizers),
        "persistent_bytes": sum(models._nbytes(v) for v in variables),
        "input_bytes": sum(int(t.shape.num_elements()) * t.dtype.size for t in inputs),
        "num_variables": len(variables),
        "num_written_variables": len(written_variables),
        "roles": {r: roles.count(r) for r in dict.fromkeys(roles)},
        "unused_variables": unused,
        "seed": seed,
    }
    return models.TrainingSetup(name=name, batch=batch, model=spec.model, optimizer=spec.optimizer, inputs=inputs,
                                train_step=train_step, variables=variables, input_spec=input_spec, info=info,
                                variable_roles=roles, written_variables=written_variables)


# --------------------------------------------------------------------------------------------------------------------
# Classification and the table (pure Python).


def _is_oom(run: dict) -> bool:
    text = f"{run.get('error') or ''} {run.get('capuchin_error') or ''}"
    return "ResourceExhausted" in text or "OOM when allocating" in text or "out of memory" in text


def refusal_warnings(run: dict) -> list[str]:
    """The run's "capuchin_tf: ..." RuntimeWarnings, the ones saying it runs plain TensorFlow first."""
    warned = [w for w in run.get("capuchin_warnings") or [] if w.startswith("capuchin_tf:")]
    return sorted(warned, key=lambda w: "plain TensorFlow" not in w)


# What capuchin_tf says when the budget is below what the step can ever need (runtime.errors.BudgetError, before
# anything runs or after the measured step's two runs).
_FLOOR_MESSAGES = ("is below what this step needs at once",)
# What it says when the measured step failed with enough bytes free but not in one piece (on a device of exactly the
# budget's size), and what the worker says when the model cannot even be built on the device.
_FRAGMENTED_MESSAGES = ("free memory was split",)
_NO_BUILD_MESSAGES = ("does not build on this device",)


def classify(run: dict, plain: dict, budget_bytes: int) -> tuple[str, str]:
    """(outcome, reason) of a decorated run against the plain run, for a budget of `budget_bytes` (docs/zoo.md).

    mismatch: the losses so far or (when it completed) the variables differ from plain TensorFlow's;
    floor: capuchin_tf said the budget is below what the step can ever need (_FLOOR_MESSAGES);
    fragmented: the measured step (or a guided step, after its passive-mode reruns) failed with enough bytes free,
        not in one piece (_FRAGMENTED_MESSAGES);
    no-build: the model itself does not build on a device of that size (before capuchin_tf has any part);
    refused: a capuchin_tf warning named why the step runs as plain TensorFlow, every step after the first is
        'plain' (and then either bit for bit, or out of memory in that plain step);
    crash: any other error (including a timeout or a dead process);
    over-budget: completed, bit for bit, peak above the budget;
    guided: completed, bit for bit, peak within the budget, the first step 'measured' and every later one 'guided';
    partial: completed, bit for bit, within the budget, but some step after the first was 'passive' or 'plain'.
    """
    losses, ref = run.get("losses_hex") or [], plain.get("losses_hex") or []
    diverged = next((i for i, (a, b) in enumerate(zip(losses, ref)) if a != b), None)
    if diverged is not None:
        how = f"loss of step {diverged + 1} differs ({float.fromhex(losses[diverged]):.9g} against plain " \
              f"{float.fromhex(ref[diverged]):.9g})"
        if not run.get("ok"):
            how += f"; then the run failed: {_error_text(run)}"
        return "mismatch", how
    phases = run.get("phases") or []
    warned = refusal_warnings(run)
    plain_after_first = len(phases) >= 1 and all(p == "plain" for p in phases[1:]) and phases[0] in (
        "measured", "plain")
    if not run.get("ok"):
        text = _error_text(run)
        if any(m in text for m in _FLOOR_MESSAGES):
            return "floor", text
        if any(m in text for m in _FRAGMENTED_MESSAGES):
            return "fragmented", text
        if any(m in text for m in _NO_BUILD_MESSAGES):
            return "no-build", text
        if warned and plain_after_first and _is_oom(run):
            return "refused", f"{warned[0]}; the plain step then ran out of memory"
        return "crash", text
    if run.get("variables_sha256") != plain.get("variables_sha256") or len(losses) != len(ref):
        return "mismatch", "the losses are equal but the variables differ from plain TensorFlow's"
    if warned and plain_after_first and "plain" in phases:
        return "refused", warned[0]
    peak = run.get("peak_bytes") or 0
    if peak > budget_bytes:
        peaks = run.get("step_peak_bytes") or []
        where = f"step peaks {', '.join(_mib(p) for p in peaks)} MiB" if peaks else f"peak {_mib(peak)} MiB"
        return "over-budget", f"over the budget {budget_bytes / MiB:.1f} MiB: {where} (phases {_phases(phases)})"
    if phases and phases[0] == "measured" and all(p == "guided" for p in phases[1:]):
        return "guided", ""
    reason = f"phases {_phases(phases)}"
    if warned:
        reason += f"; {warned[0]}"
    return "partial", reason


def _phases(phases: list[str]) -> str:
    return "/".join(phases)


_DEVICE_NOISE = (" on /job:localhost/replica:0/task:0/device:CPU:0", " by allocator bfc_cpu_allocator_for_gpu")


def _error_text(run: dict) -> str:
    """The run's error in one line: capuchin_tf's own message, else the error, with the node and the function
    TensorFlow named (`... at node N in capuchin_passive_step`)."""
    text = (run.get("capuchin_error") or run.get("error") or "failed, no error recorded").strip()
    for noise in _DEVICE_NOISE:
        text = text.replace(noise, "")
    tb = run.get("error_traceback") or ""
    node = re.search(r"Detected at node (\S+)", tb) or re.search(r"\[\[\{\{node (\S+?)\}\}\]\]", tb)
    fn = re.findall(r"\[Op:__inference_(\w+?)_\d+\]", tb)
    if node and node.group(1) not in text:
        text += f" (at node {node.group(1)}" + (f" in {fn[-1]})" if fn else ")")
    elif fn:
        text += f" (in {fn[-1]})"
    return text


def steady_ratio(run: dict, plain: dict) -> float | None:
    """Median time of the guided steps after the second step over plain TensorFlow's median (steps after the
    first); None when there is no such guided step."""
    guided = [s for i, (p, s) in enumerate(zip(run.get("phases") or [], run.get("step_s") or []))
              if i >= 2 and p == "guided"]
    base = (plain.get("step_s") or [])[1:]
    if not guided or not base:
        return None
    return statistics.median(guided) / statistics.median(base)


def _mib(b) -> str:
    return "-" if b is None else f"{b / MiB:.1f}"


def _cell(text: str, limit: int = 220) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def markdown_table(data: dict) -> str:
    """The results as markdown: a stamp line, the outcome counts, the table."""
    lines = [
        f"Run: commit `{data.get('commit')}`, {data.get('date')}, {data.get('machine', {}).get('cores')} cores, "
        f"TensorFlow {data.get('tf_version')}; {data.get('steps')} steps per run, budget = persistent + "
        f"{data.get('fraction')} x transient peak, native link; "
        f"`python -m capuchin_tf bench zoo {data.get('arguments', '')}`.".replace("  ", " "),
        "",
        "Outcomes (device = budget / device = 2x budget): " + "; ".join(
            f"{k} {v[0]}/{v[1]}" for k, v in summary(data).items() if v != [0, 0]) + ".",
        "",
        "| case | batch | plain peak MiB | persistent MiB | budget MiB | device=budget | capuchin peak MiB "
        "| device=2x budget | its peak MiB | step time vs plain | reason (anything not guided) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in data.get("cases", []):
        b, d = c.get("budget_run") or {}, c.get("double_run") or {}
        ratio, double_ratio = c.get("steady_ratio"), c.get("steady_ratio_double")
        time_cell = ("-" if double_ratio is None else f"{double_ratio:.2f}x (2x)") if ratio is None else f"{ratio:.2f}x"
        reasons = []
        if c.get("outcome_budget") not in (None, "guided") and c.get("reason_budget"):
            reasons.append(f"budget: {c['reason_budget']}")
        if c.get("outcome_double") not in (None, "guided") and c.get("reason_double"):
            reasons.append(f"2x: {c['reason_double']}")
        if c.get("skipped"):
            reasons.append(c["skipped"])
        lines.append("| " + " | ".join([
            c["case"], str(c.get("batch", "")), _mib(c.get("plain_peak_bytes")), _mib(c.get("persistent_bytes")),
            str(c.get("budget_mb") or "-"), c.get("outcome_budget") or "-", _mib(b.get("peak_bytes")),
            c.get("outcome_double") or "-", _mib(d.get("peak_bytes")),
            time_cell, _cell("; ".join(reasons), 400),
        ]) + " |")
    return "\n".join(lines) + "\n"


def reclassify(data: dict) -> dict:
    """`data` (a zoo JSON) with every case's outcomes, reasons and time ratios computed again from its stored runs,
    by this version's `classify`."""
    for c in data.get("cases", []):
        plain = c.get("plain") or {}
        if not plain.get("ok") or not c.get("budget_mb"):
            continue
        for key in ("budget", "double"):
            run = c.get(f"{key}_run")
            if run is None:
                continue
            outcome, reason = classify(run, plain, c["budget_mb"] * MiB)
            c.update({f"outcome_{key}": outcome, f"reason_{key}": reason,
                      "steady_ratio" if key == "budget" else "steady_ratio_double": steady_ratio(run, plain)})
    data["summary"] = summary(data)
    return data


def summary(data: dict) -> dict[str, list[int]]:
    """Outcome -> [count at device=budget, count at device=2x budget]."""
    out = {k: [0, 0] for k in OUTCOMES}
    for c in data.get("cases", []):
        for i, key in enumerate(("outcome_budget", "outcome_double")):
            if c.get(key) in out:
                out[c[key]][i] += 1
    return out


def write_markdown(path: str | pathlib.Path, data: dict) -> None:
    """Replaces the table between the zoo-table markers of `path` (a file without them gets a short header)."""
    path = pathlib.Path(path)
    section = f"{MARK_BEGIN}\n{markdown_table(data)}{MARK_END}\n"
    text = path.read_text() if path.exists() else ""
    if MARK_BEGIN in text and MARK_END in text:
        head, rest = text.split(MARK_BEGIN, 1)
        tail = rest.split(MARK_END, 1)[1].lstrip("\n")
        text = head + section + tail
    else:
        text = (text.rstrip("\n") + "\n\n" if text else "# capuchin_tf conformance zoo\n\n"
                "See `python -m capuchin_tf bench zoo --help` and capuchin_tf/zoo.py.\n\n") + section
    path.write_text(text)


# --------------------------------------------------------------------------------------------------------------------
# The harness: each run a `bench-worker` in a fresh process.

RUN_KEYS = ("ok", "error", "error_type", "capuchin_error", "capuchin_warnings", "phases", "peak_bytes",
            "guided_peak_bytes", "persistent_bytes", "step_peak_bytes", "losses_hex", "variables_sha256", "step_s",
            "median_step_s", "late_prefetches", "retries", "lowered_budget_bytes", "budget_mb", "device_mb",
            "device_limit_bytes", "swapped_tensors", "swapped_bytes", "recomputed_tensors", "recomputed_bytes",
            "replans", "fallback_reason", "kept_failure", "wall_s", "error_traceback")


def _worker(case: Case, policy: str, budget_mb: int, device_mb: int, steps: int, timeout: float | None,
            link: str = "native", extra: Sequence[str] = (), keep_failures: str | None = None) -> dict:
    """One `bench-worker` run in a fresh process; never raises for a failed run (the error is in the result).
    `keep_failures`: where a planning failure's trace and error are kept (Options.keep_failures)."""
    import time

    from capuchin_tf.cli.common import CliError, run_worker

    args = ["--model", case.name, "--batch", str(case.batch), "--budget-mb", str(budget_mb), "--device-mb",
            str(device_mb), "--policy", policy, "--link", link, "--steps", str(steps), "--record-errors", *extra]
    t0 = time.perf_counter()
    try:
        r = run_worker("bench-worker", args, device_mb, timeout=timeout,
                       env={"CAPUCHIN_TF_KEEP_FAILURES": keep_failures} if keep_failures else None)
    except CliError as e:  # the process died or timed out: no result file
        text = str(e)
        lines = [ln for ln in text.splitlines() if ln.strip()]
        r = {"ok": False, "error": lines[-1] if lines else text, "error_type": "process", "error_traceback": text,
             "phases": [], "losses_hex": [], "step_s": [], "peak_bytes": None, "budget_mb": budget_mb,
             "device_mb": device_mb}
    r["wall_s"] = time.perf_counter() - t0
    later = (r.get("step_peak_bytes") or [])[1:]
    r["guided_peak_bytes"] = max(later) if later else None  # the steps after the measured one
    report = r.get("report") or {}
    r["fallback_reason"] = report.get("fallback_reason")
    r["kept_failure"] = report.get("kept_failure")
    return {k: r.get(k) for k in RUN_KEYS}


def run_case(case: Case, steps: int = 5, fraction: float = 0.5, timeout: float | None = 900.0,
             echo: Callable[[str], None] = print, keep_failures: str | None = None) -> dict:
    """The three runs of one case (plain; decorated at the budget on a device of the budget and of twice it),
    classified. `keep_failures`: a directory; a decorated run's planning failure is kept in CASE-budget or
    CASE-double under it."""
    entry: dict = {"case": case.name, "batch": case.batch, "group": case.group, "description": case.description,
                   "plain_peak_bytes": None, "persistent_bytes": None, "budget_mb": None, "outcome_budget": None,
                   "reason_budget": None, "outcome_double": None, "reason_double": None, "steady_ratio": None,
                   "steady_ratio_double": None, "plain_median_step_s": None, "plain": None, "budget_run": None,
                   "double_run": None, "skipped": None}
    if case.needs and importlib.util.find_spec(case.needs) is None:
        entry["skipped"] = f"skipped: {case.needs} is not importable"
        echo(f"  {entry['skipped']}")
        return entry
    with tempfile.TemporaryDirectory(prefix="capuchin_zoo_") as tmp:
        # The decorated runs build the model from the plain run's initial values (models.initial_values): on a
        # device of the budget's size the initializers' own temporaries could decide whether it builds.
        initial = os.path.join(tmp, "initial_values.pkl")
        return _run_case(case, steps, fraction, timeout, echo, entry, initial, keep_failures)


def _run_case(case: Case, steps: int, fraction: float, timeout: float | None, echo: Callable[[str], None],
              entry: dict, initial: str, keep_failures: str | None = None) -> dict:
    from capuchin_tf.core.budget import fraction_budget_mb

    echo(f"  plain TensorFlow, {PLAIN_DEVICE_MB} MiB device ...")
    plain = _worker(case, "tf", PLAIN_DEVICE_MB, PLAIN_DEVICE_MB, steps, timeout,
                    extra=("--save-initial-values", initial))
    entry["plain"] = plain
    if not plain["ok"] or plain["peak_bytes"] is None:
        reason = f"plain TensorFlow failed: {_error_text(plain)}"
        entry.update(outcome_budget="crash", reason_budget=reason, outcome_double="crash", reason_double=reason)
        echo(f"  {reason}")
        return entry
    base = plain["step_s"][1:]
    entry.update(plain_peak_bytes=plain["peak_bytes"], persistent_bytes=plain["persistent_bytes"],
                 plain_median_step_s=statistics.median(base) if base else None)
    budget_mb = fraction_budget_mb(plain["persistent_bytes"], plain["peak_bytes"], fraction)
    entry["budget_mb"] = budget_mb
    echo(f"  plain: peak {_mib(plain['peak_bytes'])} MiB, persistent {_mib(plain['persistent_bytes'])} MiB, "
         f"median step {entry['plain_median_step_s'] or float('nan'):.3f} s -> budget {budget_mb} MiB")
    for key, device_mb, label in (("budget", budget_mb, "device=budget"), ("double", 2 * budget_mb, "device=2x")):
        echo(f"  capuchin, budget {budget_mb} MiB, {label} ({device_mb} MiB) ...")
        run = _worker(case, "capuchin", budget_mb, device_mb, steps, timeout,
                      extra=("--load-initial-values", initial) if os.path.exists(initial) else (),
                      keep_failures=os.path.join(keep_failures, f"{case.name}-{key}") if keep_failures else None)
        outcome, reason = classify(run, plain, budget_mb * MiB)
        ratio = steady_ratio(run, plain)
        entry.update({f"{key}_run": run, f"outcome_{key}": outcome, f"reason_{key}": reason,
                      "steady_ratio" if key == "budget" else "steady_ratio_double": ratio})
        echo(f"  {label}: {outcome}, peak {_mib(run['peak_bytes'])} MiB, phases {_phases(run['phases'] or [])}"
             + (f", step time {ratio:.2f}x plain" if ratio else "") + (f" ({_cell(reason, 300)})" if reason else ""))
    return entry


def run_zoo(cases: list[Case], steps: int, fraction: float, json_path: str | None, markdown_path: str | None,
            timeout: float | None, arguments: str = "", echo: Callable[[str], None] = print,
            keep_failures: str | None = None) -> int:
    """Runs `cases` one after the other; writes the JSON after each case and the markdown at the end. Exit code 0
    when no run is a mismatch or a crash. `keep_failures`: run_case's."""
    import platform
    import time


    data = {"kind": "capuchin_tf zoo", "schema_version": 1, "commit": git_commit(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
            "tf_version": _tf_version(), "python": platform.python_version(), "steps": steps, "fraction": fraction,
            "timeout_s": timeout, "link": "native", "plain_device_mb": PLAIN_DEVICE_MB, "arguments": arguments,
            "cases": []}
    for i, case in enumerate(cases, start=1):
        echo(f"[{i}/{len(cases)}] {case.name}, batch {case.batch}: {case.description}")
        t0 = time.perf_counter()
        entry = run_case(case, steps, fraction, timeout, echo, keep_failures)
        entry["wall_s"] = time.perf_counter() - t0
        data["cases"].append(entry)
        data["summary"] = summary(data)
        if json_path:
            pathlib.Path(json_path).write_text(json.dumps(data, indent=1))
        echo(f"[{i}/{len(cases)}] {case.name}: {entry['outcome_budget']} at device=budget, "
             f"{entry['outcome_double']} at device=2x ({entry['wall_s']:.0f} s)")
    if markdown_path:
        write_markdown(markdown_path, data)
    counts = summary(data)
    echo("zoo: " + "; ".join(f"{k} {v[0]}/{v[1]}" for k, v in counts.items() if v != [0, 0])
         + " (device = budget / device = 2x budget)")
    if json_path:
        echo(f"  results written to {json_path}" + (f" and {markdown_path}" if markdown_path else ""))
    return 1 if any(sum(counts[k]) for k in FAILING_OUTCOMES) else 0


def _tf_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("tensorflow-cpu")
    except Exception:  # noqa: BLE001 - only a stamp
        return None

