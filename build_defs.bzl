"""The one Bazel macro of capuchin_tf: a TensorFlow custom-op shared library.

Every compiler and linker flag lives here, so BUILD files list sources only. The flags that must match the installed
TensorFlow (C++ standard, -D_GLIBCXX_USE_CXX11_ABI, TF's other -D flags) come from the `--cxxopt`/`--copt` lines
that configure.py writes into .bazelrc, read from tf.sysconfig; setup.py's Bazel-free build uses the same flags.
"""

# -w: TensorFlow's headers trigger thousands of deprecation warnings with g++ 12.
_COPTS = [
    "-fPIC",
    "-O2",
    "-DNDEBUG",  # as TensorFlow's own wheel is built (debug checks in its inline headers off)
    "-w",
    "-pthread",
    "-DEIGEN_MAX_ALIGN_BYTES=64",
]

_LINKOPTS = ["-pthread"]

def custom_op_library(name, srcs, hdrs = [], deps = [], **kwargs):
    """A shared library `name` (e.g. "_foo_ops.so") of TensorFlow ops and kernels, for tf.load_op_library.

    Args:
      name: the file name of the library; end it in ".so".
      srcs: C++ sources (REGISTER_OP, kernels).
      hdrs: the headers of those sources.
      deps: more cc_library dependencies; TensorFlow's headers and framework library are always added.
      **kwargs: passed to cc_binary (visibility, tags, ...).
    """
    # Sources may include their headers from the repository root ("cc/kernels/x.h"), from this package
    # ("kernels/x.h") or from their own directory (setup.py's g++ build allows the same).
    package_include = ["-I" + native.package_name()] if native.package_name() else []
    native.cc_binary(
        name = name,
        srcs = srcs + hdrs,
        copts = _COPTS + package_include,
        linkopts = _LINKOPTS,
        linkshared = 1,
        deps = deps + [
            "@local_config_tf//:tf_header_lib",
            "@local_config_tf//:libtensorflow_framework",
        ],
        **kwargs
    )
