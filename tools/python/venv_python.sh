#!/bin/sh
# Bazel's Python interpreter (tools/python/BUILD): runs this checkout's
# .venv/bin/python with the given arguments.
#
# Bazel calls this script through a symlink in a runfiles tree; the symlinks
# lead back to the source tree, so the real path of this file locates the
# checkout and its .venv. The venv is not a Bazel input: after reinstalling
# it, rerun tests with --nocache_test_results.
set -eu
here=$(dirname "$(readlink -f "$0")")
root=$(cd "$here/../.." && pwd)
python="$root/.venv/bin/python"
if [ ! -x "$python" ]; then
  echo "estimator_towers: Bazel's Python is $python, which does not exist." >&2
  echo "Create the venv first (README.md), in $root:" >&2
  echo "  python3 -m venv .venv && .venv/bin/pip install -e '.[test]'" >&2
  exit 1
fi
exec "$python" "$@"
