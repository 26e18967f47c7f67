"""The docs cannot rot: the flags page, the links and the README's quick start.

What the docs site's build (`mkdocs build --strict`, in .ci/run) does not
check, and what must also hold on GitHub:

- docs/flags.md lists exactly the flags `define_flags()` defines (on a fresh
  FlagValues), each once, with its current default and, for an enum, its
  choices.
- Every relative link (and image) in README.md, CHANGELOG.md, docs/ (its
  subfolders too) and the measurement notes next to the benches (bench/*.md,
  not on the site) resolves to a file and, where it names one, to a heading
  of that file (GitHub's anchors, which mkdocs.yml makes the site's too). The
  site's build checks docs/ again, but not the others.
- No page of the site, nor README.md, dates a measurement or names an issue
  number; the user pages name no private names.
- Every test the docs name (`test_x.py::test_y`) exists.
- The README's quick-start code runs as written, in a fresh process, trains
  its 20 steps and towers (its training graph has a tower on /cpu:1).
"""

import collections
import fnmatch
import os
import re

from absl import flags

from estimator_towers import define_flags
import testlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, 'docs')
FENCE = re.compile(r'^\s*```')
LINK = re.compile(r'\[[^\]]*\]\(([^)\s]+)\)')  # links and images


def read(path: str) -> str:
  with open(path, encoding='utf-8') as f:
    return f.read()


def markdown_files() -> list[str]:
  """README.md, CHANGELOG.md, then every page under docs/ (subfolders too)."""
  return [os.path.join(ROOT, 'README.md'), os.path.join(ROOT, 'CHANGELOG.md')] + sorted(
      os.path.join(folder, name) for folder, _, names in os.walk(DOCS)
      for name in names if name.endswith('.md'))


def notebook_files() -> list[str]:
  """The measurement notes next to the benches (bench/*.md): dated, not on the site."""
  folder = os.path.join(ROOT, 'bench')
  return sorted(os.path.join(folder, name) for name in os.listdir(folder) if name.endswith('.md'))


def generated(path: str) -> bool:
  """A page whose text is made at build time: an API page (`::: name`), or
  docs/changelog.md (CHANGELOG.md, included)."""
  text = read(path).strip()
  return text.startswith(':::') or text.startswith('--8<--')


def prose_lines(text: str) -> list[str]:
  """The lines outside fenced code blocks."""
  lines, fenced = [], False
  for line in text.splitlines():
    if FENCE.match(line):
      fenced = not fenced
    elif not fenced:
      lines.append(line)
  return lines


def anchors(text: str) -> set[str]:
  """GitHub's heading anchors: lowercase, punctuation but - and _ dropped,
  spaces to -, a repeated anchor suffixed -1, -2, ..."""
  seen = collections.Counter()
  found = set()
  for line in prose_lines(text):
    heading = re.match(r'#{1,6}\s+(.*?)\s*#*\s*$', line)
    if not heading:
      continue
    title = re.sub(r'\[([^\]]*)\]\([^)]*\)', r'\1', heading.group(1))  # a link: its text
    slug = re.sub(r'[^\w\- ]', '', title.lower()).replace(' ', '-')
    found.add(slug if not seen[slug] else f'{slug}-{seen[slug]}')
    seen[slug] += 1
  return found


def broken_links(path: str) -> list[str]:
  broken = []
  for line in prose_lines(read(path)):
    for target in LINK.findall(line):
      if re.match(r'[a-z][a-z0-9+.-]*:', target):  # http:, https:, mailto:
        continue
      file_part, _, anchor = target.partition('#')
      linked = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
      where = f'{os.path.relpath(path, ROOT)}: ({target})'
      if not os.path.exists(linked):
        broken.append(f'{where}: no file {os.path.relpath(linked, ROOT)}')
      elif anchor and (not linked.endswith('.md') or anchor not in anchors(read(linked))):
        broken.append(f'{where}: no heading #{anchor} in {os.path.relpath(linked, ROOT)}')
  return broken


def test_every_relative_link_resolves_to_a_file_and_heading():
  files = markdown_files() + notebook_files()
  assert len(files) > 10 and notebook_files(), files
  assert sum(len(LINK.findall(read(f))) for f in files) > 50  # the check has links to check
  broken = [b for f in files for b in broken_links(f)]
  assert not broken, '\n'.join(broken)


def test_anchors_follow_github_rules():
  text = '# Staged input: shards prefetched\n## `TPUEstimatorSpec`\n## The example with `--sync_batch_norm`\n## A\n## A\n'
  assert anchors(text) == {'staged-input-shards-prefetched', 'tpuestimatorspec',
                           'the-example-with---sync_batch_norm', 'a', 'a-1'}


def flag_rows() -> list[list[str]]:
  """The cells of the flag table's rows: flag, type, default, choices, what it does."""
  return [[cell.strip() for cell in line.strip().strip('|').split('|')]
          for line in prose_lines(read(os.path.join(DOCS, 'flags.md')))
          if line.startswith('| `--')]


def rendered_default(default) -> str:
  """A default as the flags page writes it."""
  if default is None:
    return 'unset'
  if isinstance(default, bool):
    return '`true`' if default else '`false`'
  if isinstance(default, list):
    return '`' + ','.join(default) + '`'
  if default == '':
    return '`""`'
  return f'`{default}`'


