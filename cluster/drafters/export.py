"""Export a training checkpoint as a drafter directory vLLM loads, then validate it."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from cluster.drafters import spec as drafter_spec
from cluster.drafters.train import CHECKPOINT

_INTEGER_TENSORS = {"d2t", "t2d"}


class ExportError(ValueError):
    pass


def export(run_dir: Path, target: Path, out: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """`run_dir/checkpoint.pt` -> `out/{config.json,model.safetensors}` in vLLM's layout."""
    state = torch.load(run_dir / CHECKPOINT, weights_only=False)
    spec = drafter_spec.DrafterSpec.read(run_dir)
    expected = spec.expected_tensors()
    tensors = {}
    for name, tensor in state["model"].items():
        if name not in expected:
            continue  # frozen embeddings and derived buffers stay behind
        keep_dtype = name in _INTEGER_TENSORS
        tensors[name] = (tensor if keep_dtype else tensor.to(dtype)).contiguous()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    spec.dtype = str(dtype).removeprefix("torch.")
    spec.write(tmp)
    save_file(tensors, str(tmp / drafter_spec.WEIGHTS_FILE), metadata={"format": "pt"})
    problems = drafter_spec.validate(tmp, drafter_spec.read_target_config(target))
    if problems:
        raise ExportError("\n".join(problems))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
