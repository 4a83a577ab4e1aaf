#!/bin/sh
echo "bazel coverage is not supported in this offline build (remote_coverage_tools is a stub)" >&2
exit 1
