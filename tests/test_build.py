"""BUILD covers the sources: a py_test per test module, a py_binary per script.

BUILD is Starlark, whose syntax is Python's. The check runs BUILD in Python,
recording each rule call, with its own glob() over the files on disk, so it sees
what BUILD's globs and comprehensions really yield (without Bazel, which a
plain `pytest` run needn't have). References: the files on disk, listed with
os.walk, and BUILD texts written here with a module or script left out.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import fnmatch
import os
import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = 'tests/bazel_pytest.py'
SCRIPT_DIRS = ('examples', 'bench')
BUILD_FILES = ('BUILD', 'BUILD.bazel')


@dataclasses.dataclass
class Rule:
  kind: str
  attrs: dict


def source_files(root: str) -> list[str]:
  """Every file under root, as sorted '/'-separated relative paths."""
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if not d.startswith(('.', 'bazel-'))]
    rel = os.path.relpath(dirpath, root)
    for name in filenames:
      found.append(name if rel == '.' else f'{rel}/{name}'.replace(os.sep, '/'))
  return sorted(found)


def _segments_match(pattern: list[str], path: list[str]) -> bool:
  """Bazel glob matching: '*' stays within a segment, '**' spans segments."""
  if not pattern:
    return not path
  if pattern[0] == '**':
    return any(_segments_match(pattern[1:], path[i:]) for i in range(len(path) + 1))
  return bool(path) and fnmatch.fnmatchcase(path[0], pattern[0]) and _segments_match(
      pattern[1:], path[1:])


def make_glob(root: str):
  """Bazel's glob() for the top-level package at root (subpackages excluded)."""
  files = source_files(root)
  subpackages = {os.path.dirname(f) for f in files
                 if os.path.basename(f) in BUILD_FILES and '/' in f}

  def in_subpackage(path: str) -> bool:
    parent = os.path.dirname(path)
    while parent:
      if parent in subpackages:
        return True
      parent = os.path.dirname(parent)
    return False

  def glob(include, exclude=(), exclude_directories=1, allow_empty=True):
    del exclude_directories, allow_empty  # Files only; an empty result is allowed.
    def matches(path, patterns):
      return any(_segments_match(p.split('/'), path.split('/')) for p in patterns)
    return [f for f in files
            if matches(f, include) and not matches(f, exclude) and not in_subpackage(f)]
  return glob


