"""Repository rule `tf_configure`: exposes the pip-installed TensorFlow to Bazel, with no download.

Creates the repository @local_config_tf with
  //:tf_header_lib             the headers of the pip wheel (tensorflow/include: tensorflow/, tsl/, xla/, absl/,
                               Eigen/, unsupported/, google/protobuf/, ...), as a header-only cc_library;
  //:libtensorflow_framework   the wheel's libtensorflow_framework.so.2, to link against.

It is configured by environment variables that `configure.py` writes into `.bazelrc` (as `--repo_env` and
`--action_env`), the idea of tensorflow/custom-op's tf_configure.bzl:
  TF_HEADER_DIR           tf.sysconfig.get_include()
  TF_SHARED_LIBRARY_DIR   tf.sysconfig.get_lib()
  TF_SHARED_LIBRARY_NAME  from tf.sysconfig.get_link_flags(), e.g. libtensorflow_framework.so.2
Unlike the template, it symlinks the directories instead of copying every header through a genrule, and it
hard-codes no C++ standard or ABI flag (those come from .bazelrc too).
"""

_ENV_VARS = ["TF_HEADER_DIR", "TF_SHARED_LIBRARY_DIR", "TF_SHARED_LIBRARY_NAME"]

def _required_env(repository_ctx, name):
    value = repository_ctx.os.environ.get(name, "").strip()
    if not value:
        fail("%s is not set. Run `.venv/bin/python configure.py` first: it writes .bazelrc." % name)
    return value

def _tf_configure_impl(repository_ctx):
    header_dir = _required_env(repository_ctx, "TF_HEADER_DIR")
    lib_dir = _required_env(repository_ctx, "TF_SHARED_LIBRARY_DIR")
    lib_name = _required_env(repository_ctx, "TF_SHARED_LIBRARY_NAME")

    header_path = repository_ctx.path(header_dir)
    lib_path = repository_ctx.path(lib_dir + "/" + lib_name)
    if not header_path.get_child("tensorflow").exists:
        fail("TF_HEADER_DIR=%s holds no tensorflow/ headers; rerun configure.py." % header_dir)
    if not lib_path.exists:
        fail("%s does not exist; rerun configure.py." % lib_path)

    repository_ctx.symlink(header_path, "include")
    repository_ctx.symlink(lib_path, lib_name)
    repository_ctx.template(
        "BUILD",
        Label("//third_party/tf:BUILD.tpl"),
        {"%{TF_SHARED_LIBRARY_NAME}": lib_name},
    )

tf_configure = repository_rule(
    implementation = _tf_configure_impl,
    environ = _ENV_VARS,  # re-run the rule when configure.py changes them
    local = True,  # depends on files outside Bazel's view: always re-evaluate on a new server
)
