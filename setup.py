"""capuchin_tf: Capuchin-style memory management (swapping and recomputation) for TensorFlow 2.

The package ships one native library, capuchin_tf/_capuchin_ops.so (custom ops, kernels and an allocator wrapper),
loaded with tf.load_op_library. It is built in one of two ways:

(a) from Bazel: `bazel-bin/build_pip_pkg OUTDIR` sets CAPUCHIN_PREBUILT_SO to the Bazel-built library, which is
    copied into the wheel as is;
(b) without Bazel: `pip install --no-build-isolation .` (or `python setup.py build_ext --inplace` for development)
    compiles the sources listed in cc/sources.bzl, the same list Bazel builds, with g++ and tf.sysconfig's flags.

Either way the wheel is a platform wheel, and the library matches the TensorFlow that was installed at build time
(same C++ ABI and version): build it against the TensorFlow you will run it with.
"""

import concurrent.futures
import os
import re
import shutil
import subprocess
import sys

from setuptools import Distribution, Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
PACKAGE = "capuchin_tf"
LIBRARY = PACKAGE + "._capuchin_ops"  # -> capuchin_tf/_capuchin_ops.so
PREBUILT_ENV = "CAPUCHIN_PREBUILT_SO"

# Flags beyond tf.sysconfig.get_compile_flags(); keep in sync with build_defs.bzl.
# -w: TensorFlow's headers trigger thousands of deprecation warnings with g++ 12.
# -DNDEBUG: as TensorFlow's own wheel is built (debug checks in its inline headers off).
EXTRA_COMPILE_FLAGS = ["-O2", "-DNDEBUG", "-fPIC", "-w", "-pthread", "-DEIGEN_MAX_ALIGN_BYTES=64"]
EXTRA_LINK_FLAGS = ["-shared", "-pthread"]


def read_version():
    with open(os.path.join(ROOT, PACKAGE, "_version.py")) as f:
        match = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", f.read(), re.M)
    if not match:
        sys.exit(f"setup.py: no __version__ in {PACKAGE}/_version.py")
    return match.group(1)


def read_sources():
    """The C++ sources and headers from cc/sources.bzl (plain Python list literals), as paths from ROOT."""
    path = os.path.join(ROOT, "cc", "sources.bzl")
    if not os.path.exists(path):
        sys.exit(f"setup.py: {path} is missing; build from a source checkout or an sdist.")
    scope = {}
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), scope)
    srcs = [os.path.join("cc", p) for p in scope["CAPUCHIN_OPS_SRCS"]]
    hdrs = [os.path.join("cc", p) for p in scope["CAPUCHIN_OPS_HDRS"]]
    return srcs, hdrs


def tf_flags():
    """tf.sysconfig's compile and link flags; TensorFlow must be importable while building."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    try:
        import tensorflow as tf
    except ImportError as e:
        sys.exit(
            f"setup.py: capuchin_tf compiles its op library against the installed TensorFlow, but "
            f"`import tensorflow` failed in {sys.executable} ({e}). Install TensorFlow (e.g. tensorflow-cpu) and "
            f"build without pip's isolated build environment: `pip install --no-build-isolation .`. Or build the "
            f"wheel with Bazel (bazel-bin/build_pip_pkg), which sets {PREBUILT_ENV}."
        )
    return tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags()


class BuildOpLibrary(build_ext):
    """Builds capuchin_tf/_capuchin_ops.so: copies $CAPUCHIN_PREBUILT_SO, or compiles cc/ with g++."""

    def get_ext_filename(self, ext_name):
        # Exactly "_capuchin_ops.so", without a "cpython-311-x86_64-linux-gnu" tag: the library is loaded with
        # tf.load_op_library, not imported, and Bazel builds the same name.
        return os.path.join(*ext_name.split(".")) + ".so"

    def build_extension(self, ext):
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        prebuilt = os.environ.get(PREBUILT_ENV)
        if prebuilt:
            if not os.path.isfile(prebuilt):
                raise RuntimeError(f"{PREBUILT_ENV}={prebuilt} is not a file")
            print(f"setup.py: using the prebuilt op library {prebuilt}")
            shutil.copyfile(prebuilt, target)
        else:
            self._compile(ext, target)

    def _compile(self, ext, target):
        compile_flags, link_flags = tf_flags()
        cxx = os.environ.get("CXX", "g++")
        # Sources may include their headers relative to the repository root ("cc/kernels/x.h"), to cc/
        # ("kernels/x.h") or to their own directory, as in the Bazel build.
        includes = ["-I" + ROOT, "-I" + os.path.join(ROOT, "cc")]
        obj_dir = os.path.join(os.path.abspath(self.build_temp), "capuchin_ops")
        os.makedirs(obj_dir, exist_ok=True)

        def compile_one(src):
            obj = os.path.join(obj_dir, os.path.splitext(src)[0].replace(os.sep, "_") + ".o")
            cmd = [cxx, "-c", os.path.join(ROOT, src), "-o", obj] + includes + compile_flags + EXTRA_COMPILE_FLAGS
            print("setup.py: " + " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
            return obj

        # One g++ per source, as many at a time as there are cores (TensorFlow's headers make each one slow).
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            objects = list(pool.map(compile_one, ext.sources))
        cmd = [cxx] + objects + ["-o", target] + EXTRA_LINK_FLAGS + link_flags
        print("setup.py: " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)


class BinaryDistribution(Distribution):
    """Always a platform wheel (cp311-cp311-linux_x86_64): the package ships a native library."""

    def has_ext_modules(self):
        return True


def read_long_description():
    path = os.path.join(ROOT, "README.md")
    if not os.path.exists(path):
        return __doc__, "text/plain"
    with open(path) as f:
        return f.read(), "text/markdown"


def op_library_extension():
    if os.environ.get(PREBUILT_ENV):
        return Extension(LIBRARY, sources=[])  # nothing to compile: build_extension copies the file
    srcs, hdrs = read_sources()
    return Extension(LIBRARY, sources=srcs, depends=hdrs)


long_description, long_description_type = read_long_description()

setup(
    name="capuchin_tf",
    version=read_version(),
    description="Capuchin-style tensor swapping and recomputation for TensorFlow 2 training",
    long_description=long_description,
    long_description_content_type=long_description_type,
    packages=find_packages(include=[PACKAGE, PACKAGE + ".*"]),
    python_requires=">=3.10",
    # No hard TensorFlow requirement: a pin such as tensorflow-cpu>=2.21,<2.22 would fight the full `tensorflow`
    # wheel that GPU users have. The op library must match the TensorFlow it was built against (see the top).
    install_requires=["numpy", "absl-py"],
    extras_require={
        "test": ["pytest", "hypothesis"],
        "plot": ["matplotlib"],
        # keras-hub (BertBackbone) must be installed separately with `pip install --no-deps keras-hub` plus its
        # pure-Python needs: its regular dependencies pull tensorflow-text and with it the full (CUDA) tensorflow.
        "bert": [],
    },
    ext_modules=[op_library_extension()],
    cmdclass={"build_ext": BuildOpLibrary},
    distclass=BinaryDistribution,
    zip_safe=False,
)
