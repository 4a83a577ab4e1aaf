"""`capuchin_tf.function`: a drop-in for `@tf.function` on a training step, under a device-memory budget.

    @capuchin_tf.function(memory_budget="2GiB", policy="capuchin")
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

Per input signature, the first call is the measured execution and the next ones are guided (runtime/managed_step.py).
Every argument is checked once, by `runtime.options.Options`, with a message that says what is accepted.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from capuchin_tf.runtime.managed_step import ManagedStep, device_limit_bytes
from capuchin_tf.runtime.options import MAX_SIGNATURES, Options
from capuchin_tf.tf import capture


def make_options(memory_budget=None, **fields) -> Options:
    """The checked options of a step on this process's device (the decorator's and the callback's arguments)."""
    return Options.make(memory_budget=memory_budget, device_limit=device_limit_bytes(), **fields)


def function(fn=None, *, memory_budget: int | float | str | None = None, policy: str = "capuchin",
             link: str | float = "native", policy_options: Mapping[str, Any] | None = None,
             plan_cache: str | os.PathLike | None = None, feedback: bool = True, max_replans: int = 20,
             settle_steps: int = 10, background_builds: bool = True, planned_layout: bool | str = "auto",
             strict: bool = False, max_signatures: int = MAX_SIGNATURES, input_signature=None, autograph: bool = True,
             reduce_retracing: bool = False, verbose: bool = False, keep_failures: str | os.PathLike | None = None):
    """Wraps a training step (a Python function or a `tf.function`) so that it trains under `memory_budget`.

    memory_budget: bytes, or a string such as "2GiB" or "512MiB" (capuchin_tf.core.budget); default: the device's limit.
    policy: a registered policy (`capuchin`, `swap-only`, `recompute-only`, `swap-all`, `checkpoint`, `tf`).
    link: `native` (swaps are memcpys), `p100` (a link emulated at the model's FLOP rate / 258 FLOP per byte,
        benchmarks.md) or a bandwidth in bytes/s.
    policy_options: extra keyword arguments of the policy.
    plan_cache: a directory; plans are stored there and reused by a restarted job (keyed on the graph, input
        signature, budget, policy, link and TensorFlow version).
    feedback: adjust the plan from late prefetches and the measured peak; max_replans bounds how often.
    background_builds: plan changes (feedback, measured arbitration) are built in a background thread while the
        current plan keeps running; False: the step that asks for one waits for it.
    planned_layout: on the simulated device, guided steps place their allocations of more than 64 KiB where a layout
        made from an earlier step of the same plan says (no free memory in pieces); "auto" (the default): once a guided
        step of the input signature evicted tensors on demand, its plans from then on; True: always; False: never.
    strict: raise `CapuchinError` where capuchin_tf would otherwise refuse a step (one warning, then plain
        TensorFlow): a step that writes state it cannot copy back, whose plan cannot be applied, or whose measured or
        guided graph fails.
    max_signatures: input signatures (concrete function and input shapes) kept, each with its own measurement and
        plan; past it the least recently used is dropped, with one warning.
    keep_failures: a directory; when planning fails, the trace and the error are kept in a new directory there, which
        the warning names (`python -m capuchin_tf plan --replay DIR` plans it again; attach it to a report).
    A budget below what the step can ever need raises `BudgetError` at the first call, before anything runs.
    input_signature, autograph, reduce_retracing: passed to `tf.function` when `fn` is a Python function.
    The step must not be XLA-compiled (jit_compile=True is refused).
    """
    options = make_options(memory_budget, policy=policy, link=link,
                           policy_options={} if policy_options is None else policy_options,
                           plan_cache=plan_cache, feedback=feedback, max_replans=max_replans,
                           settle_steps=settle_steps, background_builds=background_builds,
                           planned_layout=planned_layout, strict=strict,
                           max_signatures=max_signatures, verbose=verbose, keep_failures=keep_failures)
    return wrap_step(fn, options, input_signature=input_signature, autograph=autograph,
                     reduce_retracing=reduce_retracing)


def wrap_step(fn, options: Options, *, input_signature=None, autograph: bool = True, reduce_retracing: bool = False):
    """`fn` (a Python function or a `tf.function`; None: a decorator) as a ManagedStep with these options."""

    def wrap(f):
        if hasattr(f, "get_concrete_function"):
            capture.refuse_xla(f)
            tf_fn = f
        elif callable(f):
            tf_fn = tf.function(f, input_signature=input_signature, autograph=autograph, jit_compile=False,
                                reduce_retracing=reduce_retracing)
        else:
            raise TypeError(f"capuchin_tf.function wraps a function, got {f!r}")
        step = ManagedStep(tf_fn, options)
        functools.update_wrapper(step, getattr(f, "python_function", f), updated=())
        return step

    return wrap(fn) if fn is not None else wrap
