"""Keras 3's and TensorFlow's private API that the benchmark models and the Keras callback need, in one place:
where a variable's initializer runs (the TensorFlow backend's `Variable._initialize_with_initializer` and
`Variable._initialize`: the benchmarks build a model from another build's initial values,
`capuchin_tf.cli.models.initial_values`), a model's layers at every depth and a layer's seed generators (to name the
variables a step uses), and whether a value is a composite tensor."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import tensorflow as tf


@contextlib.contextmanager
def intercept_initializers(initialize: Callable[[object, object, Callable], None]) -> Iterator[None]:
    """While it lasts, every Keras variable built from an initializer calls `initialize(variable, initializer,
    original)` instead, where `original(variable, initializer)` runs the initializer as Keras would."""
    from keras.src.backend.tensorflow.core import Variable

    original = Variable._initialize_with_initializer
    Variable._initialize_with_initializer = lambda variable, initializer: initialize(variable, initializer, original)
    try:
        yield
    finally:
        Variable._initialize_with_initializer = original


def set_initial_value(variable, value) -> None:
    """Initializes `variable` from a host array, copied onto the device by an op: a tensor made from a host array can
    share the array's memory instead of taking a buffer from the device allocator, and the variable would then not be
    on the (simulated) device."""
    variable._initialize(tf.raw_ops.DeepCopy(x=tf.convert_to_tensor(value)))


def flatten_layers(model) -> list:
    """Every layer of a Keras model, at any depth, itself included (Keras' `_flatten_layers`)."""
    return list(model._flatten_layers())


def seed_generators(layer) -> list:
    """The Keras SeedGenerators a layer owns (Dropout, MultiHeadAttention's dropout, ...)."""
    gens = getattr(layer, "_seed_generators", None) or []
    own = getattr(layer, "seed_generator", None)
    if own is not None and own not in gens:
        gens = [*gens, own]
    return list(gens)


def is_tensor(value) -> bool:
    """A dense or composite tensor (a RaggedTensor, a SparseTensor: `tf.__internal__.CompositeTensor`)."""
    return isinstance(value, (tf.Tensor, tf.__internal__.CompositeTensor))
