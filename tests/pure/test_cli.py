"""``python -m capuchin_tf plan``: summary, plan file, clear errors."""

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from capuchin_tf.cli import common, main
from capuchin_tf.core import synthetic

MiB = 1 << 20


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    trace = synthetic.transformer(2)
    path = tmp_path_factory.mktemp("traces") / "t.json"
    trace.save(path)
    return path, trace


def run(capsys, *argv):
    code = main.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_prints_a_summary_and_writes_the_plan(trace_file, capsys, tmp_path):
    path, trace = trace_file
    budget_mb = float(f"{synthetic.budget_fraction(trace, 0.5) / MiB:.3f}")
    out_json = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", "--trace", str(path), "--budget-mb", str(budget_mb), "--policy",
                         "capuchin", "--link", "p100", "--json", str(out_json))
    assert code == 0, err
    assert "swapped:" in out and "recomputed:" in out and "predicted peak" in out and "%" in out
    plan = json.loads(out_json.read_text())
    assert plan["feasible"] is True
    assert plan["predicted_peak_bytes"] <= int(budget_mb * MiB)
    assert plan["predicted_step_s"] >= trace.step_time
    assert plan["budget_bytes"] == int(budget_mb * MiB)
    assert plan["device"]["link"] == "p100"


@pytest.mark.parametrize("link", ["native", "1.5e9"])
@pytest.mark.parametrize("policy", ["tf", "swap-all", "checkpoint", "swap-only", "recompute-only"])
def test_every_policy_and_link_from_the_command_line(trace_file, capsys, tmp_path, policy, link):
    path, trace = trace_file
    out_json = tmp_path / "p.json"
    code, out, err = run(capsys, "plan", "--trace", str(path), "--budget-mb", "30", "--policy", policy, "--link",
                         link, "--json", str(out_json))
    assert code == 0, err
    assert f"policy {policy}" in out
    assert json.loads(out_json.read_text())["policy"] == policy


def test_bad_input_gives_one_clear_error(trace_file, capsys, tmp_path):
    path, trace = trace_file
    code, _, err = run(capsys, "plan", "--trace", str(tmp_path / "missing.json"), "--budget-mb", "10")
    assert code == 2 and "trace file not found" in err
    code, _, err = run(capsys, "plan", "--trace", str(path), "--budget-mb", "-5")
    assert code == 2 and "positive size" in err
    code, _, err = run(capsys, "plan", "--trace", str(path), "--budget-mb", "lots")
    assert code == 2 and "MiB, or a size with its unit" in err
    code, _, err = run(capsys, "plan", "--trace", str(path), "--budget-mb", "10", "--policy", "vdnn")
    assert code == 2 and "unknown policy 'vdnn'" in err and "capuchin" in err and "checkpoint" in err
    code, _, err = run(capsys, "plan", "--trace", str(path), "--budget-mb", "10", "--link", "warp")
    assert code == 2 and "unknown link 'warp'" in err
    no_flops = tmp_path / "noflops.json"
    dataclasses.replace(trace, meta={}).save(no_flops)
    code, _, err = run(capsys, "plan", "--trace", str(no_flops), "--budget-mb", "10", "--link", "p100")
    assert code == 2 and "meta['flops']" in err
    junk = tmp_path / "junk.json"
    junk.write_text("[1, 2")
    code, _, err = run(capsys, "plan", "--trace", str(junk), "--budget-mb", "10")
    assert code == 2 and "cannot read trace" in err
    code, _, err = run(capsys)
    assert code == 2 and "plan" in err


def test_an_unreachable_budget_is_reported_with_the_op(trace_file, capsys):
    path, trace = trace_file
    code, out, _ = run(capsys, "plan", "--trace", str(path), "--budget-mb", "1")
    assert code == 0
    assert "NOT feasible" in out and "unreachable" in out and "op '" in out


def test_subcommands_can_be_registered(capsys):
    seen = {}

    def add(p):
        p.add_argument("--model")

    def run_it(args):
        seen["model"] = args.model
        return 3

    common.register_subcommand("test-bench", add, run_it, help="a test subcommand")
    try:
        assert main.main(["test-bench", "--model", "mlp"]) == 3 and seen == {"model": "mlp"}
        with pytest.raises(ValueError):
            common.register_subcommand("test-bench", add, run_it)
    finally:
        del common.SUBCOMMANDS["test-bench"]


