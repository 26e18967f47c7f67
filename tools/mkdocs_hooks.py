"""MkDocs hook (mkdocs.yml `hooks:`): the API reference cannot leave a public name out.

For every name in `estimator_towers.__all__`, read statically with griffe (as
mkdocstrings reads it; no TensorFlow import), the build fails unless:

- the name has a docstring with a summary line and an `Example:` section;
- each of its arguments (a dataclass's fields) is documented in `Args:` (or,
  for a dataclass, `Attributes:`);
- a page under docs/api/ renders it (`::: estimator_towers.<name>`).

A failure raises mkdocs' PluginError, so `mkdocs build` (strict or not) stops
with the list of what is missing.
"""

import os
import re

import griffe
from mkdocs.exceptions import PluginError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = 'estimator_towers'


def _documented_names(sections) -> set:
  names = set()
  for section in sections:
    if section.kind.value in ('parameters', 'attributes', 'other parameters'):
      names.update(item.name.lstrip('*') for item in section.value)
  return names


def api_problems(api_pages: dict) -> list:
  """What keeps the public API from being fully documented; empty when nothing.

  Args:
    api_pages: the docs/api/ pages' markdown, by path.
  """
  module = griffe.load(PACKAGE, search_paths=[ROOT], resolve_aliases=True,
                       docstring_parser='google')
  exports = [str(name) for name in module.exports or []]
  problems = [] if exports else [f'{PACKAGE}.__all__ is empty or unreadable']
  rendered = set()
  for text in api_pages.values():
    rendered.update(re.findall(r'^:::\s*' + PACKAGE + r'\.(\w+)\s*$', text, re.M))
  for name in exports:
    where = f'{PACKAGE}.{name}'
    if name not in rendered:
      problems.append(f'{where}: no page under docs/api/ renders it (::: {where})')
    target = module[name].final_target
    docstring = target.docstring
    if docstring is None or not docstring.value.strip():
      problems.append(f'{where}: no docstring')
      continue
    sections = docstring.parse('google')
    if not any(section.kind.value == 'examples' or (
        section.kind.value == 'admonition'
        and section.title.lower().startswith('example')) for section in sections):
      problems.append(f'{where}: its docstring has no Example: section')
    parameters = getattr(target, 'parameters', None) or []
    missing = [p.name for p in parameters
               if p.name not in ('self', 'cls') and p.name not in _documented_names(sections)]
    if missing:
      problems.append(f'{where}: arguments not documented in Args: {", ".join(missing)}')
  return problems


def on_files(files, config):  # pylint: disable=unused-argument
  pages = {f.src_uri: f.content_string for f in files
           if f.src_uri.startswith('api/') and f.src_uri.endswith('.md')}
  problems = api_problems(pages)
  if problems:
    raise PluginError('The API reference is incomplete:\n  ' + '\n  '.join(problems))
  return files
