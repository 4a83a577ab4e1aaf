"""Test set-up: every test process runs on the simulated device (design.md).

The BFC limit is fixed when TensorFlow starts, so it is set here, before anything imports TensorFlow. Tests that need
another limit run their code in a fresh process (`run_on_simulated_device`).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

TEST_DEVICE_MB = 4096
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# TF's oneDNN kernels can crash on an allocation failure instead of raising ResourceExhaustedError
# (docs/decisions.md), so the simulated device always runs with them off.
os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(TEST_DEVICE_MB)


def run_on_simulated_device(code: str, limit_mb: int, timeout: float = 300.0, env: dict | None = None) -> dict:
    """Runs `code` in a fresh Python process whose CPU:0 is a BFC allocator of `limit_mb` MiB.

    The code must print one JSON object as its last line of standard output; that object is returned.
    """
    from capuchin_tf.tf.simulated_device import simulated_device_env

    child_env = simulated_device_env(limit_mb, inter_op_threads=None)
    child_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env,
    )
    if proc.returncode != 0:
        raise AssertionError(f"child process failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    return json.loads(lines[-1])


@pytest.fixture(scope="session")
def simulated_device():
    return run_on_simulated_device


def _assert_plan_fits_policy(policy: str, counts: dict) -> None:
    """The plan counts (`swapped_tensors`, `recomputed_tensors`) show the policy's mechanisms: swap-only only swaps,
    recompute-only only recomputes, the hybrid does at least one of them."""
    swapped, recomputed = counts["swapped_tensors"], counts["recomputed_tensors"]
    if policy == "swap-only":
        assert swapped > 0 and recomputed == 0, counts
    elif policy == "recompute-only":
        assert recomputed > 0 and swapped == 0, counts
    else:
        assert swapped + recomputed > 0, counts


@pytest.fixture(scope="session")
def assert_plan_fits_policy():
    return _assert_plan_fits_policy
