"""Fetches the binary CIFAR-10 archive once, checks it and extracts it.

`maybe_download_and_extract(data_dir)` leaves data_dir/cifar-10-batches-bin/
with the six .bin files, as TensorFlow's cifar10_estimator helper did:

- a complete cifar-10-batches-bin/ already in data_dir is reused (no network);
- else data_dir/cifar-10-binary.tar.gz is used if its MD5 is right, or
  fetched from `url` (http(s)://, file:// or a local path) and checked;
- a wrong checksum is an error (the bad file is removed), and so is a failed
  fetch, with what to do offline.

Only the expected regular files are extracted, by name, so an archive cannot
write outside data_dir.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import urllib.error
import urllib.parse
import urllib.request

from absl import logging

import data as cifar_data  # Sibling module: this directory is on sys.path.

URL = 'https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz'
# The MD5 published on https://www.cs.toronto.edu/~kriz/cifar.html for the
# binary version (170,052,171 bytes).
MD5 = 'c32a1d4ab5d03f1284b67883e8d87530'
ARCHIVE = 'cifar-10-binary.tar.gz'
_MEMBERS = cifar_data.TRAIN_FILES + cifar_data.EVAL_FILES
_CHUNK = 1 << 20


class DownloadError(cifar_data.DataError):
  """The archive could not be fetched, or is not the expected one."""


def md5_of(path: str) -> str:
  digest = hashlib.md5()
  with open(path, 'rb') as f:
    for chunk in iter(lambda: f.read(_CHUNK), b''):
      digest.update(chunk)
  return digest.hexdigest()


def _complete(directory: str) -> bool:
  return all(os.path.isfile(os.path.join(directory, name)) for name in _MEMBERS)


def _fetch(url: str, destination: str) -> None:
  """Copies `url` (a URL or a local path) to `destination`, atomically."""
  partial = destination + '.part'
  scheme = urllib.parse.urlparse(url).scheme
  try:
    if not scheme:  # A local path.
      shutil.copyfile(url, partial)
    else:
      with urllib.request.urlopen(url, timeout=60) as response, open(partial, 'wb') as f:
        shutil.copyfileobj(response, f, _CHUNK)
  except (urllib.error.URLError, OSError, ValueError) as e:
    if os.path.exists(partial):
      os.remove(partial)
    raise DownloadError(
        f'Could not fetch CIFAR-10 from --data_url={url} ({e}). If this machine '
        f'is offline, download {URL} elsewhere, check that its MD5 is {MD5}, '
        f'and put it at {destination} (the next run extracts it), or pass '
        f'--data_url=<local path of {ARCHIVE}>; or train on --data=synthetic.'
        ) from e
  os.replace(partial, destination)


def _extract(archive: str, target: str) -> None:
  """Extracts the expected .bin files of `archive` into `target`, by name."""
  os.makedirs(target, exist_ok=True)
  wanted = {f'{cifar_data.EXTRACTED_DIR}/{name}': name for name in _MEMBERS}
  found = set()
  try:
    with tarfile.open(archive, 'r:gz') as tar:
      for member in tar:
        name = wanted.get(member.name.lstrip('./'))
        if name is None or not member.isfile():
          continue
        partial = os.path.join(target, name + '.part')
        with tar.extractfile(member) as source, open(partial, 'wb') as f:
          shutil.copyfileobj(source, f, _CHUNK)
        os.replace(partial, os.path.join(target, name))
        found.add(name)
  except (tarfile.TarError, OSError, EOFError) as e:
    raise DownloadError(f'Cannot extract {archive} ({e}); delete it and run '
                        f'again with --download.') from e
  missing = sorted(set(_MEMBERS) - found)
  if missing:
    raise DownloadError(f'{archive} has no {missing} under '
                        f'{cifar_data.EXTRACTED_DIR}/: it is not the binary '
                        f'CIFAR-10 archive ({ARCHIVE}).')


def maybe_download_and_extract(data_dir: str, url: str = URL, md5: str | None = None) -> str:
  """Makes sure data_dir/cifar-10-batches-bin/ holds CIFAR-10; returns that path.

  Args:
    data_dir: where cifar-10-binary.tar.gz and cifar-10-batches-bin/ go.
    url: an http(s):// or file:// URL, or a local path, of the archive.
    md5: its expected MD5; default `MD5`, the published one.

  Raises:
    DownloadError: when the fetch fails, the checksum differs from `md5`, or
      the archive lacks the expected files.
  """
  md5 = md5 or MD5
  target = os.path.join(data_dir, cifar_data.EXTRACTED_DIR)
  if _complete(target):
    logging.info('CIFAR-10 found in %s (not downloaded again).', target)
    return target
  os.makedirs(data_dir, exist_ok=True)
  archive = os.path.join(data_dir, ARCHIVE)
  if not (os.path.isfile(archive) and md5_of(archive) == md5):
    logging.info('Fetching %s to %s ...', url, archive)
    _fetch(url, archive)
    actual = md5_of(archive)
    if actual != md5:
      os.remove(archive)
      raise DownloadError(
          f'The file fetched from --data_url={url} has MD5 {actual}, not the '
          f'expected {md5}: it is corrupt or not {ARCHIVE}, and was removed. '
          f'Run again to retry, or check --data_url.')
  logging.info('Extracting %s into %s.', archive, target)
  _extract(archive, target)
  return target
