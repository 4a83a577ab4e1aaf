"""The Bazel-built wheel installs into a fresh virtual environment with TensorFlow and loads the ops there.

Needs a wheel in dist/ (tools/bootstrap.sh builds one with `bazel-bin/build_pip_pkg dist/`); skipped otherwise, e.g.
on machines without Bazel where the set-up builds with setup.py.
"""

import json
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
WHEELS = sorted((REPO / "dist").glob("capuchin_tf-*.whl"))

CHECK = """
import json, os, pathlib, sys
import tensorflow as tf
import capuchin_tf
x = tf.random.stateless_uniform([1000], seed=[1, 2])
y = capuchin_tf.swap_in(capuchin_tf.swap_out(x), tf.float32, [1000])
print(json.dumps({
    "package": str(pathlib.Path(capuchin_tf.__file__).parent),
    "library": str(capuchin_tf.tf.loader.library_path()),
    "wrapped": capuchin_tf.allocator_stats()["wrapped"],
    "bytes_limit": capuchin_tf.allocator_stats()["bytes_limit"],
    "round_trip": bool(tf.reduce_all(x == y)),
    "tf": tf.__version__,
}))
"""


@pytest.mark.skipif(not WHEELS, reason="no wheel in dist/: build one with tools/bootstrap.sh (needs Bazel)")
def test_the_wheel_works_in_a_fresh_virtual_environment(tmp_path):
    wheel = WHEELS[-1]
    assert "linux" in wheel.name, f"a platform wheel is expected, got {wheel.name}"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["tensorflow-cpu==2.21.*", str(wheel)], check=True, timeout=900)
    env = {"PATH": "/usr/bin:/bin", "TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0",
           "TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPU_BFC_MEM_LIMIT_IN_MB": "300"}
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", CHECK], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    site = str(venv / "lib")
    assert result["package"].startswith(site) and result["library"].startswith(site), result
    assert result["wrapped"] and result["round_trip"] and result["bytes_limit"] == 300 << 20
    assert result["tf"].startswith("2.21.")
