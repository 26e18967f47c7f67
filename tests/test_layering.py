"""The package's stages import one way: a stage uses the stages below it, never a later one.

`estimator_towers/` is one subpackage per stage of the data path, in the
order of `LAYERS` (lowest first); `replicate.py` (the orchestrator) and
`__init__.py` (the public API) sit above them all. The rules, read from the
source with `ast` (no TensorFlow import):

- a module imports only modules of its own stage or of a stage below it,
  lazy imports inside functions included;
- no circle of imports between modules, within a stage or across;
- a stage's private names (`_name`) stay in their module: no other stage
  imports or reads them;
- TensorFlow's private API (`tensorflow.python`, `tensorflow_estimator.python`)
  is imported by two modules only, `base/interception.py` and
  `base/control_flow.py` (`FENCE`): a TensorFlow upgrade has two files to check;
- every stage's `__init__.py` states its rule in its docstring, with a line
  `May import: ...` naming exactly the stages below it, and imports nothing
  (the public surface is re-exported once, by the package's `__init__`);
- a static size is read off a shape by one helper, `base/shapes.py` (`SHAPES`):
  no `x.shape[i]` elsewhere, which TF1 shapes give as a `Dimension`;
- a tool (`TOOLS`: the self-test) sits above the public API: it may import
  any module of the package, and no stage nor the top level imports it; its
  `__init__.py` says `May import: everything ...` and imports nothing.

The checker is tried on small trees written here with one rule broken each.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = 'estimator_towers'

# The stages, lowest first: each may import the ones before it.
LAYERS = ('base', 'cluster', 'placement', 'settings', 'inputs', 'towers', 'sync_points',
          'rows', 'draws', 'heads', 'loss', 'gradients', 'reporting')
TOP = len(LAYERS)  # replicate.py and __init__.py
# Folders above the public API (a tool the user runs), which import anything.
TOOLS = ('selftest',)
# The one module that may import TensorFlow's private API, and what that API is.
FENCE = (f'{PACKAGE}.base.interception', f'{PACKAGE}.base.control_flow')
PRIVATE_TF = ('tensorflow.python', 'tensorflow_estimator.python', 'keras.src')


@dataclasses.dataclass
class Module:
  name: str          # dotted, e.g. estimator_towers.rows.frontier
  path: str
  tree: ast.Module

  @property
  def is_package(self) -> bool:
    return os.path.basename(self.path) == '__init__.py'


def read_modules(root: str, package: str = PACKAGE) -> dict[str, Module]:
  """Every module of `package` under `root`, parsed, by dotted name."""
  modules = {}
  base = os.path.join(root, package)
  for dirpath, dirnames, filenames in os.walk(base):
    dirnames[:] = sorted(d for d in dirnames if not d.startswith(('.', '__')))
    for filename in sorted(filenames):
      if not filename.endswith('.py'):
        continue
      path = os.path.join(dirpath, filename)
      parts = os.path.relpath(path, root)[:-len('.py')].split(os.sep)
      if parts[-1] == '__init__':
        parts = parts[:-1]
      with open(path, encoding='utf-8') as f:
        modules['.'.join(parts)] = Module('.'.join(parts), path, ast.parse(f.read(), path))
  return modules


def stage_of(name: str, package: str = PACKAGE) -> str | None:
  """The stage (subpackage) a module belongs to; None for the top level."""
  parts = name.split('.')
  return parts[1] if len(parts) > 2 or (len(parts) == 2 and _is_stage(parts[1])) else None


def _is_stage(part: str) -> bool:
  return part in LAYERS or part in TOOLS


def imports_of(module: Module, modules: dict, package: str = PACKAGE) -> list[tuple]:
  """(imported module, names taken from it, line) for each of the package's imports."""
  found = []
  for node in ast.walk(module.tree):
    if isinstance(node, ast.ImportFrom) and node.module and (
        node.module == package or node.module.startswith(package + '.')):
      for alias in node.names:
        target = f'{node.module}.{alias.name}'
        if target in modules:  # `from package.stage import module`
          found.append((target, (), node.lineno))
        else:
          found.append((node.module, (alias.name,), node.lineno))
    elif isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name == package or alias.name.startswith(package + '.'):
          found.append((alias.name, (), node.lineno))
  return found