def evaluate_build(root: str) -> list[Rule]:
  """The rules root/BUILD declares, after its globs and comprehensions run."""
  with open(os.path.join(root, 'BUILD'), encoding='utf-8') as f:
    text = f.read()
  tree = ast.parse(text, filename='BUILD')
  rules = []

  def recorder(kind):
    def record(*args, **attrs):
      rules.append(Rule(kind, dict(attrs, _args=args)))
    return record

  namespace = {'glob': make_glob(root), 'load': lambda *args, **kw: None}
  called = {node.func.id for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
  for name in called - set(namespace) - set(dir(builtins)):  # Rules and macros.
    namespace[name] = recorder(name)
  exec(compile(tree, 'BUILD', 'exec'), namespace)  # pylint: disable=exec-used
  return rules


def _label_to_path(label: str) -> str:
  """'//:a/b.py', ':a/b.py' or 'a/b.py' in the top-level package -> 'a/b.py'."""
  for prefix in ('//:', ':'):
    if label.startswith(prefix):
      return label[len(prefix):]
  return label


def transitive_srcs(rule: Rule, by_name: dict[str, Rule],
                    _seen: dict[str, set[str]] | None = None) -> set[str]:
  """Source paths of rule and its same-package deps.

  Each rule's set is computed once (_seen): the stage libraries share deps, and
  walking every path of that diamond-shaped graph is exponential.
  """
  seen = {} if _seen is None else _seen
  key = rule.attrs.get('name')
  if key in seen:
    return seen[key]
  srcs = {_label_to_path(s) for s in rule.attrs.get('srcs', [])}
  for dep in rule.attrs.get('deps', []):
    name = _label_to_path(dep)
    if name in by_name:
      srcs |= transitive_srcs(by_name[name], by_name, seen)
  if key is not None:
    seen[key] = srcs
  return srcs


def main_of(rule: Rule) -> str | None:
  """The main file: `main`, else the src named after the rule (Bazel's default)."""
  if 'main' in rule.attrs:
    return _label_to_path(rule.attrs['main'])
  default = [s for s in map(_label_to_path, rule.attrs.get('srcs', []))
             if os.path.basename(s) == rule.attrs.get('name') + '.py']
  return default[0] if len(default) == 1 else None


def is_script(path: str) -> bool:
  with open(path, encoding='utf-8') as f:
    return "__name__ == '__main__'" in f.read()


def coverage_problems(root: str) -> list[str]:
  """What BUILD at root fails to cover; empty when every module and script is.

  Every tests/test_*.py needs a py_test that has it in srcs and runs it under
  pytest (main tests/bazel_pytest.py, args '$(location <module>)'): a test
  module run as a plain script would define its tests and pass without running
  them. Every script with a __main__ under examples/ or bench/ needs a
  py_binary with it as main and its directory's .py files in its sources.
  """
  rules = evaluate_build(root)
  by_name = {r.attrs['name']: r for r in rules if 'name' in r.attrs}
  files = source_files(root)
  problems = []

  tests = [r for r in rules if r.kind == 'py_test']
  for module in (f for f in files if fnmatch.fnmatchcase(f, 'tests/test_*.py')):
    targets = [r for r in tests if module in transitive_srcs(r, by_name)]
    if not targets:
      problems.append(f'{module}: no py_test in BUILD has it in srcs; add one.')
      continue
    runs = [r for r in targets
            if main_of(r) == RUNNER
            and f'$(location {module})' in r.attrs.get('args', [])]
    if not runs:
      problems.append(
          f'{module}: py_test {[r.attrs["name"] for r in targets]} does not run it under '
          f'pytest; set main = "{RUNNER}" and args = ["$(location {module})"].')

  binaries = [r for r in rules if r.kind == 'py_binary']
  scripts = [f for f in files
             if f.split('/')[0] in SCRIPT_DIRS and f.endswith('.py')
             and is_script(os.path.join(root, f))]
  for script in scripts:
    mains = [r for r in binaries if main_of(r) == script]
    if not mains:
      problems.append(f'{script}: no py_binary in BUILD has it as main; add one.')
      continue
    siblings = {f for f in files if os.path.dirname(f) == os.path.dirname(script)
                and f.endswith('.py')}
    for binary in mains:
      missing = sorted(siblings - transitive_srcs(binary, by_name))
      if missing:
        problems.append(f'{script}: py_binary {binary.attrs["name"]} lacks {missing} '
                        'from its directory in srcs.')
  return problems


def _sibling_imports(path: str, tests_dir: str) -> set[str]:
  """The tests/*.py files the module at `path` imports by name (`import loop_models`)."""
  with open(path, encoding='utf-8') as f:
    tree = ast.parse(f.read())
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names.update(a.name.split('.')[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      names.add(node.module.split('.')[0])
  return {f'tests/{n}.py' for n in names if os.path.isfile(os.path.join(tests_dir, n + '.py'))}


def import_problems(root: str) -> list[str]:
  """The test helpers a py_test's module imports (directly or through another helper) that
  its target neither has in srcs (its own or its deps') nor in data: Bazel's sandbox holds
  only those, so the import fails there and nowhere else."""
  rules = evaluate_build(root)
  by_name = {r.attrs['name']: r for r in rules if 'name' in r.attrs}
  problems = []
  for rule in (r for r in rules if r.kind == 'py_test'):
    there = transitive_srcs(rule, by_name) | set(rule.attrs.get('data', []))
    todo = sorted(f for f in there if fnmatch.fnmatchcase(f, 'tests/test_*.py')
                  and f in rule.attrs.get('srcs', []))
    seen = set(todo)
    while todo:
      module = todo.pop()
      for helper in sorted(_sibling_imports(os.path.join(root, module),
                                            os.path.join(root, 'tests')) - seen):
        seen.add(helper)
        todo.append(helper)
        if helper not in there:
          problems.append(f'{rule.attrs["name"]}: {module} imports {helper}, which the '
                          'target lacks; add it to testlib\'s srcs, TEST_DATA or IMPORTED_TESTS.')
  return problems


def test_build_covers_every_test_module_and_script():
  assert coverage_problems(ROOT) == []


def test_every_test_helper_a_module_imports_is_in_its_target():
  assert import_problems(ROOT) == []


def test_a_helper_left_out_of_build_fails(tmp_path):
  root = copy_tree(tmp_path)
  edit_build(root, '"tests/test_collective_position.py": ["tests/test_collective.py"],', '')
  assert import_problems(root) == [
      'test_collective_position: tests/test_collective_position.py imports '
      'tests/test_collective.py, which the target lacks; add it to testlib\'s srcs, '
      'TEST_DATA or IMPORTED_TESTS.']


def test_build_has_a_test_per_module_and_a_binary_per_example():
  # The reference is the disk, independent of the checker's rule matching.
  rules = evaluate_build(ROOT)
  modules = [f for f in source_files(ROOT) if fnmatch.fnmatchcase(f, 'tests/test_*.py')]
  assert {'tests/test_towers.py', 'tests/test_build.py'} <= set(modules)
  test_names = sorted(r.attrs['name'] for r in rules if r.kind == 'py_test')
  assert test_names == sorted(os.path.basename(m)[:-3] for m in modules)
  binaries = {r.attrs['name']: r.attrs['main'] for r in rules if r.kind == 'py_binary'}
  assert binaries['cifar10_train'] == 'examples/cifar10/train.py'


# --- The check fails when something is left out. ---

def copy_tree(tmp_path) -> str:
  root = str(tmp_path / 'repo')
  for name in ('BUILD', 'tests', 'examples', 'bench'):
    src = os.path.join(ROOT, name)
    if os.path.isdir(src):
      shutil.copytree(src, os.path.join(root, name),
                      ignore=shutil.ignore_patterns('__pycache__'))
    else:
      os.makedirs(root, exist_ok=True)
      shutil.copy(src, os.path.join(root, name))
  return root


def edit_build(root: str, old: str, new: str) -> None:
  path = os.path.join(root, 'BUILD')
  with open(path, encoding='utf-8') as f:
    text = f.read()
  assert text.count(old) == 1, f'BUILD no longer contains {old!r}; update this test.'
  with open(path, 'w', encoding='utf-8') as f:
    f.write(text.replace(old, new))


def test_real_build_missing_a_module_fails(tmp_path):
  root = copy_tree(tmp_path)
  assert coverage_problems(root) == []
  # The glob comprehension's exclude list drops test_towers.py.
  edit_build(root, 'exclude = ["tests/test_build.py"]',
             'exclude = ["tests/test_build.py", "tests/test_towers.py"]')
  assert coverage_problems(root) == [
      'tests/test_towers.py: no py_test in BUILD has it in srcs; add one.']


def test_real_build_missing_the_example_binary_fails(tmp_path):
  root = copy_tree(tmp_path)
  edit_build(root, 'main = "examples/cifar10/train.py"', 'main = "examples/cifar10/data.py"')
  assert coverage_problems(root) == [
      'examples/cifar10/train.py: no py_binary in BUILD has it as main; add one.']


def write(root, path, text=''):
  full = os.path.join(root, path)
  os.makedirs(os.path.dirname(full) or root, exist_ok=True)
  with open(full, 'w', encoding='utf-8') as f:
    f.write(text)


MAIN = "if __name__ == '__main__':\n  pass\n"


@pytest.mark.parametrize('build, expected', [
    # Explicit targets, one module without one.
    ('py_test(name = "test_a", srcs = ["tests/bazel_pytest.py", "tests/test_a.py"],\n'
     '        main = "tests/bazel_pytest.py", args = ["$(location tests/test_a.py)"])\n',
     ['tests/test_b.py: no py_test in BUILD has it in srcs; add one.']),
    # A glob that misses a module.
    ('[py_test(name = s[6:-3], srcs = ["tests/bazel_pytest.py", s], main = "tests/bazel_pytest.py",\n'
     '         args = ["$(location %s)" % s]) for s in glob(["tests/test_a*.py"])]\n',
     ['tests/test_b.py: no py_test in BUILD has it in srcs; add one.']),
    # Every module has a target, but one runs as a plain script: no tests would run.
    ('[py_test(name = s[6:-3], srcs = ["tests/bazel_pytest.py", s], main = "tests/bazel_pytest.py",\n'
     '         args = ["$(location %s)" % s]) for s in glob(["tests/test_a*.py"])]\n'
     'py_test(name = "test_b", srcs = ["tests/test_b.py"])\n',
     ['tests/test_b.py: py_test [\'test_b\'] does not run it under pytest; '
      'set main = "tests/bazel_pytest.py" and args = ["$(location tests/test_b.py)"].']),
])
def test_synthetic_build_missing_a_test_fails(tmp_path, build, expected):
  root = str(tmp_path)
  for path in ('tests/bazel_pytest.py', 'tests/test_a.py', 'tests/test_b.py', 'tests/testlib.py'):
    write(root, path)
  write(root, 'BUILD', build)
  assert coverage_problems(root) == expected


def test_synthetic_build_missing_an_example_fails(tmp_path):
  root = str(tmp_path)
  write(root, 'examples/one/train.py', MAIN)
  write(root, 'examples/one/model.py')
  write(root, 'examples/two/run.py', MAIN)
  write(root, 'BUILD',
        'py_library(name = "model", srcs = ["examples/one/model.py"])\n'
        'py_binary(name = "one", srcs = ["examples/one/train.py"], deps = [":model"],\n'
        '          main = "examples/one/train.py")\n')
  assert coverage_problems(root) == [
      'examples/two/run.py: no py_binary in BUILD has it as main; add one.']
  # A binary without its directory's other modules can't import them.
  write(root, 'BUILD',
        'py_binary(name = "one", srcs = ["examples/one/train.py"], main = "examples/one/train.py")\n'
        'py_binary(name = "run", srcs = ["examples/two/run.py"])\n')  # Default main.
  assert coverage_problems(root) == [
      "examples/one/train.py: py_binary one lacks ['examples/one/model.py'] from its "
      'directory in srcs.']


def test_glob_follows_bazel_rules(tmp_path):
  root = str(tmp_path)
  for path in ('a.py', 'x/b.py', 'x/y/c.py', 'x/y/d.txt', 'sub/BUILD', 'sub/e.py'):
    write(root, path)
  glob = make_glob(root)
  assert glob(['*.py']) == ['a.py']
  assert glob(['**/*.py']) == ['a.py', 'x/b.py', 'x/y/c.py']  # Not into the subpackage.
  assert glob(['x/**'], exclude=['x/y/*.txt']) == ['x/b.py', 'x/y/c.py']


# --- The library's stages: a py_library each, depending on what it imports. ---

def stage_library_problems(root: str) -> list[str]:
  """Where BUILD's stage libraries differ from the package's folders and imports."""
  import test_layering  # pylint: disable=g-import-not-at-top  (tests/ is on sys.path)
  rules = {r.attrs['name']: r for r in evaluate_build(root)
           if r.kind == 'py_library' and 'name' in r.attrs}
  modules = test_layering.read_modules(root)
  problems = []
  for stage in test_layering.LAYERS + test_layering.TOOLS:
    name = f'estimator_towers_{stage}'
    rule = rules.get(name)
    files = sorted(os.path.relpath(m.path, root).replace(os.sep, '/') for n, m in modules.items()
                   if test_layering.stage_of(n) == stage)
    if rule is None:
      problems.append(f'BUILD: no py_library {name} for estimator_towers/{stage}/.')
      continue
    if sorted(rule.attrs.get('srcs', [])) != files:
      problems.append(f'BUILD: {name} srcs are not the files of estimator_towers/{stage}/.')
    imported = set()
    for n, m in modules.items():
      if test_layering.stage_of(n) == stage:
        imported |= {test_layering.stage_of(t) or 'top' for t, _, _ in
                     test_layering.imports_of(m, modules)} - {stage}
    # ':estimator_towers' (the public API and the orchestrator): 'top'.
    deps = {_label_to_path(d)[len('estimator_towers_'):] or 'top'
            for d in rule.attrs.get('deps', [])}
    if deps != imported:
      problems.append(f'BUILD: {name} deps {sorted(deps)}, but its modules import the '
                      f'stages {sorted(imported)}.')
  return problems


def test_build_has_a_library_per_stage_with_the_stages_it_imports():
  assert stage_library_problems(ROOT) == []


def test_a_stage_library_missing_an_import_fails(tmp_path):
  root = copy_tree(tmp_path)
  shutil.copytree(os.path.join(ROOT, 'estimator_towers'), os.path.join(root, 'estimator_towers'),
                  ignore=shutil.ignore_patterns('__pycache__'))
  assert stage_library_problems(root) == []
  edit_build(root, '"gradients": ["base", "placement", "towers", "heads", "loss"]',
             '"gradients": ["base", "placement", "towers", "heads"]')
  assert stage_library_problems(root) == [
      "BUILD: estimator_towers_gradients deps ['base', 'heads', 'placement', 'towers'], but its "
      "modules import the stages ['base', 'heads', 'loss', 'placement', 'towers']."]
