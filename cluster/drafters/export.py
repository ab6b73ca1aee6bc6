"""Export a training checkpoint as a drafter directory vLLM loads, then validate it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from cluster.drafters import spec as drafter_spec
from cluster.drafters.train import CHECKPOINT, RUN_INFO

_INTEGER_TENSORS = {"d2t", "t2d"}


RECIPE_FILE = "recipe.yaml"

# `cluster drafters train` flags of the TrainConfig fields (the others keep their defaults).
_TRAIN_FLAGS = (
    "variant", "steps", "ttt_steps", "tokens_per_step", "max_sample_tokens",
    "prompt_context_tokens", "prompt_loss_weight", "draft_vocab_size", "lr", "warmup_steps", "seed",
    "threads", "checkpoint_every", "val_samples",
)  # fmt: skip


class ExportError(ValueError):
    pass


def _validation_of(val_recipe: dict | None) -> str:
    if val_recipe is None:  # runs from before the validation recipe was recorded
        return "stdlib `eval` split"
    return (
        f"stdlib `eval` split: {val_recipe['code_long_per_context']} prompts per context, "
        f"{val_recipe['chat_short']} chat prompts"
    )


def recipe_of(run_info: dict, step: int, name: str) -> dict:
    """What a drafter was made from, and the commands that make it again."""
    data, train = run_info["data_recipe"], run_info["train"]
    data_command = (
        "cluster drafters data"
        f" --contexts {','.join(map(str, data['code_long_contexts']))}"
        f" --per-context {data['code_long_per_context']} --chat {data['chat_short']}"
        f" --output-tokens {data['output_tokens']} --seed {data['seed']}"
    )
    return {
        "variant": train["variant"],
        "exported_step": step,
        "data": data
        | {
            "prompts": "stdlib `train` split (cluster/workloads.py), target's greedy responses",
            "validation": _validation_of(run_info.get("val_data_recipe")),
        },
        "train": train,
        **({"init_from_step": run_info["init_from"]["step"]} if "init_from" in run_info else {}),
        "reproduce": [
            data_command,
            *_train_commands(run_info, name),
            f"cluster drafters export runs/{name} --out drafters/{name}",
        ],
    }


def _train_commands(run_info: dict, name: str) -> list[str]:
    """The train command of this run, preceded by those of the runs it continued from."""
    train, source = run_info["train"], run_info.get("init_from")
    command = f"cluster drafters train --out runs/{name}" + "".join(
        f" --{flag.replace('_', '-')} {train[flag]}" for flag in _TRAIN_FLAGS
    )
    if source is None:
        return [command]
    base = f"{name}-base"
    return [*_train_commands(source, base), f"{command} --init-from runs/{base}"]


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
    if (run_dir / RUN_INFO).is_file():
        run_info = json.loads((run_dir / RUN_INFO).read_text())
        recipe = recipe_of(run_info, state["step"], out.name)
        (tmp / RECIPE_FILE).write_text(yaml.safe_dump(recipe, sort_keys=False, width=100))
    problems = drafter_spec.validate(tmp, drafter_spec.read_target_config(target))
    if problems:
        raise ExportError("\n".join(problems))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