def _module_aliases(module: Module, modules: dict, package: str) -> dict[str, str]:
  """Local names bound to the package's modules (`from x import mod as alias`)."""
  aliases = {}
  for node in ast.walk(module.tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package):
      for alias in node.names:
        if f'{node.module}.{alias.name}' in modules:
          aliases[alias.asname or alias.name] = f'{node.module}.{alias.name}'
  return aliases


def _rank(name: str, package: str) -> int:
  stage = stage_of(name, package)
  return LAYERS.index(stage) if stage in LAYERS else TOP + 1 if stage in TOOLS else TOP


def problems(root: str, package: str = PACKAGE) -> list[str]:
  """Every broken layering rule in the package under `root`; empty when none."""
  modules = read_modules(root, package)
  found = []
  graph = {name: set() for name in modules}
  for name, module in modules.items():
    parts = name.split('.')
    if (len(parts) >= 2 and os.path.isdir(os.path.join(root, *parts[:2]))
        and not _is_stage(parts[1])):
      found.append(f'{name}: its folder {parts[1]}/ is not a stage of LAYERS '
                   f'(tests/test_layering.py); add it where it belongs in the order.')
      continue
    here = _rank(name, package)
    for target, names, line in imports_of(module, modules, package):
      if target not in modules:
        found.append(f'{module.path}:{line}: imports {target}, which does not exist.')
        continue
      if target != name:
        graph[name].add(target)
      there = _rank(target, package)
      if there > here:
        found.append(
            f'{module.path}:{line}: {name} (stage {stage_of(name, package) or "top"}) imports '
            f'{target} (stage {stage_of(target, package) or "top"}), a later stage: a stage '
            f'uses only the stages below it ({", ".join(LAYERS)}).')
      private = [n for n in names if n.startswith('_')]
      if private and stage_of(target, package) != stage_of(name, package):
        found.append(f'{module.path}:{line}: {name} imports private {", ".join(private)} '
                     f'of {target}, another stage; make it public there or keep it apart.')
    for alias, target in _module_aliases(module, modules, package).items():
      if stage_of(target, package) == stage_of(name, package):
        continue
      for node in ast.walk(module.tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == alias and node.attr.startswith('_')
            and not node.attr.startswith('__')):
          found.append(f'{module.path}:{node.lineno}: {name} reads private '
                       f'{target}.{node.attr} of another stage; make it public there.')
  found += _private_tensorflow(modules)
  found += [f'import circle: {" -> ".join(cycle)}' for cycle in _cycles(graph)]
  found += _stage_docstrings(modules, package)
  return found


def _private_tensorflow(modules: dict) -> list[str]:
  found = []
  for name, module in modules.items():
    if name in FENCE:
      continue
    for node in ast.walk(module.tree):
      names = ([node.module or ''] if isinstance(node, ast.ImportFrom) else
               [a.name for a in node.names] if isinstance(node, ast.Import) else [])
      for imported in names:
        if imported.startswith(PRIVATE_TF):
          found.append(f'{module.path}:{node.lineno}: {name} imports {imported}, '
                       f'TensorFlow\'s private API, which only {" and ".join(FENCE)} may: add what '
                       f'you need there.')
  return found


def _stage_docstrings(modules: dict, package: str) -> list[str]:
  found = []
  for stage in LAYERS + TOOLS:
    init = modules.get(f'{package}.{stage}')
    if init is None:
      continue
    docstring = ast.get_docstring(init.tree) or ''
    below = ', '.join(LAYERS[:LAYERS.index(stage)]) or 'nothing' if stage in LAYERS else 'everything'
    match = re.search(r'^May import: (.*?)\.?$', docstring, re.M)
    if not docstring.strip():
      found.append(f'{init.path}: no docstring stating the stage\'s rule.')
    elif match is None or match.group(1).split(' (')[0].strip() != below:
      found.append(f'{init.path}: its docstring needs the line "May import: {below}."')
    if any(isinstance(node, (ast.Import, ast.ImportFrom)) for node in init.tree.body):
      found.append(f'{init.path}: a stage\'s __init__ imports nothing (the package\'s '
                   f'__init__ re-exports the public API once).')
  return found


