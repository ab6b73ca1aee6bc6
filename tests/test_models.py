"""Embedded model preparation: real conversion of the shipped GGUF, once, atomically."""

import os
import time

import pytest

from cluster import models


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CLUSTER_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One cache for the tests that only read a prepared model (a conversion takes ~25 s)."""
    with pytest.MonkeyPatch.context() as patch:
        path = tmp_path_factory.mktemp("cache")
        patch.setenv("CLUSTER_CACHE", str(path))
        yield path


def test_prepare_is_idempotent_and_atomic(shared_cache):
    path = models.prepare_embedded("smollm2-135m-instruct", quiet=True)
    assert path == shared_cache / "models" / "smollm2-135m-instruct"
    assert models.is_prepared(path)
    # No staging directories are left behind.
    assert [p.name for p in path.parent.iterdir() if not p.name.endswith(".lock")] == [path.name]
    config = (path / "config.json").read_text()
    assert '"num_hidden_layers": 30' in config and '"hidden_size": 576' in config
    stamp = (path / "model.safetensors").stat().st_mtime_ns

    started = time.monotonic()
    assert models.prepare_embedded("smollm2-135m-instruct", quiet=True) == path
    assert time.monotonic() - started < 1.0
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_prepared_weights_are_real(shared_cache):
    import torch
    from safetensors.torch import load_file

    path = models.prepare_embedded("smollm2-135m-instruct", quiet=True)
    tensors = load_file(path / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    assert embed.shape == (49152, 576) and embed.dtype == torch.bfloat16
    assert embed.float().std() > 0.01  # dequantized, not zero/initialised


def test_half_written_model_is_not_used(cache):
    final = models.embedded_path("smollm2-135m-instruct")
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")  # a crash left only part of it
    assert not models.is_prepared(final)
    models.prepare_embedded("smollm2-135m-instruct", quiet=True)
    assert models.is_prepared(final)
    assert os.path.getsize(final / "model.safetensors") > 100_000_000


def test_unknown_embedded_model_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown embedded model 'gpt-9'"):
        models.embedded_name("embedded:gpt-9")
