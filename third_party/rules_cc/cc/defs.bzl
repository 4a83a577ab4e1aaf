"""Offline stand-in for @rules_cc//cc:defs.bzl.

Bazel 4.2's own @bazel_tools BUILD files load C++ rules from @rules_cc, which its built-in WORKSPACE suffix would
download. Every rule here simply forwards to the native rule built into Bazel 4.2, which is all that version of
rules_cc did too. (Debian's bazel-rules-cc package is a newer rules_cc that Bazel 4.2.3 cannot load.)
"""

cc_binary = native.cc_binary
cc_import = native.cc_import
cc_library = native.cc_library
cc_proto_library = native.cc_proto_library
cc_test = native.cc_test
cc_toolchain = native.cc_toolchain
cc_toolchain_suite = native.cc_toolchain_suite
fdo_prefetch_hints = native.fdo_prefetch_hints
fdo_profile = native.fdo_profile
objc_import = native.objc_import
objc_library = native.objc_library
