"""The benchmark model zoo: each model of docs/benchmarks.md as one ready-to-run training step.

`build(name, batch, seed=0)` returns a `TrainingSetup`: the model, its optimizer (already built), one deterministic
synthetic batch, and `train_step`, a `tf.function` with a fixed input signature that runs the forward pass under a
`tf.GradientTape`, takes the gradients, applies them and returns the scalar loss. `setup.variables` lists every
variable the step reads or writes (weights, BatchNormalization moving statistics, Dropout seed-generator states,
optimizer slots, iteration counter and learning rate), checked against the traced step's captures.

Determinism (design.md, promise 1): `build` seeds Keras (`keras.utils.set_random_seed(seed)`) and turns on TensorFlow's
op determinism, so the same `build` in two fresh processes gives bit-for-bit the same losses step after step.

This module uses only TensorFlow and Keras, never capuchin_tf's op library, so it can be imported on its own
(`CAPUCHIN_TF_PURE=1`). keras-hub is needed for the BERT models only and is imported when one of them is built;
see tools/requirements-bert.txt for how to install it without pulling the CUDA TensorFlow wheel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

__all__ = ["MODELS", "TIERS", "TrainingSetup", "build", "describe", "initial_values"]

# --------------------------------------------------------------------------------------------------------------------
# Registry.

TIERS: dict[str, tuple[str, ...]] = {
    "quick": ("mlp", "cnn", "transformer", "dropout-bn"),
    "standard": ("resnet50", "vgg16", "inceptionv3", "densenet121", "bert-4l"),
    "paper": ("resnet152", "inceptionresnetv2", "bert-base"),
}

#: Every model name the CLI takes, mapped to its tier ("quick", "standard", "paper"), in tier order.
MODELS: dict[str, str] = {name: tier for tier, names in TIERS.items() for name in names}

_DESCRIPTIONS: dict[str, str] = {
    "mlp": "MLP 784-512x12-10, SGD 0.01",
    "cnn": "small ResNet-style CNN (3 stages x 2 residual blocks, 32/64/128 ch) @32x32, 100 classes, SGD 0.01",
    "transformer": "2-layer post-LN encoder (hidden 128, 2 heads, FFN 512, seq 64, vocab 8192) with MLM (20 masked "
    "positions, tied embedding) + 2-class heads, Adam 1e-4",
    "dropout-bn": "VGG-style CNN (3 stages of 3 conv-BN-ReLU) with Dropout @32x32, 100 classes, SGD 0.01",
    "resnet50": "keras.applications.ResNet50 @64x64, 100 classes, SGD 0.01",
    "vgg16": "keras.applications.VGG16 @64x64, 100 classes, SGD 0.01",
    "inceptionv3": "keras.applications.InceptionV3 @96x96, 100 classes, SGD 0.01",
    "densenet121": "keras.applications.DenseNet121 @64x64, 100 classes, SGD 0.01",
    "bert-4l": "keras-hub BertBackbone (4 layers, hidden 256, 4 heads, FFN 1024, seq 128, vocab 8192) with MLM "
    "(20 masked positions) + 2-class heads, Adam 1e-4",
    "resnet152": "keras.applications.ResNet152 @64x64, 100 classes, SGD 0.01",
    "inceptionresnetv2": "keras.applications.InceptionResNetV2 @96x96 (stand-in for InceptionV4), 100 classes, "
    "SGD 0.01",
    "bert-base": "keras-hub BertBackbone (12 layers, hidden 768, 12 heads, FFN 3072, seq 128, vocab 30522) with MLM "
    "(20 masked positions) + 2-class heads, Adam 1e-4",
}

NUM_CLASSES = 100  # CNNs (benchmarks.md, "Training set-up")
MLP_CLASSES = 10
# The mlp is deep and narrow (12 x 512) rather than shallow and wide: a step's transient peak is then many layers'
# activations against one layer's working set, as in real networks. In a shallow, wide MLP one layer's backward pass
# alone needs about half the transient peak, so no policy can train it at half.
MLP_LAYERS = 12
MLP_WIDTH = 512
MASKED_POSITIONS = 20  # masked-LM predictions per sequence
SGD_LR = 0.01
ADAM_LR = 1e-4

BERT_INSTALL_HINT = (
    "The BERT models need keras-hub, an optional extra of capuchin_tf. Install it without its dependencies (a plain "
    "`pip install keras-hub` pulls tensorflow-text, which replaces tensorflow-cpu with the CUDA `tensorflow` wheel): "
    "`pip install --no-deps -r tools/requirements-bert.txt` (keras-hub plus its pure-Python needs: regex rich "
    "packaging tokenizers sentencepiece kagglehub kagglesdk pyyaml tqdm). Do not install tensorflow-text."
)


@dataclasses.dataclass
class TrainingSetup:
    """One model's training step, ready to run: `setup.train_step(*setup.inputs)` returns the scalar loss."""

    name: str
    batch: int
    model: keras.Model | None  # None for a hand-written step (none of the current models)
    optimizer: keras.optimizers.Optimizer
    inputs: tuple[tf.Tensor, ...]  # one deterministic synthetic batch, matching input_spec
    train_step: Any  # tf.function(input_signature=input_spec, jit_compile=False); returns the scalar loss
    variables: tuple[tf.Variable, ...]  # every variable the step reads or writes (the underlying tf.Variables)
    input_spec: tuple[tf.TensorSpec, ...]
    info: dict[str, Any]
    # Aligned with `variables`: "trainable", "non_trainable" (e.g. BN moving stats), "seed_generator" (Dropout's RNG
    # state, advanced by every step), "optimizer" (slots, iteration counter, learning rate).
    variable_roles: tuple[str, ...] = ()
    # The subset of `variables` the step writes (assigns, assign-adds, resource applies), found in the traced graph.
    written_variables: tuple[tf.Variable, ...] = ()

    def variables_sha256(self) -> str:
        """sha256 of every variable's bytes, in `variables` order: equal digests mean bit-for-bit equal state."""
        digest = hashlib.sha256()
        for v in self.variables:
            digest.update(np.asarray(v.numpy()).tobytes())
        return digest.hexdigest()

    def variables_by_role(self, role: str) -> tuple[tf.Variable, ...]:
        return tuple(v for v, r in zip(self.variables, self.variable_roles) if r == role)

    def concrete_function(self):
        """The traced step (tracing happened in `build`, so this does not retrace)."""
        return self.train_step.get_concrete_function()