def test_flags_page_lists_every_flag_once_with_its_default_and_choices():
  flag_values = flags.FlagValues()
  define_flags(flag_values)
  rows = flag_rows()
  listed = [re.fullmatch(r'`--(\w+)`', row[0]).group(1) for row in rows]
  repeated = [name for name, count in collections.Counter(listed).items() if count > 1]
  assert not repeated, f'docs/flags.md lists these flags more than once: {repeated}'
  assert set(listed) == set(flag_values), (
      f'docs/flags.md and define_flags() differ: missing from the page '
      f'{sorted(set(flag_values) - set(listed))}, not defined {sorted(set(listed) - set(flag_values))}')
  for name, row in zip(listed, rows):
    flag = flag_values[name]
    assert len(row) == 5, row
    assert row[2] == rendered_default(flag.default), (name, row[2], flag.default)
    choices = getattr(flag.parser, 'enum_values', None)
    if choices:
      assert set(re.findall(r'`([^`]*)`', row[3])) == set(choices), (name, row[3], choices)


def test_every_docs_page_says_what_it_answers():
  for path in markdown_files()[1:]:
    if generated(path):
      continue
    head = read(path)[:600]
    assert head.startswith('# '), path
    assert '**What this page answers:**' in head, path


def test_readme_is_short():
  assert len(read(os.path.join(ROOT, 'README.md')).splitlines()) <= 220


def quick_start() -> str:
  """The first python block after the README's '## Quick start' heading."""
  text = read(os.path.join(ROOT, 'README.md'))
  section = text.split('\n## Quick start\n', 1)[1]
  return re.search(r'```python\n(.*?)```', section, re.S).group(1)


def test_readme_quick_start_runs_as_written(tmp_path):
  done, output = testlib.run_script(quick_start(), tmp_path, 240, 'quick_start.py')
  assert done.returncode == 0, output[-3000:]
  assert "'global_step': 20" in done.stdout, done.stdout[-2000:]
  # The model_dir (a mkdtemp under TMPDIR) holds the training graph: two towers.
  graphs = [os.path.join(d, 'graph.pbtxt') for d in tmp_path.iterdir()
            if os.path.exists(os.path.join(d, 'graph.pbtxt'))]
  assert len(graphs) == 1, list(tmp_path.iterdir())
  graph = read(graphs[0])
  assert 'name: "tower_1/' in graph and 'device: "/device:CPU:1"' in graph


def test_every_test_the_docs_name_exists():
  """`test_x.py` and `test_x.py::test_name` (or a `test_error_*` pattern) in the
  docs name a module of tests/ and a test function in it."""
  named = re.compile(r'`(?:tests/)?(test_\w+\.py)(?:::(test_[\w*]+))?')
  missing, count = [], 0
  for path in markdown_files():
    for module, function in named.findall(read(path)):
      count += 1
      source = os.path.join(ROOT, 'tests', module)
      if not os.path.exists(source):
        missing.append(f'{os.path.relpath(path, ROOT)}: no tests/{module}')
      elif function and not fnmatch.filter(re.findall(r'^def (test_\w+)', read(source), re.M),
                                           function):
        missing.append(f'{os.path.relpath(path, ROOT)}: no {function} in tests/{module}')
  assert count > 40, count
  assert not missing, '\n'.join(missing)


MONTHS = ('January|February|March|April|May|June|July|August|September|October|'
          'November|December')
LAB_NOTE = re.compile(
    r'\bissue \d+|\b20\d\d-\d\d-\d\d\b'
    rf'|\b\d{{1,2}} (?:{MONTHS}) 20\d\d\b|\b(?:{MONTHS}) (?:\d{{1,2}}, )?20\d\d\b'
    r'|\btoday\b|\bthis session\b|\bwe measured\b', re.I)


def lab_notes(text: str) -> list[str]:
  """Issue numbers, dates and session talk in a page's text."""
  return [match.group(0) for match in LAB_NOTE.finditer(text)]


def test_lab_notes_are_found():
  text = ('Measured 26 November 2026, (November 26, 2026; 2026-11-26) as of today, '
          'in this session, for issue 22. May import: base.')
  assert lab_notes(text) == ['26 November 2026', 'November 26, 2026', '2026-11-26',
                             'today', 'this session', 'issue 22']


def test_site_pages_hold_no_lab_notes():
  """README.md and every page of the site (docs/, contributing included, and
  CHANGELOG.md) name no issue numbers and no dates: measurement history
  belongs in bench/*.md, figures in docs/performance.md's tables with their
  machine and command. The user pages (not docs/contributing/) name no
  private names (`module._name`) either."""
  private = re.compile(r'\b[a-z_]+\._[a-z]\w*')
  found = [f'{os.path.relpath(path, ROOT)}: {note}'
           for path in markdown_files() for note in lab_notes(read(path))]
  found += [f'{os.path.relpath(path, ROOT)}: {match.group(0)}'
            for path in markdown_files()
            if os.sep + 'contributing' + os.sep not in path
            for match in private.finditer(read(path))]
  assert not found, '\n'.join(found)
