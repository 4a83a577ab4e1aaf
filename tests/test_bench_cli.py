"""`python -m capuchin_tf bench`: argument checks, a real `bench equal` and an out-of-memory `bench run`.

The workers run in fresh processes on their own simulated device (cli/common.run_worker), whatever this process's.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from capuchin_tf.cli import main

REPO = pathlib.Path(__file__).resolve().parents[1]
GOOD = ["--model", "mlp", "--batch", "64", "--budget-mb", "4096", "--policy", "capuchin", "--steps", "3"]


def _args(**changes: str) -> list[str]:
    out = list(GOOD)
    for flag, value in changes.items():
        out[out.index("--" + flag.replace("_", "-")) + 1] = value
    return out


@pytest.mark.parametrize("action", ["run", "equal"])
@pytest.mark.parametrize(
    "changes, message",
    [
        ({"model": "nope"}, "unknown model 'nope'; valid models: mlp, cnn, transformer"),
        ({"batch": "0"}, "--batch must be at least 1"),
        ({"budget_mb": "0"}, "--budget-mb must be at least 1"),
        ({"steps": "0"}, "--steps must be at least 1"),
        ({"policy": "lru"}, "unknown policy 'lru'; valid policies: capuchin, checkpoint, recompute-only"),
    ],
)
def test_bad_arguments(action, changes, message, tmp_path, capsys):
    out = tmp_path / "out.json"
    assert main.main(["bench", action, *_args(**changes), "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"capuchin_tf bench: error: {message}" in err
    assert not out.exists()


def test_bad_link_device_and_json_path(tmp_path, capsys):
    out = str(tmp_path / "out.json")
    assert main.main(["bench", "run", *GOOD, "--link", "pcie", "--json", out]) == 2
    assert "unknown link 'pcie'; valid links: native, p100" in capsys.readouterr().err
    assert main.main(["bench", "equal", *GOOD, "--device-mb", "0", "--json", out]) == 2
    assert "--device-mb must be at least 1" in capsys.readouterr().err
    assert main.main(["bench", "run", *GOOD, "--json", str(tmp_path / "missing" / "out.json")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_bad_argument_from_the_command_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "capuchin_tf", "bench", "run", *_args(policy="lru"), "--json", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO,
    )
    assert proc.returncode == 2
    assert "capuchin_tf bench: error: unknown policy 'lru'" in proc.stderr
    assert "tf" in proc.stderr.split("valid policies:")[1]


def test_equal_mlp_bit_for_bit(tmp_path, capfd):
    out = tmp_path / "equal.json"
    assert main.main(["bench", "equal", *GOOD, "--json", str(out)]) == 0
    printed = capfd.readouterr().out
    assert "step 3/3" in printed and "bit-for-bit equal to it: yes" in printed
    data = json.loads(out.read_text())
    assert data["bitwise_equal"] is True and data["ok"] is True and data["error"] is None
    assert 0 < data["peak_bytes"] <= data["budget_bytes"] == 4096 * 2**20
    assert 0 < data["persistent_bytes"] < data["peak_bytes"]
    assert data["plain_peak_bytes"] > 0
    for key in ("swapped_tensors", "swapped_bytes", "recomputed_tensors", "recomputed_bytes", "replans", "settled",
                "model", "batch", "policy", "link", "steps", "tf_version", "date", "machine", "median_step_s"):
        assert key in data, key
    plain, managed = data["plain"], data["managed"]
    assert plain["policy"] == "tf" and managed["policy"] == "capuchin"
    assert managed["losses_hex"] == plain["losses_hex"] and len(managed["losses"]) == 3
    assert managed["variables_sha256"] == plain["variables_sha256"]
    assert managed["phases"][0] == "measured" and len(managed["step_s"]) == len(managed["late_prefetches"]) == 3
    assert managed["samples_per_s"] == pytest.approx(64 / managed["median_step_s"])
    assert managed["report"]["steps"][0]["phase"] == "measured" and len(managed["report"]["steps"]) == 3
    assert set(managed["machine"]) >= {"cores", "platform"} and len(managed["date"]) == 10
    assert plain["report"] is None and plain["swapped_tensors"] == 0


def test_run_out_of_memory_is_reported(tmp_path, capfd):
    out = tmp_path / "oom.json"
    args = _args(batch="2048", budget_mb="48", policy="tf", steps="2")
    assert main.main(["bench", "run", *args, "--json", str(out)]) == 1
    assert "failed (0 of 2 steps done): ResourceExhaustedError: OOM when allocating" in capfd.readouterr().out
    data = json.loads(out.read_text())
    assert data["ok"] is False and data["error"].startswith("ResourceExhaustedError: OOM when allocating")
    assert data["losses"] == [] and data["peak_bytes"] is None and data["persistent_bytes"] > 0


def test_batch_runs_needs_three_clean_steps_under_the_budget():
    from capuchin_tf.cli.bench import batch_runs

    ok = {"ok": True, "peak_bytes": 100, "phases": ["measured", "guided", "guided", "guided"], "retries": [0, 0, 0, 0]}
    assert batch_runs(ok, 100)
    assert not batch_runs(ok, 99)  # over the budget
    assert not batch_runs({**ok, "ok": False}, 100)
    assert not batch_runs({**ok, "retries": [0, 0, 1, 0]}, 100)  # an out-of-memory retry among the last three
    assert not batch_runs({**ok, "phases": ["measured", "guided", "passive", "guided"]}, 100)
    assert not batch_runs({**ok, "phases": ["measured", "guided", "guided"], "retries": [0, 0, 0]}, 100)
    assert batch_runs({**ok, "phases": ["plain"] * 4}, 100)


def test_maxbatch_bad_arguments(tmp_path, capsys):
    out = str(tmp_path / "out.json")
    base = ["bench", "maxbatch", "--model", "mlp", "--budget-mb", "64", "--policy", "tf", "--json", out]
    assert main.main([*base, "--start", "64", "--max-batch", "32"]) == 2
    assert "--start <= --max-batch" in capsys.readouterr().err
    assert main.main([*base, "--start", "64", "--steps", "3"]) == 2
    assert "--steps must be at least 4" in capsys.readouterr().err


def test_maxbatch_finds_plain_tensorflows_largest_batch(tmp_path):
    out = tmp_path / "max.json"
    assert main.main(["bench", "maxbatch", "--model", "mlp", "--budget-mb", "48", "--policy", "tf", "--start", "256",
                     "--resolution", "256", "--steps", "4", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    found, failing = data["max_batch_found"], data["first_failing_batch"]
    assert found is not None and failing is not None and 0 < failing - found <= 256
    by_batch = {t["batch"]: t for t in data["trials"]}
    assert by_batch[found]["runs"] and by_batch[found]["peak_bytes"] <= 48 * (1 << 20)
    assert not by_batch[failing]["runs"] and "OOM" in by_batch[failing]["error"]
    assert all(t["runs"] == (t["batch"] <= found) for t in data["trials"])