def test_python_dash_m_runs_without_tensorflow(trace_file, tmp_path):
    path, _ = trace_file
    env = dict(os.environ, CAPUCHIN_TF_PURE="1")
    code = (
        "import sys, runpy; sys.modules['tensorflow'] = None; "
        f"sys.argv = ['capuchin_tf', 'plan', '--trace', {str(path)!r}, '--budget-mb', '30']; "
        "runpy.run_module('capuchin_tf', run_name='__main__')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "policy capuchin" in proc.stdout


# ---- malformed traces and arguments: one line on stderr, exit code 2, never a traceback -------------------------
def _mutated(trace, mutate):
    d = json.loads(json.dumps(trace.to_json()))
    return mutate(d)


def _negate_sizes(d):
    for t in d["tensors"]:
        t["nbytes"] = -t["nbytes"]
    d["peak_bytes"] = -d["peak_bytes"]
    d["persistent_bytes"] = -d["persistent_bytes"]
    return d


def _field(path, value):
    def mutate(d):
        node = d
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        return d
    return mutate


def _unknown_access_op(d):
    d["tensors"][3]["accesses"][1][2] = "no_such_op"
    return d


def _time_backwards(d):
    d["ops"][5][2] = d["ops"][4][2] / 2
    return d


MALFORMED = {
    "top-level list": (lambda d: [d], "trace: expected a JSON object, got a list of 1 item"),
    "unknown access op": (_unknown_access_op, "trace.tensors[3].accesses[1][2] (op): 'no_such_op' is not an executed"),
    "size as a string": (_field(["tensors", 3, "nbytes"], "abc"),
                         "trace.tensors[3].nbytes: expected a non-negative integer, got 'abc'"),
    "time as a string": (_field(["ops", 2, 2], "0.5"), "trace.ops[2][2] (start): expected a non-negative number"),
    "graph entry not an object": (_field(["graph", "ops", 0], ["x"]),
                                  "trace.graph.ops[0]: expected a JSON object, got a list of 1 item"),
    "negative sizes": (_negate_sizes, "trace.peak_bytes: expected a non-negative integer"),
    "negative nbytes": (_field(["tensors", 3, "nbytes"], -(1 << 20)), "trace.tensors[3].nbytes: expected a non-neg"),
    "negative persistent": (_field(["persistent_bytes"], -1), "trace.persistent_bytes: expected a non-negative"),
    "negative duration": (_field(["ops", 2, 3], -0.25), "trace.ops[2][3] (duration): expected a non-negative number"),
    "times going backwards": (_time_backwards, "trace.ops[5][2] (start): ops are in executed order"),
}


def assert_one_line_error(code, out, err, expected):
    assert code == 2, (out, err)
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("capuchin_tf plan: error: "), err
    assert expected in lines[0], err
    assert out == ""


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_trace_is_one_line_error(trace_file, capsys, tmp_path, case):
    _, trace = trace_file
    mutate, expected = MALFORMED[case]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_mutated(trace, mutate)))
    code, out, err = run(capsys, "plan", "--trace", str(bad), "--budget-mb", "30", "--link", "p100",
                         "--json", str(tmp_path / "plan.json"))
    assert_one_line_error(code, out, err, expected)
    assert f"cannot read trace {bad}: " in err
    assert not (tmp_path / "plan.json").exists()


def test_unreadable_trace_files_are_one_line_errors(trace_file, capsys, tmp_path):
    path, _ = trace_file
    for name, data, expected in [
        ("junk.json", b"[1, 2", "not valid JSON"),
        ("binary.json", b"\xff\xfe\x00\x01", "not valid JSON"),
        ("empty.json", b"", "not valid JSON"),
        ("trace.json.gz", __import__("gzip").compress(path.read_bytes()), "gzip"),
    ]:
        p = tmp_path / name
        p.write_bytes(data)
        code, out, err = run(capsys, "plan", "--trace", str(p), "--budget-mb", "30")
        assert_one_line_error(code, out, err, expected)
    code, out, err = run(capsys, "plan", "--trace", str(tmp_path), "--budget-mb", "30")  # a directory
    assert_one_line_error(code, out, err, "trace file not found")


@pytest.mark.parametrize("argv,expected", [
    (["--budget-mb", "0"], "--budget-mb must be a positive size, got '0'"),
    (["--budget-mb", "-5"], "--budget-mb must be a positive size, got '-5'"),
    (["--budget-mb", "1e-12"], "--budget-mb must be a positive size"),
    (["--budget-mb", "nan"], "--budget-mb must be a positive size"),
    (["--budget-mb", "inf"], "--budget-mb must be a positive size"),
    (["--budget-mb", "lots"], "--budget-mb must be MiB, or a size with its unit (2GiB, 512MiB), got 'lots'"),
    (["--budget-mb", "30", "--margin-mb", "-1"], "--margin-mb must be a non-negative size"),
    (["--budget-mb", "30", "--policy", "vdnn"], "unknown policy 'vdnn'"),
    (["--budget-mb", "30", "--link", "warp"], "unknown link 'warp'"),
    (["--budget-mb", "30", "--link", "0"], "link bandwidth must be a positive number of bytes/s"),
    (["--budget-mb", "30", "--link=-1e9"], "link bandwidth must be a positive number of bytes/s"),
    (["--budget-mb", "30", "--link", "nan"], "link bandwidth must be a positive number of bytes/s"),
])
def test_bad_plan_arguments_are_one_line_errors(trace_file, capsys, argv, expected):
    path, _ = trace_file
    code, out, err = run(capsys, "plan", "--trace", str(path), *argv)
    assert_one_line_error(code, out, err, expected)


