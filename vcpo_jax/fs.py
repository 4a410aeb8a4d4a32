"""One file-system layer for everything a run writes: local paths, file:// and fsspec URLs (gs://, s3://, memory://).

A workdir is either a local path or a URL. Every output of a run goes through
this module: jsonl logs, JSON summaries, plots (`open`), tensorboard event files
(`tensorboard_logdir`, which teaches tensorboardX to write through fsspec) and
orbax checkpoints (`orbax_directory`, which hands orbax an etils path). Local
paths and file:// URLs stay plain local paths, so a local run behaves exactly as
before; everything else resolves through `fsspec.core.url_to_fs`.

Object stores cannot append to an object: `append_text` rewrites it there (read
+ write, O(file size)), so writers that append often buffer and flush at
checkpoints (metrics.MetricsWriter does). Whole-object writes are atomic on
object stores; locally `write_bytes` writes a temporary file and renames it.

A missing optional back end (gcsfs for gs://, s3fs for s3://) is reported by
`check` in one line naming the package, before anything is built.
"""

from __future__ import annotations

import builtins
import io
import os
import posixpath
from typing import IO

# fsspec protocols whose files can be opened in append mode.
_APPENDABLE = frozenset({"file", "local", "memory"})
# URL schemes orbax can checkpoint to: etils.epath's (backed by fsspec) besides local paths.
_ORBAX_SCHEMES = frozenset({"gs", "s3", "az", "hf"})
# The pip package behind each remote scheme, for the missing-dependency message.
_PACKAGES = {
  "gs": "gcsfs",
  "gcs": "gcsfs",
  "s3": "s3fs",
  "s3a": "s3fs",
  "az": "adlfs",
  "abfs": "adlfs",
  "hf": "huggingface_hub",
}


class MissingDependency(ImportError):
  """A workdir URL whose file system needs an optional package that is not installed."""


def scheme(path: str) -> str | None:
  """'gs' for 'gs://bucket/run'; None for a plain local path."""
  path = os.fspath(path)
  return path.split("://", 1)[0].lower() if "://" in path else None


def local_path(path: str) -> str | None:
  """The local path for a plain path or a file:// URL; None for any other URL."""
  path = os.fspath(path)
  s = scheme(path)
  if s is None:
    return path
  if s in ("file", "local"):
    return path.split("://", 1)[1]
  return None


def is_local(path: str) -> bool:
  return local_path(path) is not None


def join(base: str, *parts: str) -> str:
  """os.path.join for local paths; '/'-joined for URLs (never os.sep)."""
  base = os.fspath(base)
  return os.path.join(base, *parts) if scheme(base) is None else posixpath.join(base, *parts)


def filesystem(path: str):
  """(fsspec file system, path inside it). Raises MissingDependency naming the package a URL needs."""
  import fsspec

  path = os.fspath(path)
  local = local_path(path)
  if local is not None:
    return fsspec.filesystem("file"), os.path.abspath(local)
  try:
    return fsspec.core.url_to_fs(path)
  except ImportError as e:
    s = scheme(path)
    pkg = _PACKAGES.get(s, f"the fsspec back end for {s}://")
    raise MissingDependency(
      f"workdir {path!r}: the {s}:// file system needs the optional package {pkg}; `pip install {pkg}` "
      f"({type(e).__name__}: {e})."
    ) from None
  except ValueError as e:  # fsspec: "Protocol not known"
    raise ValueError(f"workdir {path!r}: {e}; use a local path or an fsspec URL (gs://, s3://, memory://).") from None


def check(path: str) -> None:
  """Fails early (one line, MissingDependency / ValueError) if `path`'s file system cannot be used."""
  filesystem(path)


def makedirs(path: str) -> None:
  fs, p = filesystem(path)
  fs.makedirs(p, exist_ok=True)


def exists(path: str) -> bool:
  fs, p = filesystem(path)
  return fs.exists(p)


def remove(path: str) -> None:
  """Deletes a file; a missing file is fine."""
  fs, p = filesystem(path)
  if fs.exists(p):
    fs.rm_file(p)