def _cycles(graph: dict[str, set]) -> list[list[str]]:
  """The import circles (Tarjan's strongly connected components of more than one module)."""
  index, low, on_stack, stack, cycles = {}, {}, set(), [], []

  def visit(node):
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for nxt in sorted(graph[node]):
      if nxt not in index:
        visit(nxt)
        low[node] = min(low[node], low[nxt])
      elif nxt in on_stack:
        low[node] = min(low[node], index[nxt])
    if low[node] == index[node]:
      component = []
      while True:
        top = stack.pop()
        on_stack.discard(top)
        component.append(top)
        if top == node:
          break
      if len(component) > 1:
        cycles.append(sorted(component))

  for node in sorted(graph):
    if node not in index:
      visit(node)
  return cycles


def test_the_package_imports_one_way():
  assert problems(ROOT) == []


def test_every_stage_is_a_folder_of_the_package():
  modules = read_modules(ROOT)
  assert {stage_of(name) for name in modules} - {None} == set(LAYERS + TOOLS)
  top = sorted(name for name in modules if stage_of(name) is None)
  assert top == [PACKAGE, f'{PACKAGE}.replicate']


def test_no_module_is_over_the_size_limit():
  too_long = {}
  for module in read_modules(ROOT).values():
    with open(module.path, encoding='utf-8') as f:
      lines = sum(1 for _ in f)
    if lines > 620:
      too_long[module.name] = lines
  assert too_long == {}


# The one module that reads a static size off a TensorShape (TF1 shapes give `Dimension`s).
SHAPES = f'{PACKAGE}.base.shapes'


def static_size_reads(root: str, package: str = PACKAGE) -> list[str]:
  """`x.shape[i]` and `x.get_shape()[i]` (one axis, not a slice) outside `SHAPES`: under TF1
  shapes (`disable_v2_tensorshape()`) they give a `Dimension`, never None, whose `int()` of an
  unknown size fails; `shapes.dim(x, i)` gives an int or None under both behaviours."""
  found = []
  for module in read_modules(root, package).values():
    if module.name == SHAPES:
      continue
    for node in ast.walk(module.tree):
      if not isinstance(node, ast.Subscript) or isinstance(node.slice, ast.Slice):
        continue
      value = node.value
      if (isinstance(value, ast.Attribute) and value.attr == 'shape') or (
          isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
          and value.func.attr == 'get_shape'):
        found.append(f'{module.name}:{node.lineno}: {ast.unparse(node)} (use shapes.dim)')
  return found


def test_static_sizes_are_read_through_one_helper():
  assert static_size_reads(ROOT) == []


def test_a_static_size_read_off_a_shape_is_caught(tmp_path):
  root = _write(tmp_path, _tree({
      'base/shapes.py': 'def dim(x, axis=0):\n  return x.shape[axis]\n',   # the helper itself
      'rows/r.py': 'def f(t):\n  return t.shape[1:], t.shape[0]\n',
      'heads/h.py': 'def g(t):\n  return t.get_shape()[-1]\n'}))
  assert static_size_reads(root) == [
      'estimator_towers.heads.h:2: t.get_shape()[-1] (use shapes.dim)',
      'estimator_towers.rows.r:2: t.shape[0] (use shapes.dim)']


def _write(root, files: dict) -> str:
  for path, text in files.items():
    full = os.path.join(str(root), PACKAGE, path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, 'w', encoding='utf-8') as f:
      f.write(text)
  return str(root)


def _tree(extra: dict) -> dict:
  files = {'__init__.py': '"""The package."""\n', 'replicate.py': '"""Top."""\n'}
  for i, stage in enumerate(LAYERS):
    below = ', '.join(LAYERS[:i]) or 'nothing'
    files[f'{stage}/__init__.py'] = f'"""The {stage} stage.\n\nMay import: {below}.\n"""\n'
  files.update(extra)
  return files


def test_a_clean_tree_has_no_problems(tmp_path):
  root = _write(tmp_path, _tree({
      'base/a.py': 'X = 1\n',
      'towers/b.py': 'from estimator_towers.base import a\n',
      'replicate.py': 'from estimator_towers.towers import b\n'}))
  assert problems(root) == []