@pytest.mark.parametrize("case", ["top-level list", "negative sizes", "unknown access op"])
def test_python_dash_m_reports_a_malformed_trace_in_one_line(trace_file, tmp_path, case):
    _, trace = trace_file
    mutate, expected = MALFORMED[case]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_mutated(trace, mutate)))
    env = dict(os.environ, CAPUCHIN_TF_PURE="1")
    proc = subprocess.run([sys.executable, "-m", "capuchin_tf", "plan", "--trace", str(bad), "--budget-mb", "45",
                           "--policy", "capuchin", "--link", "p100", "--json", str(tmp_path / "plan.json")],
                          capture_output=True, text=True, env=env, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, expected)


def test_every_size_on_the_command_line_takes_the_decorators_syntax_too(trace_file, capsys):
    """One syntax: `--budget-mb 45` and `--budget-mb 45MiB` are the same budget; `0.5GiB` is 512 MiB."""
    path, _ = trace_file
    outs = []
    for text in ("45", "45MiB", "46080KiB"):
        code, out, err = run(capsys, "plan", "--trace", str(path), "--budget-mb", text, "--policy", "tf")
        assert code == 0, err
        outs.append(out)
    assert outs[0] == outs[1] == outs[2]
    from capuchin_tf.cli.common import whole_mib

    assert whole_mib("0.5GiB") == 512 and whole_mib("300") == 300
    with pytest.raises(argparse.ArgumentTypeError, match="whole number of MiB"):
        whole_mib("1.5MiB")


def test_the_worker_subcommands_are_not_listed(capsys):
    from capuchin_tf.cli.main import build_parser
    from capuchin_tf.cli.main import main as run_main

    assert run_main([]) == 2
    listed = capsys.readouterr().err
    assert "bench-worker" not in listed and "profile-worker" not in listed and "SUPPRESS" not in listed
    assert "plan" in listed and "bench" in listed
    assert build_parser() is not None


def test_a_timed_run_the_hypervisor_took_cores_from_is_run_again_and_the_quietest_kept(monkeypatch):
    from capuchin_tf.cli import bench

    shares = iter([0.16, 0.05, 0.01, 0.2])
    calls = []

    def fake_worker(subcommand, args, limit_mb, timeout=None):
        calls.append(args)
        share = next(shares)
        return {"ok": True, "steal_share": share, "median_step_s": 1 + share, "settled_median_step_s": 1 + share}

    monkeypatch.setattr(bench, "run_worker", fake_worker)
    said = []
    kept = bench.timed_worker(["--model", "mlp"], 64, echo=said.append)
    assert len(calls) == 3 and kept["steal_share"] == 0.01  # stopped at the first run under STEAL_LIMIT
    assert [r["steal_share"] for r in kept["steal_runs"]] == [0.16, 0.05, 0.01]
    assert [r["kept"] for r in kept["steal_runs"]] == [False, False, True] and len(said) == 2

    # never more than STEAL_RERUNS more runs: the one that lost least is kept
    shares = iter([0.2, 0.08, 0.3, 0.01])
    calls.clear()
    kept = bench.timed_worker([], 64, echo=said.append)
    assert len(calls) == 1 + bench.STEAL_RERUNS and kept["steal_share"] == 0.08

    # a failed run is not a noisy one: no second run; a machine that does not say (None) neither
    for first in ({"ok": False, "steal_share": 0.5}, {"ok": True, "steal_share": None}):
        monkeypatch.setattr(bench, "run_worker", lambda *a, first=first, **k: dict(first))
        kept = bench.timed_worker([], 64, echo=said.append)
        assert len(kept["steal_runs"]) == 1 and kept["steal_runs"][0]["kept"]


def test_steal_share_leaves_out_the_measured_step_and_the_curve_step():
    from capuchin_tf.cli import bench

    r = {"step_s": [9.0, 1.0, 1.0, 1.0], "step_steal_s": [5.0, 0.0, 0.2, 4.0], "curve_step": 3}
    assert bench.steal_share(r) == pytest.approx(0.2 / (2.0 * (os.cpu_count() or 1)))
    assert bench.steal_share({"step_s": [1.0, 1.0], "step_steal_s": []}) is None  # the kernel did not say
    assert common.steal_s() is None or common.steal_s() >= 0