def describe() -> str:
    """A table of the model names, their tiers and what they are."""
    width = max(len(n) for n in MODELS)
    lines = [f"{'model':<{width}}  {'tier':<8}  description"]
    for name, tier in MODELS.items():
        lines.append(f"{name:<{width}}  {tier:<8}  {_DESCRIPTIONS[name]}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------------
# Synthetic data: stateless random ops from a fixed seed, so the batch is the same in every process.

_DATA_SEED = 20200316  # Capuchin's ASPLOS 2020 date; any fixed value works


def _data_seed(seed: int, stream: int) -> tf.Tensor:
    return tf.constant([_DATA_SEED + seed, stream], dtype=tf.int64)


def _images(batch: int, size: int, seed: int) -> tf.Tensor:
    return tf.random.stateless_uniform((batch, size, size, 3), _data_seed(seed, 1), minval=-1.0, maxval=1.0)


def _class_labels(batch: int, classes: int, seed: int) -> tf.Tensor:
    return tf.random.stateless_uniform((batch,), _data_seed(seed, 2), minval=0, maxval=classes, dtype=tf.int32)


def _bert_batch(batch: int, seq: int, vocab: int, seed: int) -> dict[str, tf.Tensor]:
    token_ids = tf.random.stateless_uniform((batch, seq), _data_seed(seed, 3), minval=0, maxval=vocab, dtype=tf.int32)
    # Distinct positions per sequence (top-k of random keys), sorted, never the [CLS] position 0.
    keys = tf.random.stateless_uniform((batch, seq - 1), _data_seed(seed, 4))
    positions = tf.sort(tf.math.top_k(keys, k=MASKED_POSITIONS).indices + 1, axis=-1)
    mlm_labels = tf.random.stateless_uniform(
        (batch, MASKED_POSITIONS), _data_seed(seed, 5), minval=0, maxval=vocab, dtype=tf.int32
    )
    nsp_labels = tf.random.stateless_uniform((batch,), _data_seed(seed, 6), minval=0, maxval=2, dtype=tf.int32)
    segment_ids = tf.tile(tf.cast(tf.range(seq) >= seq // 2, tf.int32)[None, :], [batch, 1])
    padding_mask = tf.ones((batch, seq), tf.int32)
    return {
        "token_ids": token_ids,
        "segment_ids": segment_ids,
        "padding_mask": padding_mask,
        "mask_positions": tf.cast(positions, tf.int32),
        "mlm_labels": mlm_labels,
        "nsp_labels": nsp_labels,
    }


def _sparse_ce(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """Mean sparse categorical cross-entropy on logits (what Keras' loss computes with from_logits=True)."""
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


# --------------------------------------------------------------------------------------------------------------------
# Model definitions. Each returns (model, optimizer, inputs dict in signature order, loss_fn(model, **inputs)).

_Built = tuple[keras.Model, keras.optimizers.Optimizer, dict[str, tf.Tensor], Callable[..., tf.Tensor]]


def _classifier_loss(model: keras.Model):
    def loss_fn(labels, **features):
        (x,) = features.values()
        return _sparse_ce(labels, model(x, training=True))

    return loss_fn


def _mlp(batch: int, seed: int) -> _Built:
    inp = keras.Input((784,), batch_size=batch, name="features")
    x = inp
    for i in range(MLP_LAYERS):
        x = keras.layers.Dense(MLP_WIDTH, activation="relu", name=f"dense_{i + 1}")(x)
    out = keras.layers.Dense(MLP_CLASSES, name="logits")(x)
    model = keras.Model(inp, out, name="mlp")
    features = tf.random.stateless_normal((batch, 784), _data_seed(seed, 1))
    labels = _class_labels(batch, MLP_CLASSES, seed)
    return model, keras.optimizers.SGD(SGD_LR), {"features": features, "labels": labels}, _classifier_loss(model)


def _cnn(batch: int, seed: int) -> _Built:
    def conv(x, filters, strides, name, activation="relu", kernel=3):
        layer = keras.layers.Conv2D(filters, kernel, strides=strides, padding="same", activation=activation, name=name)
        return layer(x)

    inp = keras.Input((32, 32, 3), batch_size=batch, name="images")
    x = conv(inp, 32, 1, "stem_conv")
    for stage, filters in enumerate((32, 64, 128), start=1):
        for block in (1, 2):
            prefix = f"stage{stage}_block{block}"
            strides = 2 if stage > 1 and block == 1 else 1
            shortcut = x
            if strides != 1 or x.shape[-1] != filters:
                shortcut = conv(x, filters, strides, f"{prefix}_proj", activation=None, kernel=1)
            y = conv(x, filters, strides, f"{prefix}_conv1")
            y = conv(y, filters, 1, f"{prefix}_conv2", activation=None)
            x = keras.layers.Add(name=f"{prefix}_add")([shortcut, y])
            x = keras.layers.ReLU(name=f"{prefix}_relu")(x)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    out = keras.layers.Dense(NUM_CLASSES, name="logits")(x)
    model = keras.Model(inp, out, name="cnn")
    data = {"images": _images(batch, 32, seed), "labels": _class_labels(batch, NUM_CLASSES, seed)}
    return model, keras.optimizers.SGD(SGD_LR), data, _classifier_loss(model)


def _dropout_bn(batch: int, seed: int) -> _Built:
    def conv_bn(x, filters, name):
        x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"{name}_conv")(x)
        x = keras.layers.BatchNormalization(name=f"{name}_bn")(x)
        return keras.layers.ReLU(name=f"{name}_relu")(x)

    inp = keras.Input((32, 32, 3), batch_size=batch, name="images")
    x = inp
    for stage, filters in enumerate((32, 64, 128), start=1):
        for layer in "abc":
            x = conv_bn(x, filters, f"block{stage}{layer}")
        x = keras.layers.MaxPooling2D(2, name=f"block{stage}_pool")(x)
        x = keras.layers.Dropout(0.25, name=f"block{stage}_dropout")(x)
    x = keras.layers.Flatten(name="flatten")(x)
    x = keras.layers.Dense(256, use_bias=False, name="fc")(x)
    x = keras.layers.BatchNormalization(name="fc_bn")(x)
    x = keras.layers.ReLU(name="fc_relu")(x)
    x = keras.layers.Dropout(0.5, name="fc_dropout")(x)
    out = keras.layers.Dense(NUM_CLASSES, name="logits")(x)
    model = keras.Model(inp, out, name="dropout_bn")
    data = {"images": _images(batch, 32, seed), "labels": _class_labels(batch, NUM_CLASSES, seed)}
    return model, keras.optimizers.SGD(SGD_LR), data, _classifier_loss(model)


_APPLICATIONS: dict[str, tuple[str, int]] = {
    "resnet50": ("ResNet50", 64),
    "vgg16": ("VGG16", 64),
    "inceptionv3": ("InceptionV3", 96),
    "densenet121": ("DenseNet121", 64),
    "resnet152": ("ResNet152", 64),
    "inceptionresnetv2": ("InceptionResNetV2", 96),
}


def _application(name: str, batch: int, seed: int) -> _Built:
    cls_name, size = _APPLICATIONS[name]
    model = getattr(keras.applications, cls_name)(
        include_top=True,
        weights=None,  # never download
        input_shape=(size, size, 3),
        classes=NUM_CLASSES,
        classifier_activation=None,  # logits; the loss applies the softmax
    )
    data = {"images": _images(batch, size, seed), "labels": _class_labels(batch, NUM_CLASSES, seed)}
    return model, keras.optimizers.SGD(SGD_LR), data, _classifier_loss(model)


# -- BERT-style models ----------------------------------------------------------------------------------------------


@keras.saving.register_keras_serializable(package="capuchin_tf")
class _PositionEmbedding(keras.layers.Layer):
    """Adds a learned position embedding to (batch, seq, hidden) inputs."""

    def build(self, input_shape):
        self.embeddings = self.add_weight(
            name="embeddings",
            shape=(input_shape[1], input_shape[2]),
            initializer=keras.initializers.TruncatedNormal(stddev=0.02),
        )

    def call(self, x):
        return x + self.embeddings[None, :, :]


@keras.saving.register_keras_serializable(package="capuchin_tf")
class _GatherPositions(keras.layers.Layer):
    """(batch, seq, hidden), (batch, k) int positions -> (batch, k, hidden)."""

    def call(self, x, positions):
        return tf.gather(x, positions, batch_dims=1)


def _bert_loss(model: keras.Model, feature_names: tuple[str, ...]):
    def loss_fn(**batch):
        mlm_logits, nsp_logits = model({k: batch[k] for k in feature_names}, training=True)
        return _sparse_ce(batch["mlm_labels"], mlm_logits) + _sparse_ce(batch["nsp_labels"], nsp_logits)

    return loss_fn


def _transformer(batch: int, seed: int) -> _Built:
    seq, hidden, heads, ffn, vocab, layers, dropout = 64, 128, 2, 512, 8192, 2, 0.1
    init = keras.initializers.TruncatedNormal(stddev=0.02)
    token_ids = keras.Input((seq,), batch_size=batch, dtype="int32", name="token_ids")
    mask_positions = keras.Input((MASKED_POSITIONS,), batch_size=batch, dtype="int32", name="mask_positions")
    embedding = keras.layers.ReversibleEmbedding(vocab, hidden, embeddings_initializer=init, name="token_embedding")
    x = embedding(token_ids)
    x = _PositionEmbedding(name="position_embedding")(x)
    x = keras.layers.LayerNormalization(epsilon=1e-12, name="embeddings_layer_norm")(x)
    x = keras.layers.Dropout(dropout, name="embeddings_dropout")(x)
    for i in range(layers):
        p = f"encoder_{i}"
        attn = keras.layers.MultiHeadAttention(
            heads, hidden // heads, dropout=dropout, kernel_initializer=init, name=f"{p}_attention"
        )(x, x)
        attn = keras.layers.Dropout(dropout, name=f"{p}_attention_dropout")(attn)
        x = keras.layers.LayerNormalization(epsilon=1e-12, name=f"{p}_attention_norm")(
            keras.layers.Add(name=f"{p}_attention_add")([x, attn])
        )
        y = keras.layers.Dense(ffn, activation="gelu", kernel_initializer=init, name=f"{p}_ffn_in")(x)
        y = keras.layers.Dense(hidden, kernel_initializer=init, name=f"{p}_ffn_out")(y)
        y = keras.layers.Dropout(dropout, name=f"{p}_ffn_dropout")(y)
        x = keras.layers.LayerNormalization(epsilon=1e-12, name=f"{p}_ffn_norm")(
            keras.layers.Add(name=f"{p}_ffn_add")([x, y])
        )
    # Masked-LM head: gather the masked positions, transform, project with the tied token embedding.
    m = _GatherPositions(name="mlm_gather")(x, mask_positions)
    m = keras.layers.Dense(hidden, activation="gelu", kernel_initializer=init, name="mlm_dense")(m)
    m = keras.layers.LayerNormalization(epsilon=1e-12, name="mlm_norm")(m)
    mlm_logits = embedding(m, reverse=True)
    # Sequence head on the first token, through a tanh pooler as in BERT.
    cls = keras.layers.Lambda(lambda t: t[:, 0, :], name="cls_token")(x)
    pooled = keras.layers.Dense(hidden, activation="tanh", kernel_initializer=init, name="pooler")(cls)
    nsp_logits = keras.layers.Dense(2, kernel_initializer=init, name="nsp_logits")(pooled)
    model = keras.Model(
        {"token_ids": token_ids, "mask_positions": mask_positions}, [mlm_logits, nsp_logits], name="transformer"
    )
    data = _bert_batch(batch, seq, vocab, seed)
    data = {k: data[k] for k in ("token_ids", "mask_positions", "mlm_labels", "nsp_labels")}
    return model, keras.optimizers.Adam(ADAM_LR), data, _bert_loss(model, ("token_ids", "mask_positions"))


_BERTS: dict[str, dict[str, int]] = {
    "bert-4l": dict(num_layers=4, hidden_dim=256, num_heads=4, intermediate_dim=1024, vocabulary_size=8192),
    "bert-base": dict(num_layers=12, hidden_dim=768, num_heads=12, intermediate_dim=3072, vocabulary_size=30522),
}
BERT_SEQ = 128


def _import_keras_hub():
    try:
        import keras_hub
    except ImportError as err:  # missing, or installed with a dependency missing
        raise ImportError(f"{BERT_INSTALL_HINT} (import keras_hub failed: {err})") from err
    return keras_hub


def _bert(name: str, batch: int, seed: int) -> _Built:
    keras_hub = _import_keras_hub()
    cfg = _BERTS[name]
    init = keras.initializers.TruncatedNormal(stddev=0.02)  # BERT's initializer, as keras-hub's BertMaskedLM
    backbone = keras_hub.models.BertBackbone(
        **cfg, dropout=0.1, max_sequence_length=512, num_segments=2, name="bert_backbone"
    )
    inputs = {
        "token_ids": keras.Input((BERT_SEQ,), batch_size=batch, dtype="int32", name="token_ids"),
        "segment_ids": keras.Input((BERT_SEQ,), batch_size=batch, dtype="int32", name="segment_ids"),
        "padding_mask": keras.Input((BERT_SEQ,), batch_size=batch, dtype="int32", name="padding_mask"),
        "mask_positions": keras.Input((MASKED_POSITIONS,), batch_size=batch, dtype="int32", name="mask_positions"),
    }
    outputs = backbone({k: inputs[k] for k in ("token_ids", "segment_ids", "padding_mask")})
    mlm_head = keras_hub.layers.MaskedLMHead(
        token_embedding=backbone.token_embedding,
        intermediate_activation="gelu",
        kernel_initializer=init,
        name="mlm_head",
    )
    mlm_logits = mlm_head(outputs["sequence_output"], mask_positions=inputs["mask_positions"])
    nsp_logits = keras.layers.Dense(2, kernel_initializer=init, name="nsp_head")(outputs["pooled_output"])
    model = keras.Model(inputs, [mlm_logits, nsp_logits], name=name.replace("-", "_"))
    data = _bert_batch(batch, BERT_SEQ, cfg["vocabulary_size"], seed)
    loss = _bert_loss(model, ("token_ids", "segment_ids", "padding_mask", "mask_positions"))
    return model, keras.optimizers.Adam(ADAM_LR), data, loss


def _define(name: str, batch: int, seed: int) -> _Built:
    if name == "mlp":
        return _mlp(batch, seed)
    if name == "cnn":
        return _cnn(batch, seed)
    if name == "dropout-bn":
        return _dropout_bn(batch, seed)
    if name == "transformer":
        return _transformer(batch, seed)
    if name in _APPLICATIONS:
        return _application(name, batch, seed)
    if name in _BERTS:
        return _bert(name, batch, seed)
    raise AssertionError(name)  # pragma: no cover - MODELS and _define out of sync


# --------------------------------------------------------------------------------------------------------------------
# The step.

# Ops that only read a resource variable; any other op consuming a captured variable handle counts as a write.
_READ_ONLY_OPS = frozenset(
    {"ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape", "VarIsInitializedOp"}
)


def _nbytes(v) -> int:
    return int(v.shape.num_elements()) * v.dtype.size


def _unwrap(v) -> tf.Variable:
    """The tf.Variable behind a Keras 3 variable (Keras' TF backend wraps one in `.value`)."""
    return v if isinstance(v, tf.Variable) else v.value


def _check_name_and_batch(name: str, batch: int) -> None:
    if name not in MODELS:
        valid = ", ".join(f"{n} ({t})" for n, t in MODELS.items())
        raise ValueError(f"unknown model {name!r}; valid names: {valid}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive integer, got {batch!r}")


def standard_step(model, optimizer, names: tuple[str, ...], loss_fn: Callable):
    """The plain training step over positional inputs named `names`: the loss under a GradientTape, its gradients,
    apply_gradients, the loss returned. Builds `optimizer` on the model's trainable variables first."""
    trainable = list(model.trainable_variables)
    optimizer.build(trainable)

    def step(*args):
        with tf.GradientTape() as tape:
            loss = loss_fn(**dict(zip(names, args)))
        grads = tape.gradient(loss, trainable)
        optimizer.apply_gradients(zip(grads, trainable))
        return loss

    return step


def step_variables(name: str, train_step, layer_models, groups) -> tuple[tuple, tuple, tuple, list[str]]:
    """The variables a traced step captures, each once with its role, checked: (variables, roles, written variables,
    names of listed variables the step does not use). `groups`: (variables, role) pairs in order ("trainable",
    "non_trainable", "optimizer", ...); a non-trainable variable of a Keras seed generator of `layer_models` gets the
    role "seed_generator". Raises RuntimeError if the step captures a resource that is not listed: everything the
    step reads or writes must be in the digest. A variable counts as written when an op other than a plain read takes
    its handle (a cond or loop that takes a handle counts as writing it)."""
    from capuchin_tf.tf import keras_private

    seed_states = {id(_unwrap(g.state)) for m in layer_models for layer in keras_private.flatten_layers(m)
                   for g in keras_private.seed_generators(layer)}
    candidates: list[tuple[tf.Variable, str]] = []
    seen: set[int] = set()
    for group, role in groups:
        for kv in group:
            v = _unwrap(kv)
            if id(v) in seen:
                continue
            seen.add(id(v))
            is_seed = id(v) in seed_states or v.name.rsplit("/", 1)[-1].startswith("seed_generator_state")
            candidates.append((v, "seed_generator" if role == "non_trainable" and is_seed else role))
    graph = train_step.get_concrete_function().graph
    by_handle = {id(v.handle): v for v, _ in candidates}
    captured: dict[int, tf.Variable] = {}
    placeholder_to_var: dict[str, tf.Variable] = {}
    unknown = []
    for external, internal in graph.captures:
        if external.dtype != tf.resource:
            continue
        v = by_handle.get(id(external))
        if v is None:
            unknown.append(internal.name)
            continue
        captured[id(v)] = v
        placeholder_to_var[internal.name] = v
    if unknown:
        raise RuntimeError(f"{name}: the traced step captures resources that are not known variables: {unknown}")
    written: dict[int, tf.Variable] = {}
    for op in graph.get_operations():
        if op.type in _READ_ONLY_OPS:
            continue
        for t in op.inputs:
            v = placeholder_to_var.get(t.name)
            if v is not None:
                written[id(v)] = v
    variables = tuple(v for v, _ in candidates if id(v) in captured)
    roles = tuple(r for v, r in candidates if id(v) in captured)
    return (variables, roles, tuple(v for v in variables if id(v) in written),
            [v.name for v, _ in candidates if id(v) not in captured])


def build(name: str, batch: int, seed: int = 0) -> TrainingSetup:
    """Builds model `name` (see MODELS / describe()) for batch size `batch` and returns its training step.

    Seeds Keras with `seed`, enables op determinism, builds the optimizer's variables and traces the step once, so
    `setup.train_step(*setup.inputs)` creates no variables and does not retrace. Names starting with "zoo/" are the
    conformance zoo's cases (capuchin_tf.cli.zoo.CASES), not in MODELS.
    """
    if name.startswith("zoo/"):  # the conformance zoo's cases (capuchin_tf/zoo.py), outside the benchmark tiers
        from capuchin_tf.cli import zoo

        return zoo.build(name, batch, seed)
    _check_name_and_batch(name, batch)
    keras.utils.set_random_seed(seed)
    tf.config.experimental.enable_op_determinism()

    model, optimizer, data, loss_fn = _define(name, batch, seed)
    names = tuple(data)
    step = standard_step(model, optimizer, names, loss_fn)
    inputs = tuple(tf.convert_to_tensor(data[k]) for k in names)
    input_spec = tuple(tf.TensorSpec(t.shape, t.dtype, name=k) for k, t in zip(names, inputs))
    train_step = tf.function(step, input_signature=input_spec, jit_compile=False, autograph=False)

    variables, roles, written_variables, unused = step_variables(
        name, train_step, [model], ((model.trainable_variables, "trainable"),
                                    (model.non_trainable_variables, "non_trainable"),
                                    (optimizer.variables, "optimizer")))

    input_size = tuple(int(d) for d in inputs[0].shape[1:])
    trainable_params = sum(int(v.shape.num_elements()) for v in model.trainable_variables)
    model_vars = [v for v, r in zip(variables, roles) if r in ("trainable", "non_trainable")]
    info = {
        "tier": MODELS[name],
        "description": _DESCRIPTIONS[name],
        "input_size": input_size,
        "input_names": names,
        "params": trainable_params,
        "non_trainable_params": sum(int(v.shape.num_elements()) for v in model_vars) - trainable_params,
        "param_bytes": sum(_nbytes(v) for v in model_vars),
        "optimizer": f"{type(optimizer).__name__}({float(optimizer.learning_rate.numpy()):g})",
        "optimizer_bytes": sum(_nbytes(v) for v, r in zip(variables, roles) if r == "optimizer"),
        "persistent_bytes": sum(_nbytes(v) for v in variables),
        "input_bytes": sum(int(t.shape.num_elements()) * t.dtype.size for t in inputs),
        "num_variables": len(variables),
        "num_written_variables": len(written_variables),
        "unused_variables": unused,
        "seed": seed,
    }
    return TrainingSetup(
        name=name,
        batch=batch,
        model=model,
        optimizer=optimizer,
        inputs=inputs,
        train_step=train_step,
        variables=variables,
        input_spec=input_spec,
        info=info,
        variable_roles=roles,
        written_variables=written_variables,
    )


@contextlib.contextmanager
def initial_values(load: Sequence[np.ndarray] | None = None) -> Iterator[list]:
    """Within it, the Keras variables built from an initializer are listed, in the order they are made, in the list it
    yields; with `load`, each takes the next of those host arrays as its initial value instead of running its
    initializer (a mismatch in number, shape or dtype raises ValueError).

    For the benchmarks on a device of the budget's size: an initializer runs on the device and its temporaries
    (a random draw, then its scaling: two to three tensors of the variable's size) land between the variables already
    made, so a model whose variables alone fill most of the device may not build (docs/decisions.md, "Decorated runs
    build from plain TensorFlow's initial values"). Built from the host copies of another build's initial values
    (plain TensorFlow's run), each variable takes one allocation of its own size, and the runs start from the same
    bits. Keras' private API it needs is in `capuchin_tf.tf.keras_private`."""
    from capuchin_tf.tf import keras_private

    made: list = []
    values = iter(load) if load is not None else None

    def initialize(variable, initializer, original):
        made.append(variable)
        if values is None:
            return original(variable, initializer)
        value = next(values, None)
        if value is None:
            raise ValueError(f"initial values: more variables than values (at {variable.path!r})")
        shape, dtype = tuple(variable.shape), keras.backend.standardize_dtype(variable.dtype)
        if tuple(value.shape) != shape or str(value.dtype) != dtype:
            raise ValueError(f"initial values: variable {len(made)} ({variable.path!r}) is {dtype}{list(shape)}, "
                             f"the value {value.dtype}{list(value.shape)}")
        keras_private.set_initial_value(variable, value)

    with keras_private.intercept_initializers(initialize):
        yield made
    if values is not None and next(values, None) is not None:
        raise ValueError(f"initial values: more values than the {len(made)} variables built")
