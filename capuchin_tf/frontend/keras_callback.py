"""`CapuchinCallback`: Keras 3 `model.fit` under a device-memory budget.

    from capuchin_tf.frontend.keras_callback import CapuchinCallback

    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", jit_compile=False)
    capuchin = CapuchinCallback(memory_budget="2GiB", policy="capuchin")
    model.fit(x, y, batch_size=256, epochs=10, callbacks=[capuchin])
    print(capuchin.report())

For the duration of `fit`, the callback replaces `model.train_function` (what `fit` calls once per batch with its
data iterator) by one that takes the next batch and runs `model.train_step` on it through a
`ManagedStep` (capuchin_tf/runtime/managed_step.py): per input signature, the first batch is the measured execution
and the next ones are guided; every batch shape is an input signature (a partial last batch is measured once too). The
batch is flattened to positional tensors (composite tensors to their components); each batch structure gets its own
`tf.function` and ManagedStep, which keep their plans across `fit` calls on the same model. Only training is
managed: `evaluate`, `predict` and the validation of `fit` run as plain TensorFlow. The model's own train function
is restored when training ends; if `fit` raises, Keras calls no callback, and the managed one stays installed until
the next `fit` with this callback ends (or `compile`, or `model.make_train_function(force=True)`).

Requirements, checked when training begins: `steps_per_execution=1`, `jit_compile=False` (capuchin_tf's ops do not
run under XLA), `run_eagerly=False`, and at most one replica.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import keras
import tensorflow as tf

from capuchin_tf.frontend import decorator
from capuchin_tf.runtime.managed_step import ManagedStep
from capuchin_tf.runtime.options import MAX_SIGNATURES
from capuchin_tf.tf import keras_private


class CapuchinCallback(keras.callbacks.Callback):
    """Trains every batch of `model.fit` through a capuchin_tf ManagedStep.

    The arguments are those of `capuchin_tf.function` (decorator.py), checked here, when the callback is made:
    memory_budget: bytes, or a string such as "2GiB"; default: the device's limit.
    policy: a registered policy (`capuchin`, `swap-only`, `recompute-only`, `swap-all`, `checkpoint`, `tf`).
    link, policy_options, plan_cache, feedback, max_replans, settle_steps, background_builds, planned_layout, strict,
    max_signatures, verbose, keep_failures: as in `capuchin_tf.function`.
    """

    def __init__(self, memory_budget: int | float | str | None = None, policy: str = "capuchin",
                 link: str | float = "native", policy_options: Mapping[str, Any] | None = None,
                 plan_cache: str | os.PathLike | None = None, feedback: bool = True, max_replans: int = 20,
                 settle_steps: int = 10, background_builds: bool = True, planned_layout: bool | str = "auto",
                 strict: bool = False,
                 max_signatures: int = MAX_SIGNATURES, verbose: bool = False,
                 keep_failures: str | os.PathLike | None = None):
        super().__init__()
        self.options = decorator.make_options(
            memory_budget, policy=policy, link=link, policy_options={} if policy_options is None else policy_options,
            plan_cache=plan_cache, feedback=feedback, max_replans=max_replans, settle_steps=settle_steps,
            background_builds=background_builds, planned_layout=planned_layout, strict=strict,
            max_signatures=max_signatures, verbose=verbose, keep_failures=keep_failures)
        self._steps: dict[str, ManagedStep] = {}  # batch structure (repr of its template) -> its step
        self._steps_model: keras.Model | None = None  # the model the steps train
        self._original: Callable | None = None  # the model's own train_function, restored at the end of training
        self._train_function = self._managed_train_function

    # ---- public ------------------------------------------------------------------------------------------------
    def report(self) -> dict:
        """The ManagedSteps' reports (managed_step.ManagedStep.report), merged: one entry per input signature."""
        out = {}
        for step in self._steps.values():
            out.update(step.report())
        return out

    # ---- Keras hooks -------------------------------------------------------------------------------------------
    def on_train_begin(self, logs=None) -> None:
        model = self.model
        if model.steps_per_execution != 1:
            raise ValueError(f"CapuchinCallback manages one batch per step: compile the model with "
                             f"steps_per_execution=1 (it has {model.steps_per_execution})")
        if model.jit_compile:
            raise ValueError("the model is compiled with XLA (jit_compile=True): capuchin_tf's ops cannot run under "
                             "XLA; compile the model with jit_compile=False to train it with CapuchinCallback")
        if model.run_eagerly:
            raise ValueError("the model is compiled with run_eagerly=True: CapuchinCallback manages a graph step; "
                             "compile the model with run_eagerly=False")
        replicas = model.distribute_strategy.num_replicas_in_sync
        if replicas != 1:
            raise ValueError(f"CapuchinCallback manages one device; the model's distribution strategy has {replicas} "
                             "replicas")
        if self._steps_model is not model:
            self._steps, self._steps_model = {}, model
        self._install()

    def on_train_batch_begin(self, batch, logs=None) -> None:
        self._install()  # again if something rebuilt the train function (make_train_function(force=True))

    def on_train_end(self, logs=None) -> None:
        if self.model.train_function is self._train_function:
            self.model.train_function = self._original
        self._original = None

    # ---- the managed train function ----------------------------------------------------------------------------
    def _install(self) -> None:
        if self.model.train_function is not self._train_function:
            self._original = self.model.train_function
            self.model.train_function = self._train_function

    def _managed_train_function(self, iterator):
        """What `fit` calls per batch: like Keras' own train_function at steps_per_execution=1, it takes the next
        batch of `iterator` (StopIteration or OutOfRangeError at the end of the data: `fit` ends the epoch) and
        returns the step's logs (the dict of metric tensors `train_step` returns)."""
        data = tf.nest.map_structure(_as_tensor, next(iterator))
        template = tf.nest.map_structure(_leaf_spec, data)
        key = repr(template)
        if key not in self._steps:
            self._steps[key] = self._make_step(template)
        step = self._steps[key]
        return step(*[t for t in tf.nest.flatten(data, expand_composites=True) if t is not None])

    def _make_step(self, template) -> ManagedStep:
        model = self.model
        flat_template = tf.nest.flatten(template, expand_composites=True)

        def one_step(*tensors):
            it = iter(tensors)
            flat = [None if spec is None else next(it) for spec in flat_template]
            data = tf.nest.pack_sequence_as(template, flat, expand_composites=True)
            return model.distribute_strategy.run(model.train_step, args=(data,))

        # autograph=False: Keras does not convert train_step either (its step function is `do_not_convert`).
        return decorator.wrap_step(tf.function(one_step, autograph=False, jit_compile=False), self.options)


def _as_tensor(value):
    """A batch leaf as `train_step` gets it from Keras: an Optional is None (Keras' `_autoconvert_optionals`),
    arrays are tensors, composite tensors stay composite."""
    if value is None or isinstance(value, tf.experimental.Optional):
        return None
    if keras_private.is_tensor(value):
        return value
    return tf.convert_to_tensor(value)


def _leaf_spec(value):
    """A leaf of a batch's structure template: its type without the shape of a dense tensor (a dense tensor's shape
    is part of the input signature, which the ManagedStep handles)."""
    if value is None:
        return None
    if isinstance(value, tf.Tensor):
        return tf.TensorSpec(None, value.dtype)
    return tf.type_spec_from_value(value)
