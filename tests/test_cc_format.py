"""cc/ is formatted as /.clang-format says (Google style, 120 columns), when clang-format is installed."""

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _clang_format():
    # The venv's (pip install clang-format) first, then the system's.
    venv = pathlib.Path(sys.executable).parent / "clang-format"
    return str(venv) if venv.is_file() else shutil.which("clang-format")


def test_cc_sources_are_clang_formatted():
    exe = _clang_format()
    if exe is None:
        pytest.skip("clang-format is not installed")
    sources = sorted(str(p) for p in (ROOT / "cc").rglob("*") if p.suffix in (".cc", ".h"))
    assert sources
    done = subprocess.run([exe, "--dry-run", "--Werror", "--style=file", *sources], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"run `{exe} -i` on the files named below:\n{done.stderr[-5000:]}"
