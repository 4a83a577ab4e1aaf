"""``python -m capuchin_tf plan``: summary, plan file, clear errors."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from capuchin_tf import cli, synthetic

MiB = 1 << 20


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    trace = synthetic.transformer(2)
    path = tmp_path_factory.mktemp("traces") / "t.json"
    trace.save(path)
    return path, trace


def run(capsys, *argv):
    code = cli.main(list(argv))
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
    assert code == 2 and "non-negative" in err
    code, _, err = run(capsys, "plan", "--trace", str(path), "--budget-mb", "lots")
    assert code == 2 and "number of MiB" in err
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

    cli.register_subcommand("test-bench", add, run_it, help="a test subcommand")
    try:
        assert cli.main(["test-bench", "--model", "mlp"]) == 3 and seen == {"model": "mlp"}
        with pytest.raises(ValueError):
            cli.register_subcommand("test-bench", add, run_it)
    finally:
        del cli.SUBCOMMANDS["test-bench"]


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