def listdir(path: str) -> list[str]:
  """Base names in a directory ([] if it does not exist)."""
  fs, p = filesystem(path)
  if not fs.exists(p):
    return []
  return sorted(posixpath.basename(str(q).rstrip("/")) for q in fs.ls(p, detail=False))


def open(path: str, mode: str = "r") -> IO:
  """A file object; parent directories are created for writes."""
  fs, p = filesystem(path)
  if any(c in mode for c in "wa"):
    fs.makedirs(posixpath.dirname(p) if scheme(path) else os.path.dirname(p), exist_ok=True)
  return fs.open(p, mode)


def read_bytes(path: str) -> bytes:
  fs, p = filesystem(path)
  return fs.cat_file(p)


def read_text(path: str) -> str:
  return read_bytes(path).decode("utf-8")


def write_bytes(path: str, data: bytes) -> None:
  """Replaces the whole file atomically (local: temporary file + rename; object stores: one put)."""
  local = local_path(path)
  if local is not None:
    os.makedirs(os.path.dirname(os.path.abspath(local)), exist_ok=True)
    tmp = f"{local}.tmp-{os.getpid()}"
    with builtins.open(tmp, "wb") as f:  # this module's `open` is the layer's
      f.write(data)
    os.replace(tmp, local)
    return
  fs, p = filesystem(path)
  fs.makedirs(posixpath.dirname(p), exist_ok=True)
  fs.pipe_file(p, data)


def write_text(path: str, text: str) -> None:
  write_bytes(path, text.encode("utf-8"))


def supports_append(path: str) -> bool:
  fs, _ = filesystem(path)
  protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
  return bool(protocols & _APPENDABLE)


def append_text(path: str, text: str) -> None:
  """Appends `text`: in place where the file system can append, else by rewriting the object."""
  if supports_append(path):
    with open(path, "a") as f:
      f.write(text)
    return
  old = read_bytes(path) if exists(path) else b""
  write_bytes(path, old + text.encode("utf-8"))


# ----------------------------------------------------------------------------- orbax


def orbax_directory(path: str):
  """What orbax's CheckpointManager gets: an absolute local path, or an etils path for gs:// / s3:// / az://.

  Orbax writes array data with tensorstore and metadata through etils.epath, so
  it speaks local paths and the URL schemes etils knows, but not e.g. memory://.
  """
  local = local_path(path)
  if local is not None:
    return os.path.abspath(local)
  s = scheme(path)
  if s not in _ORBAX_SCHEMES:
    raise ValueError(
      f"checkpoint directory {path!r}: orbax cannot write to {s}:// (it supports local paths, file:// and "
      f"{', '.join(sorted(f'{x}://' for x in _ORBAX_SCHEMES))}); use one of those for the workdir."
    )
  check(path)  # the fsspec back end etils will use (e.g. gcsfs), named if missing
  from etils import epath

  return epath.Path(path)


# ----------------------------------------------------------------------------- tensorboard


class _EventFile:
  """A tensorboardX record sink on an fsspec URL: buffers the event file and rewrites it on flush."""

  def __init__(self, path: str):
    self.path, self._buf = path, io.BytesIO()

  def write(self, data: bytes):
    self._buf.write(data)

  def flush(self):
    write_bytes(self.path, self._buf.getvalue())

  def close(self):
    self.flush()


class _EventFileFactory:
  def open(self, path: str) -> _EventFile:
    return _EventFile(path)

  def directory_check(self, path: str):
    makedirs(path)


def tensorboard_logdir(path: str) -> str:
  """The logdir to give tensorboardX: a local path, or a URL whose scheme now writes through this layer.

  tensorboardX picks a writer by the URL's scheme (its own gs:// writer needs
  google-cloud-storage); registering ours sends every remote scheme through fsspec.
  """
  local = local_path(path)
  if local is not None:
    return local
  check(path)
  from tensorboardX import record_writer

  record_writer.register_writer_factory(scheme(path), _EventFileFactory())
  return path
