"""Shim for @rules_cc//cc:defs.bzl (see ../../README.md).

Bazel 4's @bazel_tools loads this file even for Python-only builds, and the
real rules_cc can't be downloaded here. It defines the macros @bazel_tools
loads from it, each forwarding to Bazel 4's built-in rule of the same name
(as the real file does for Bazel 4).
"""

def cc_binary(**attrs):
    native.cc_binary(**attrs)

def cc_library(**attrs):
    native.cc_library(**attrs)

def cc_proto_library(**attrs):
    native.cc_proto_library(**attrs)

def cc_test(**attrs):
    native.cc_test(**attrs)

def cc_toolchain(**attrs):
    native.cc_toolchain(**attrs)

def cc_toolchain_suite(**attrs):
    native.cc_toolchain_suite(**attrs)

def objc_library(**attrs):
    native.objc_library(**attrs)
