#!/usr/bin/env bash
# Builds the capuchin_tf wheel from the Bazel-built op library: copies the package, setup.py and
# _capuchin_ops.so into a temporary directory and runs `setup.py bdist_wheel` there with CAPUCHIN_PREBUILT_SO set,
# so that setup.py ships this library instead of compiling the sources again.
#
# Usage: bazel build //:build_pip_pkg && bazel-bin/build_pip_pkg OUTDIR
#    or: bazel run //:build_pip_pkg -- OUTDIR
set -euo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 OUTDIR" >&2
  exit 2
fi

# A relative OUTDIR is relative to where the command was typed (`bazel run` changes into the runfiles tree).
outdir=$1
if [[ "${outdir}" != /* ]]; then
  outdir="${BUILD_WORKING_DIRECTORY:-${PWD}}/${outdir}"
fi
mkdir -p "${outdir}"
outdir=$(cd "${outdir}" && pwd)

# The runfiles of this sh_binary: next to the script when run from bazel-bin/, the working directory under
# `bazel run`. The main repository is named capuchin_tf (WORKSPACE).
if [[ -d "$0.runfiles/capuchin_tf" ]]; then
  src="$0.runfiles/capuchin_tf"
else
  src="${PWD}"
fi
if [[ ! -f "${src}/cc/_capuchin_ops.so" ]]; then
  echo "build_pip_pkg: no cc/_capuchin_ops.so in ${src}; run it as bazel-bin/build_pip_pkg after bazel build." >&2
  exit 1
fi

# The Python that configure.py ran with, unless PYTHON_BIN_PATH says otherwise.
python=${PYTHON_BIN_PATH:-}
if [[ -z "${python}" && -s "${src}/python_bin_path.txt" ]]; then
  python=$(cat "${src}/python_bin_path.txt")
fi
python=${python:-python3}

tmp=$(mktemp -d -t capuchin_pip_pkg.XXXXXX)
trap 'rm -rf "${tmp}"' EXIT

# cp -L: the runfiles are symlinks; the build directory holds real files.
cp -L "${src}/setup.py" "${tmp}/"
for f in README.md LICENSE; do
  if [[ -e "${src}/${f}" ]]; then cp -L "${src}/${f}" "${tmp}/"; fi
done
cp -RL "${src}/capuchin_tf" "${tmp}/"
cp -L "${src}/cc/_capuchin_ops.so" "${tmp}/_capuchin_ops.so"

echo "build_pip_pkg: building the wheel with ${python} in ${tmp}"
(
  cd "${tmp}"
  CAPUCHIN_PREBUILT_SO="${tmp}/_capuchin_ops.so" "${python}" setup.py -q bdist_wheel --dist-dir "${outdir}"
)
echo "build_pip_pkg: wrote $(ls -t "${outdir}"/capuchin_tf-*.whl | head -n 1)"
