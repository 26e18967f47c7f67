"""Bazel entry point: runs pytest on the test files given as arguments.

py_test targets in BUILD run this with their test module's path. The runfiles
tree is read-only, so pytest's cache is off; Bazel's XML_OUTPUT_FILE, when set,
gets a JUnit report.
"""

import os
import sys

import pytest

if __name__ == '__main__':
  args = ['-q', '-p', 'no:cacheprovider']
  if os.environ.get('XML_OUTPUT_FILE'):
    args.append('--junitxml=' + os.environ['XML_OUTPUT_FILE'])
  sys.exit(pytest.main(args + sys.argv[1:]))
