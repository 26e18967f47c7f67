"""Shim for @rules_java//java:defs.bzl (see ../../README.md).

Bazel 4's @bazel_tools loads this file even for Python-only builds, and the
real rules_java can't be downloaded here. It defines the macros @bazel_tools
loads from it, each forwarding to Bazel 4's built-in rule of the same name
(as the real file does for Bazel 4).
"""

def java_binary(**attrs):
    native.java_binary(**attrs)

def java_import(**attrs):
    native.java_import(**attrs)

def java_library(**attrs):
    native.java_library(**attrs)

def java_proto_library(**attrs):
    native.java_proto_library(**attrs)

def java_runtime(**attrs):
    native.java_runtime(**attrs)

def java_toolchain(**attrs):
    native.java_toolchain(**attrs)
