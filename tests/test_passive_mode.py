"""Passive mode on the simulated device: at half the transient peak plain TensorFlow runs out of memory, and the
measured step completes under the budget with plain TensorFlow's results, bit for bit; a passive step's record has
what its pool evicted and what it waited for.

Runs the real command (`python -m capuchin_tf profile --transient-fraction 0.5`), which measures the plain step's
peak and persistent memory, sets the budget to persistent + transient / 2, and runs plain TensorFlow and the
measured step at that budget, each in a fresh process.
"""

import json
import subprocess
import sys

import pytest

MiB = 1 << 20

# A quick-tier model at a batch where half the transient peak is above the step's memory floor. At batch 32 a
# convolution backprop's workspace (20-23 MiB on this CPU, whatever the batch) does not fit half the cnn's transient
# peak; the other quick models' floors are above half their transient peak at any batch (docs/results.md).
CASES = [("cnn", 128)]


@pytest.mark.parametrize("model,batch", CASES)
def test_measured_step_completes_at_half_the_transient_peak(model, batch, tmp_path):
    out = tmp_path / "trace.json"
    proc = subprocess.run(
        [sys.executable, "-m", "capuchin_tf", "profile", "--model", model, "--batch", str(batch),
         "--transient-fraction", "0.5", "--json", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trace = json.loads(out.read_text())
    budget = trace["budget_bytes"]
    assert trace["plain_fits_budget"] is False
    assert "OOM when allocating" in trace["plain_budget_error"]
    assert trace["peak_bytes"] <= budget
    assert trace["plain_peak_bytes"] > budget
    assert trace["evicted_bytes"] > 0 and trace["meta"]["passive_evictions"] > 0
    assert trace["bitwise_equal"] is True


PASSIVE_RECORD = """
import json
import capuchin_tf
from capuchin_tf.cli import models
from capuchin_tf.tf import ops

setup = models.build("cnn", 128)
step = capuchin_tf.function(setup.train_step, memory_budget=117 * (1 << 20), feedback=False)
step(*setup.inputs)  # the measured step
state = next(iter(step._states.values()))
before = ops.host_store_stats()
step._passive(state, setup.inputs, 0, None)  # what a guided step that keeps running out of memory falls back to
after = ops.host_store_stats()
r = state.history[-1]
print(json.dumps({"phase": r.phase, "evictions": r.passive_evictions, "evicted": r.passive_evicted_bytes,
                  "store_evictions": after["passive_evictions"] - before["passive_evictions"],
                  "store_evicted": after["passive_evicted_bytes"] - before["passive_evicted_bytes"],
                  "waited": r.waited_s}))
"""


def test_a_passive_step_records_what_it_evicted_and_waited_for(simulated_device):
    # A passive step (the fallback when no plan fits) evicts most of what it saves; its record said 0 evicted and no
    # waits, and the report with it, where 64-85 MiB a step were evicted on demand. The device is twice the budget,
    # which the allocator holds: on a device of exactly the budget the step can find its free memory split under
    # load (seen once in CI at b1e57a5, a BudgetError naming split free memory), which is not what this test checks.
    r = simulated_device(PASSIVE_RECORD, limit_mb=2 * 117)
    assert r["phase"] == "passive"
    assert r["evictions"] == r["store_evictions"] > 0, r
    assert r["evicted"] == r["store_evicted"] >= 16 * MiB, r
    assert r["waited"].get("passive_eviction", 0) > 0 or r["waited"].get("evicted_get", 0) > 0, r
