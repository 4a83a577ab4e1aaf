"""Finds and loads the op library `_capuchin_ops.so`, once per process.

The library must load before TensorFlow creates its devices: loading it registers capuchin_tf's "CPU" device
factory, whose devices allocate through capuchin_tf's allocator wrapper (tf-notes.md). That is why `capuchin_tf`
loads it at import rather than lazily. If TensorFlow had already created its devices, the ops still work but the
wrapper is not installed; the loader says so once, clearly.
"""

from __future__ import annotations

import os
import pathlib
import warnings

import tensorflow as tf

# The op library is compiled against one TensorFlow minor version's C++ ABI.
SUPPORTED_TF = ((2, 21), (2, 22))  # [min, max)
LIBRARY_NAME = "_capuchin_ops.so"
LIBRARY_ENV = "CAPUCHIN_TF_OPS_LIBRARY"

_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent  # capuchin_tf/
_REPO_DIR = _PACKAGE_DIR.parent

_module = None
_path: pathlib.Path | None = None
_loaded_late = False


class ImportedTooLateWarning(UserWarning):
    """capuchin_tf was imported after TensorFlow had created its devices."""


def _version_tuple(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def check_tensorflow_version(version: str | None = None) -> None:
    """Raises ImportError unless `version` (default: the running TensorFlow's) is in the supported range."""
    version = tf.__version__ if version is None else version
    lo, hi = SUPPORTED_TF
    if not lo <= _version_tuple(version) < hi:
        raise ImportError(
            f"capuchin_tf supports TensorFlow >={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]} (its op library is compiled "
            f"against that version's C++ ABI), but TensorFlow {version} is installed. "
            f"Install a supported version, e.g. pip install 'tensorflow-cpu=={lo[0]}.{lo[1]}.*'."
        )


def candidate_paths() -> list[pathlib.Path]:
    """Where the library is looked for, in order: $CAPUCHIN_TF_OPS_LIBRARY, the installed package, bazel-bin/."""
    paths = []
    if os.environ.get(LIBRARY_ENV):
        paths.append(pathlib.Path(os.environ[LIBRARY_ENV]))
    paths.append(_PACKAGE_DIR / LIBRARY_NAME)
    paths.append(_REPO_DIR / "bazel-bin" / "cc" / LIBRARY_NAME)
    return paths


def _devices_already_created() -> bool:
    from tensorflow.python.eager import context  # private, but the only way to ask without creating the devices

    ctx = context.context()
    return getattr(ctx, "_context_handle", None) is not None


def load():
    """Loads the op library (once) and returns the module of generated op wrappers."""
    global _module, _path, _loaded_late
    if _module is not None:
        return _module
    check_tensorflow_version()
    found = [p for p in candidate_paths() if p.is_file()]
    if not found:
        where = "\n  ".join(str(p) for p in candidate_paths())
        raise ImportError(
            f"capuchin_tf's op library {LIBRARY_NAME} was not found. Looked in:\n  {where}\n"
            "Build it with `python configure.py && bazel build //cc:_capuchin_ops.so` (development) or install "
            "the package with `pip install --no-build-isolation .` or the Bazel-built wheel."
        )
    _loaded_late = _devices_already_created()
    _path = found[0]
    _module = tf.load_op_library(str(_path))
    if _loaded_late:
        warnings.warn(
            "capuchin_tf was imported after TensorFlow had created its devices, so its allocator wrapper is not "
            "installed: swap ops work, but allocation tracking and passive eviction do not. Import capuchin_tf "
            "before running any TensorFlow op (right after `import tensorflow`).",
            ImportedTooLateWarning,
            stacklevel=3,
        )
    return _module


def library_path() -> pathlib.Path | None:
    """The file the op library was loaded from (None before loading)."""
    return _path


def loaded_too_late() -> bool:
    """True when TensorFlow had created its devices before the library was loaded."""
    return _loaded_late
