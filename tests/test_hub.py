"""Checkpoints by Hugging Face Hub id, offline: a cache directory populated here in the Hub's own layout
(models--org--name/{refs,blobs,snapshots}, snapshot files symlinked to content-addressed blobs) resolves
through huggingface_hub to the same model as the directory; an id that is not cached is refused naming it."""

import hashlib
import os

import ml_collections
import numpy as np
import pytest

import d2f_jax
from d2f_jax.convert import resolve_model_dir, synthetic
from d2f_jax.convert.source import HUB_ID
from d2f_jax.models import TINY_DREAM


def populate_hub_cache(cache, repo: str, source_dir, revision: str = "main") -> str:
  """Put `source_dir`'s files into `cache` as huggingface_hub stores a download of `repo` at `revision`."""
  folder = cache / f"models--{repo.replace('/', '--')}"
  commit = hashlib.sha1(f"{repo}@{revision}".encode()).hexdigest()
  snapshot = folder / "snapshots" / commit
  (folder / "blobs").mkdir(parents=True, exist_ok=True)
  snapshot.mkdir(parents=True)
  for name in sorted(os.listdir(source_dir)):
    data = (source_dir / name).read_bytes()
    blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
    blob.write_bytes(data)
    (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
  (folder / "refs").mkdir(exist_ok=True)
  (folder / "refs" / revision).write_text(commit)
  return str(snapshot)


@pytest.fixture
def hub(tmp_path, monkeypatch):
  source = tmp_path / "source"
  synthetic.write_hf_checkpoint(source, TINY_DREAM, seed=0, dtype="float32")
  cache = tmp_path / "hub"
  snapshots = {rev: populate_hub_cache(cache, "test-org/tiny-dream", source, rev) for rev in ("main", "v1")}
  monkeypatch.setenv("HF_HUB_CACHE", str(cache))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  return source, snapshots


def test_a_cached_hub_id_loads_the_same_model_as_its_directory(hub):
  source, snapshots = hub
  by_id = d2f_jax.load_model("test-org/tiny-dream")
  assert by_id.source == snapshots["main"]
  assert resolve_model_dir("test-org/tiny-dream@v1") == snapshots["v1"]
  by_dir = d2f_jax.load_model(str(source))
  tokens = np.array([[5, 6, 7, 8]], np.int32)
  np.testing.assert_array_equal(np.asarray(by_id.logits(tokens)), np.asarray(by_dir.logits(tokens)))
  assert by_id.tokenizer is not None and by_id.config == by_dir.config


def test_the_trainer_reads_a_hub_id_as_config_model_path(hub):
  from d2f_jax.train.model import model_config
  cfg = ml_collections.ConfigDict(dict(path="test-org/tiny-dream", preset=None, overrides=None, dtype="float32"))
  assert model_config(cfg) == TINY_DREAM.replace(dtype="float32", param_dtype="float32", attention_kind="bidirectional")


def test_an_uncached_id_offline_is_refused_naming_it(hub, tmp_path):
  with pytest.raises(FileNotFoundError, match=r"'test-org/absent' does not exist, and as a Hugging Face Hub id it "
                                               r"was not found in the local Hugging Face cache \(HF_HUB_OFFLINE"):
    d2f_jax.load_model("test-org/absent")
  with pytest.raises(FileNotFoundError, match="not found in the local"):
    resolve_model_dir("test-org/tiny-dream@v2")  # a revision that was never downloaded
  with pytest.raises(FileNotFoundError, match="does not exist$"):
    resolve_model_dir(str(tmp_path / "no" / "such" / "dir"))  # a path, not an id: no Hub lookup
  (tmp_path / "weights.bin").write_bytes(b"")
  with pytest.raises(FileNotFoundError, match="is a file, not a model directory"):
    resolve_model_dir(str(tmp_path / "weights.bin"))


def test_hub_id_syntax():
  for ok in ("GSAI-ML/LLaDA-8B-Instruct", "Dream-org/Dream-v0-Base-7B@main", "a/b.c_d@refs/pr/1"):
    assert HUB_ID.match(ok), ok
  for bad in ("LLaDA-8B", "/abs/path", "a/b/c", "a/b@", "a b/c"):
    assert not HUB_ID.match(bad), bad
