"""Export a training checkpoint as a drafter directory vLLM loads, then validate it."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
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
    """What a drafter was made from, and the commands that make it again.

    A run continued from an exported drafter (a shipped one) starts its commands with those of
    the drafter's own recipe, its run directories renamed one `-base` deeper."""
    stages = _stages(run_info)
    source = stages[0].get("init_from") or {}
    prior = source.get("recipe") if "drafter" in source else None
    prior_commands = _deeper_runs(prior.get("reproduce", []), name) if prior else []
    naming = _Naming(
        offset=sum(c.startswith("cluster drafters data ") for c in prior_commands), name=name
    )
    data_sets = []  # distinct training sets in order of first use
    for stage in stages:
        data_sets += [r for r in stage["data_recipes"] if r not in data_sets]
    return {
        "variant": run_info["train"]["variant"],
        "exported_step": step,
        "data": {
            "sets": [{"dir": naming.data_dir(data_sets, r)} | r for r in data_sets],
            "prompts": "stdlib `train` split (cluster/workloads.py), target's greedy responses",
            "validation": _validation_of(run_info.get("val_data_recipe")),
        },
        "train": run_info["train"],
        **({"init_from_step": run_info["init_from"]["step"]} if "init_from" in run_info else {}),
        **(
            {"continued_from": {"drafter": source["drafter"], "recipe": prior}}
            if prior is not None
            else {}
        ),
        "reproduce": [
            *prior_commands,
            *(naming.data_command(data_sets, r) for r in data_sets),
            *(
                naming.train_command(stage, data_sets, "-base" * (len(stages) - 1 - i))
                for i, stage in enumerate(stages)
            ),
            f"cluster drafters export runs/{name} --out drafters/{name}",
        ],
    }


def _stages(run_info: dict) -> list[dict]:
    """The runs this one continued from (`--init-from RUN`), oldest first, then this one."""
    source = run_info.get("init_from")
    earlier = _stages(source) if source and "drafter" not in source else []
    return [*earlier, run_info]


def _deeper_runs(commands: list[str], name: str) -> list[str]:
    """`runs/NAME[-base...]` -> `runs/NAME-base[-base...]`: this run takes `runs/NAME`."""
    pattern = re.compile(rf"runs/{re.escape(name)}(?=-base|\s|$)")
    return [pattern.sub(f"runs/{name}-base", command) for command in commands]


@dataclass(frozen=True)
class _Naming:
    """Directory names in the reproduce commands: `data/train-N` is the N-th training set
    (after `offset` sets of an earlier recipe), `runs/NAME` the exported run."""

    offset: int
    name: str

    @property
    def val_dir(self) -> str:
        return "data/val" if not self.offset else f"data/val-{self.offset + 1}"

    def data_dir(self, data_sets: list[dict], recipe: dict) -> str:
        return f"data/train-{self.offset + data_sets.index(recipe) + 1}"

    def data_command(self, data_sets: list[dict], recipe: dict) -> str:
        # The first set also makes the validation set; later ones reuse it.
        validation = f" --val-out {self.val_dir}" if recipe == data_sets[0] else " --val-fraction 0"
        return (
            f"cluster drafters data --out {self.data_dir(data_sets, recipe)}{validation}"
            f" --contexts {','.join(map(str, recipe['code_long_contexts']))}"
            f" --per-context {recipe['code_long_per_context']} --chat {recipe['chat_short']}"
            f" --output-tokens {recipe['output_tokens']} --seed {recipe['seed']}"
        )

    def train_command(self, stage: dict, data_sets: list[dict], suffix: str) -> str:
        train = stage["train"]
        data = "".join(f" --data {self.data_dir(data_sets, r)}" for r in stage["data_recipes"])
        command = (
            f"cluster drafters train --out runs/{self.name}{suffix}{data} --val {self.val_dir}"
        )
        command += "".join(f" --{flag.replace('_', '-')} {train[flag]}" for flag in _TRAIN_FLAGS)
        source = stage.get("init_from")
        if not source:
            return command
        # An exported drafter by its path; a source run as the previous stage, named here.
        return command + f" --init-from {source.get('drafter', f'runs/{self.name}{suffix}-base')}"


def export(run_dir: Path, target: Path, out: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """`run_dir/checkpoint.pt` -> `out/{config.json,model.safetensors}` in vLLM's layout."""
    state = torch.load(run_dir / CHECKPOINT, weights_only=True)
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