def test_a_back_import_is_caught(tmp_path):
  root = _write(tmp_path, _tree({
      'base/a.py': 'def f():\n  from estimator_towers.heads import h\n',  # a lazy one
      'heads/h.py': 'X = 1\n'}))
  (found,) = problems(root)
  assert 'estimator_towers.base.a (stage base) imports estimator_towers.heads.h (stage heads)' in found


def test_the_orchestrator_is_above_every_stage(tmp_path):
  root = _write(tmp_path, _tree({'rows/r.py': 'from estimator_towers import replicate\n'}))
  (found,) = problems(root)
  assert 'a later stage' in found


def test_a_circle_within_a_stage_is_caught(tmp_path):
  root = _write(tmp_path, _tree({
      'rows/a.py': 'from estimator_towers.rows import b\n',
      'rows/b.py': 'from estimator_towers.rows import a\n'}))
  assert problems(root) == [
      'import circle: estimator_towers.rows.a -> estimator_towers.rows.b']


def test_another_stages_private_names_are_caught(tmp_path):
  root = _write(tmp_path, _tree({
      'base/a.py': '_HIDDEN = 1\n',
      'rows/r.py': 'from estimator_towers.base import a\nY = a._HIDDEN\n',
      'rows/s.py': 'from estimator_towers.base.a import _HIDDEN\n'}))
  found = problems(root)
  assert len(found) == 2
  assert 'reads private estimator_towers.base.a._HIDDEN' in found[0]
  assert 'imports private _HIDDEN' in found[1]


def test_a_tool_imports_anything_and_nothing_imports_it(tmp_path):
  root = _write(tmp_path, _tree({
      'selftest/__init__.py': '"""The tool.\n\nMay import: everything.\n"""\n',
      'selftest/cli.py': 'import estimator_towers\nfrom estimator_towers.base import a\n',
      'base/a.py': 'X = 1\n',
      'heads/h.py': 'from estimator_towers.selftest import cli\n'}))
  (found,) = problems(root)
  assert 'estimator_towers.heads.h (stage heads) imports estimator_towers.selftest.cli ' \
         '(stage selftest), a later stage' in found


def test_a_folder_outside_the_layers_is_caught(tmp_path):
  root = _write(tmp_path, _tree({'extras/__init__.py': '"""x."""\n', 'extras/e.py': ''}))
  found = problems(root)
  assert found and all('is not a stage of LAYERS' in f for f in found)


def test_private_tensorflow_outside_the_fence_is_caught(tmp_path):
  root = _write(tmp_path, _tree({
      'base/interception.py': 'from tensorflow.python.ops import gen_nn_ops\n',
      'towers/t.py': 'def f():\n  from tensorflow.python.util import function_utils\n'}))
  (found,) = problems(root)
  assert 'estimator_towers.towers.t imports tensorflow.python.util' in found


@pytest.mark.parametrize('init, message', [
    ('', 'no docstring'),
    ('"""The rows stage."""\n', 'May import: base, cluster'),
    ('"""The rows.\n\nMay import: base.\n"""\n', 'May import: base, cluster'),
    ('"""The rows.\n\nMay import: base, cluster, placement, settings, inputs, towers, '
     'sync_points.\n"""\nfrom estimator_towers.base import a\n', 'imports nothing'),
])
def test_a_stage_states_its_rule(tmp_path, init, message):
  root = _write(tmp_path, _tree({'base/a.py': '', 'rows/__init__.py': init}))
  (found,) = problems(root)
  assert message in found


def test_the_design_page_maps_every_module_in_its_folders_table():
  with open(os.path.join(ROOT, 'docs', 'contributing', 'design.md'), encoding='utf-8') as f:
    page = f.read()
  sections = dict(re.findall(r'^### `(\w+)/`.*?\n(.*?)(?=^### |^## |\Z)', page, re.M | re.S))
  assert sorted(sections) == sorted(LAYERS + TOOLS)
  unmapped = {}
  for name, module in read_modules(ROOT).items():
    stage = stage_of(name)
    filename = os.path.basename(module.path)
    if stage is None or filename == '__init__.py':
      continue
    if f'`{filename}`' not in sections[stage]:
      unmapped[name] = f'not in the table of `{stage}/` in docs/contributing/design.md'
  assert unmapped == {}
