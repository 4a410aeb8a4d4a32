"""The file-system layer: local paths, file:// and fsspec memory:// URLs, object-store appends, missing back ends."""

import importlib.util
import os
import uuid

import fsspec
import pytest

from vcpo_jax import fs


@pytest.fixture()
def mem_root():
  """A fresh directory in fsspec's process-wide memory file system, removed afterwards."""
  root = f"memory://test_fs/{uuid.uuid4().hex}"
  yield root
  mem = fsspec.filesystem("memory")
  if mem.exists(root[len("memory://") :]):
    mem.rm(root[len("memory://") :], recursive=True)


def test_paths_and_urls(tmp_path):
  assert fs.scheme("gs://b/run") == "gs" and fs.scheme("/tmp/x") is None and fs.scheme("rel/x") is None
  assert fs.local_path("file:///tmp/x") == "/tmp/x"
  assert fs.local_path("/tmp/x") == "/tmp/x"
  assert fs.local_path("memory://a/b") is None
  assert fs.join("gs://b/run", "tb", "events") == "gs://b/run/tb/events"
  assert fs.join("memory://r", "metrics.jsonl") == "memory://r/metrics.jsonl"
  assert fs.join(str(tmp_path), "x") == os.path.join(str(tmp_path), "x")


@pytest.mark.parametrize("kind", ["local", "file_url", "memory"])
def test_write_read_append_list_remove(kind, tmp_path, mem_root):
  root = {"local": str(tmp_path / "w"), "file_url": f"file://{tmp_path}/w", "memory": mem_root}[kind]
  path = fs.join(root, "sub", "a.txt")
  assert not fs.exists(path) and fs.listdir(fs.join(root, "sub")) == []
  fs.write_text(path, "one\n")  # creates the parent directories
  fs.append_text(path, "two\n")
  fs.append_text(path, "three\n")
  assert fs.read_text(path) == "one\ntwo\nthree\n"
  fs.write_text(path, "replaced\n")  # a whole-file write replaces (no stale tail)
  assert fs.read_text(path) == "replaced\n"
  with fs.open(fs.join(root, "plots", "p.bin"), "wb") as f:
    f.write(b"\x89PNG")
  assert fs.read_bytes(fs.join(root, "plots", "p.bin")) == b"\x89PNG"
  assert fs.listdir(fs.join(root, "sub")) == ["a.txt"]
  fs.remove(path)
  fs.remove(path)  # removing a missing file is fine
  assert not fs.exists(path)
  if kind != "memory":  # local writes leave no temporary file behind
    assert os.listdir(tmp_path / "w" / "sub") == []


def test_no_local_directory_named_after_a_url(tmp_path, monkeypatch, mem_root):
  """The bug: os.makedirs('gs://b/run') makes ./gs:/b/run; the layer never touches the cwd for a URL."""
  monkeypatch.chdir(tmp_path)
  fs.makedirs(fs.join(mem_root, "run"))
  fs.write_text(fs.join(mem_root, "run", "x.json"), "{}")
  assert os.listdir(tmp_path) == []
  assert fs.exists(fs.join(mem_root, "run", "x.json"))


def test_object_store_append_rewrites(monkeypatch, mem_root):
  """Where a file system cannot append (gs://, s3://), append_text reads and rewrites the object."""
  monkeypatch.setattr(fs, "_APPENDABLE", frozenset({"file", "local"}))
  path = fs.join(mem_root, "log.jsonl")
  assert not fs.supports_append(path)
  fs.append_text(path, "a\n")
  fs.append_text(path, "b\n")
  assert fs.read_text(path) == "a\nb\n"


def test_missing_backend_names_the_package(monkeypatch):
  if importlib.util.find_spec("gcsfs") is not None:  # installed here: simulate fsspec's error without it

    def url_to_fs(url, **kw):
      raise ImportError("Please install gcsfs to access Google Storage")

    monkeypatch.setattr(fsspec.core, "url_to_fs", url_to_fs)
  with pytest.raises(fs.MissingDependency, match=r"gs://.*gcsfs.*pip install gcsfs") as e:
    fs.check("gs://bucket/run")
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="nosuchproto"):
    fs.check("nosuchproto://x/y")


def test_orbax_directory(tmp_path, mem_root):
  assert fs.orbax_directory(f"file://{tmp_path}/ck") == f"{tmp_path}/ck"
  assert fs.orbax_directory("rel/ck") == os.path.abspath("rel/ck")
  with pytest.raises(ValueError, match=r"orbax cannot write to memory://"):
    fs.orbax_directory(fs.join(mem_root, "ck"))
