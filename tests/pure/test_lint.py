"""The code passes its linter: `ruff check .` with the repository's ruff.toml (pyflakes, pycodestyle, import order,
pyupgrade). tools/requirements-dev.txt pins the ruff the set-up installs."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _ruff() -> str | None:
    here = pathlib.Path(sys.executable).parent / "ruff"
    return str(here) if here.exists() else shutil.which("ruff")


@pytest.mark.skipif(_ruff() is None, reason="ruff is not installed (tools/requirements-dev.txt installs it)")
def test_ruff_finds_nothing():
    proc = subprocess.run([_ruff(), "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, NO_COLOR="1"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
