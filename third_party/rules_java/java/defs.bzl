"""Offline stand-in for @rules_java//java:defs.bzl.

Bazel 4.2's @bazel_tools//tools/jdk BUILD files (loaded for any build, even one without Java) load Java rules from
@rules_java, which the built-in WORKSPACE suffix would download. Every rule here forwards to Bazel's native rule.
"""

java_binary = native.java_binary
java_import = native.java_import
java_library = native.java_library
java_lite_proto_library = native.java_lite_proto_library
java_package_configuration = native.java_package_configuration
java_plugin = native.java_plugin
java_proto_library = native.java_proto_library
java_runtime = native.java_runtime
java_test = native.java_test
java_toolchain = native.java_toolchain
