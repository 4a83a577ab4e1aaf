"""Where a Keras 3 variable's initializer runs, through Keras' private API (the TensorFlow backend's
`Variable._initialize_with_initializer` and `Variable._initialize`): the benchmarks build a model from another
build's initial values (`capuchin_tf.cli.models.initial_values`)."""

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
