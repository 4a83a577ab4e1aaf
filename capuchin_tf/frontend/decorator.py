"""`capuchin_tf.function`: a drop-in for `@tf.function` on a training step, under a device-memory budget.

    @capuchin_tf.function(memory_budget="2GiB", policy="capuchin")
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

Per input signature, the first call is the measured execution and the next ones are guided (runtime.py). Every
argument is checked here, with a message that says what is accepted.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Mapping

import tensorflow as tf

from capuchin_tf.core.budget import format_bytes, parse_budget
from capuchin_tf.policy import POLICIES
from capuchin_tf.runtime.managed_step import MAX_SIGNATURES, ManagedStep, device_limit_bytes

LINKS = ("native", "p100")


def _check(memory_budget, policy, link, policy_options, plan_cache, feedback, max_replans, settle_steps,
           strict=False, max_signatures=MAX_SIGNATURES) -> int | None:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; the registered policies are: {', '.join(POLICIES)}")
    if isinstance(link, bool) or not (link in LINKS or (isinstance(link, (int, float)) and link > 0)):
        raise ValueError(f"link must be one of {LINKS} or a bandwidth in bytes/s (a positive number), got {link!r}")
    if policy_options is not None and not isinstance(policy_options, Mapping):
        raise TypeError(f"policy_options must be a mapping of option names to values, got {policy_options!r}")
    if plan_cache is not None and not isinstance(plan_cache, (str, os.PathLike)):
        raise TypeError(f"plan_cache must be a directory path (str or os.PathLike), got {plan_cache!r}")
    if not isinstance(feedback, bool):
        raise TypeError(f"feedback must be True or False, got {feedback!r}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be True or False, got {strict!r}")
    for name, value in (("max_replans", max_replans), ("settle_steps", settle_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if isinstance(max_signatures, bool) or not isinstance(max_signatures, int) or max_signatures < 1:
        raise ValueError(f"max_signatures must be a positive integer, got {max_signatures!r}")
    limit = device_limit_bytes()
    if memory_budget is None:
        return limit
    budget = parse_budget(memory_budget)
    if limit is not None and budget > limit:
        raise ValueError(f"memory_budget {format_bytes(budget)} is larger than the device ({format_bytes(limit)}); "
                         "the budget is what the plan aims at, at most the device's memory")
    return budget


def function(fn=None, *, memory_budget: int | float | str | None = None, policy: str = "capuchin",
             link: str | float = "native", policy_options: Mapping[str, Any] | None = None,
             plan_cache: str | os.PathLike | None = None, feedback: bool = True, max_replans: int = 20,
             settle_steps: int = 10, strict: bool = False, max_signatures: int = MAX_SIGNATURES,
             input_signature=None, autograph: bool = True, reduce_retracing: bool = False, verbose: bool = False):
    """Wraps a training step (a Python function or a `tf.function`) so that it trains under `memory_budget`.

    memory_budget: bytes, or a string such as "2GiB" or "512MiB" (capuchin_tf.core.budget); default: the device's limit.
    policy: a registered policy (`capuchin`, `swap-only`, `recompute-only`, `swap-all`, `checkpoint`, `tf`).
    link: `native` (swaps are memcpys), `p100` (a link emulated at the model's FLOP rate / 258 FLOP per byte,
        benchmarks.md) or a bandwidth in bytes/s.
    policy_options: extra keyword arguments of the policy.
    plan_cache: a directory; plans are stored there and reused by a restarted job (keyed on the graph, input
        signature, budget, policy, link and TensorFlow version).
    feedback: adjust the plan from late prefetches and the measured peak; max_replans bounds how often.
    strict: raise `CapuchinError` where capuchin_tf would otherwise refuse a step (one warning, then plain
        TensorFlow): a step that writes state it cannot copy back, whose plan cannot be applied, or whose measured or
        guided graph fails.
    max_signatures: input signatures (concrete function and input shapes) kept, each with its own measurement and
        plan; past it the least recently used is dropped, with one warning.
    A budget below what the step can ever need raises `BudgetError` at the first call, before anything runs.
    input_signature, autograph, reduce_retracing: passed to `tf.function` when `fn` is a Python function.
    The step must not be XLA-compiled (jit_compile=True is refused).
    """
    budget = _check(memory_budget, policy, link, policy_options, plan_cache, feedback, max_replans, settle_steps,
                    strict, max_signatures)

    def wrap(f):
        if hasattr(f, "get_concrete_function"):
            if getattr(f, "_jit_compile", False):
                raise ValueError("the step is compiled with XLA (jit_compile=True): capuchin_tf's ops cannot run "
                                 "under XLA; use jit_compile=False")
            tf_fn = f
        elif callable(f):
            tf_fn = tf.function(f, input_signature=input_signature, autograph=autograph, jit_compile=False,
                                reduce_retracing=reduce_retracing)
        else:
            raise TypeError(f"capuchin_tf.function wraps a function, got {f!r}")
        step = ManagedStep(tf_fn, budget_bytes=budget, policy=policy, link=link, policy_options=policy_options,
                           cache_dir=None if plan_cache is None else os.fspath(plan_cache), feedback=feedback,
                           max_replans=max_replans, settle_steps=settle_steps, strict=strict,
                           max_signatures=max_signatures, verbose=verbose)
        functools.update_wrapper(step, getattr(f, "python_function", f), updated=())
        return step

    return wrap(fn) if fn is not None else wrap
