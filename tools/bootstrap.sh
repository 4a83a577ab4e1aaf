#!/usr/bin/env bash
# Sets up everything capuchin_tf needs on a fresh Debian 12 machine with Python 3.11, then runs the demo or the tests.
#
#   bash tools/bootstrap.sh demo     # set up, then run the demo (examples/train_under_budget.py)
#   bash tools/bootstrap.sh test     # set up, then run the test suite
#   bash tools/bootstrap.sh setup    # set up only
#
# Idempotent: every step is skipped or incremental when already done.
#   1. a virtual environment at .venv with TensorFlow (tensorflow-cpu 2.21) and the test tools;
#   2. Bazel (Debian's bazel-bootstrap 4.2.3) via apt when missing and we are root on Debian;
#   3. configure.py (writes .bazelrc from tf.sysconfig), bazel build of the op library and the wheel,
#      the wheel installed into .venv.
# Without Bazel (no root, not Debian) it builds with setup.py and the system compiler instead, and says so.
# Environment: PYTHON (default python3.11, else python3) picks the interpreter for the virtual environment;
# CAPUCHIN_TF_NO_BAZEL=1 forces the setup.py build.
set -euo pipefail

action="${1:-setup}"
case "$action" in
  demo|test|setup) ;;
  *) echo "usage: bash tools/bootstrap.sh [demo|test|setup]" >&2; exit 2 ;;
esac

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
py="$venv/bin/python"
say() { printf '\n==> %s\n' "$*"; }

# --- 1. Python environment -------------------------------------------------------------------------------------
if [ ! -x "$py" ]; then
  base="${PYTHON:-}"
  if [ -z "$base" ]; then base="$(command -v python3.11 || command -v python3 || true)"; fi
  [ -n "$base" ] || { echo "error: no python3 found; install Python 3.11 (apt-get install python3 python3-venv)" >&2; exit 1; }
  say "creating the virtual environment .venv with $base"
  if ! "$base" -m venv "$venv" 2>/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get update -q && apt-get install -y -q python3-venv
      rm -rf "$venv"; "$base" -m venv "$venv"
    else
      echo "error: '$base -m venv' failed; install python3-venv" >&2; exit 1
    fi
  fi
fi
requirements="$root/tools/requirements-dev.txt"
stamp="$venv/.capuchin-requirements.sha256"
want="$(sha256sum "$requirements" | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing Python packages (tools/requirements-dev.txt) into .venv"
  "$py" -m pip install -q --upgrade pip
  "$py" -m pip install -q -r "$requirements"
  echo "$want" > "$stamp"
else
  say "Python packages already installed"
fi

# --- 2. Bazel --------------------------------------------------------------------------------------------------
use_bazel=1
if [ "${CAPUCHIN_TF_NO_BAZEL:-0}" = 1 ]; then
  use_bazel=0
  say "CAPUCHIN_TF_NO_BAZEL=1: building with setup.py instead of Bazel"
elif ! command -v bazel >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && grep -qi debian /etc/os-release 2>/dev/null; then
    say "installing Bazel (Debian's bazel-bootstrap) with apt"
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q bazel-bootstrap
  else
    use_bazel=0
    say "Bazel is not installed and cannot be installed here (needs root on Debian): building with setup.py instead"
  fi
fi

# --- 3. Build and install --------------------------------------------------------------------------------------
if [ "$use_bazel" = 1 ]; then
  say "configuring the Bazel build from tf.sysconfig"
  "$py" configure.py
  say "bazel build //cc:_capuchin_ops.so //:build_pip_pkg"
  bazel build //cc:_capuchin_ops.so //:build_pip_pkg
  say "building the wheel into dist/ and installing it into .venv"
  rm -rf "$root/dist"
  bazel-bin/build_pip_pkg "$root/dist"
  "$py" -m pip install -q --force-reinstall --no-deps "$root"/dist/capuchin_tf-*.whl
else
  say "building the op library in place with setup.py (system compiler, tf.sysconfig flags)"
  "$py" setup.py -q build_ext --inplace
  "$py" -m pip install -q --no-build-isolation --no-deps "$root"
fi

# --- 4. Run ----------------------------------------------------------------------------------------------------
case "$action" in
  demo)
    say "running the demo"
    exec "$py" examples/train_under_budget.py
    ;;
  test)
    say "running the tests"
    exec "$py" -m pytest tests -n 2 --durations=25
    ;;
  setup)
    say "set-up done: activate with 'source .venv/bin/activate'"
    ;;
esac
