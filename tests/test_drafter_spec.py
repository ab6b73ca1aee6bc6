"""Drafter config round trip and every validation failure, on small real safetensors files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from cluster.config import ConfigError, parse_config
from cluster.drafters import spec
from cluster.drafters.spec import DrafterSpec

SHIPPED_DIR = Path(__file__).resolve().parents[1] / "drafters"

TARGET = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 6,
    "vocab_size": 512,
}


def _spec(**changes) -> DrafterSpec:
    fields = dict(
        hidden_size=64,
        target_hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        draft_vocab_size=100,
        eagle_aux_hidden_state_layer_ids=[1, 3, 4],
        fc_norm=True,
        norm_output=True,
        norm_before_fc=False,
        norm_before_residual=False,
    )
    return DrafterSpec(**(fields | changes))


def _write(directory: Path, drafter: DrafterSpec, tensors: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    drafter.write(directory)
    if tensors is None:
        tensors = {name: torch.zeros(shape) for name, shape in drafter.expected_tensors().items()}
        # every other target id (clamped: one case has a draft vocabulary larger than the target)
        chosen = torch.arange(0, 2 * drafter.draft_vocab_size, 2).clamp(max=drafter.vocab_size - 1)
        tensors["d2t"] = chosen - torch.arange(drafter.draft_vocab_size)
        t2d = torch.zeros(drafter.vocab_size, dtype=torch.bool)
        t2d[chosen] = True
        tensors["t2d"] = t2d
    save_file(tensors, str(directory / spec.WEIGHTS_FILE))
    return directory


@pytest.fixture
def drafter(tmp_path: Path) -> Path:
    return _write(tmp_path / "drafter", _spec())


def test_valid_drafter_has_no_problems(drafter: Path):
    assert spec.validate(drafter, TARGET) == []
    assert DrafterSpec.read(drafter).variant == "eagle3.1"


def test_round_trip_is_lossless_and_keeps_unknown_keys(tmp_path: Path):
    raw = _spec().model_dump(mode="json") | {"speculators_version": "0.9.0", "eagle_config": {}}
    (tmp_path / spec.CONFIG_FILE).write_text(json.dumps(raw))
    DrafterSpec.read(tmp_path).write(tmp_path)
    assert json.loads((tmp_path / spec.CONFIG_FILE).read_text()) == raw


def test_variants():
    assert _spec(fc_norm=False, norm_output=False).variant == "eagle3"
    assert _spec(norm_output=False).variant.startswith("custom")


def _problems(tmp_path: Path, drafter: DrafterSpec, target=TARGET, tensors=None) -> list[str]:
    return spec.validate(_write(tmp_path / "d", drafter, tensors), target)


@pytest.mark.parametrize(
    ("changes", "target_changes", "expected"),
    [
        ({"target_hidden_size": 32}, {}, "target_hidden_size: 32 but the target's hidden_size"),
        ({}, {"vocab_size": 1024}, "vocab_size: 512 but the target's vocab_size is 1024"),
        ({"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}, {}, "layer_ids.2: 6 is outside"),
        ({"norm_before_fc": True}, {}, "norm_before_fc: cannot be combined with fc_norm"),
        ({"architectures": ["LlamaForCausalLM"]}, {}, "architectures: must be"),
        ({"draft_vocab_size": 600}, {}, "draft_vocab_size: larger than vocab_size"),
    ],
)
def test_config_problems(tmp_path, changes, target_changes, expected):
    problems = _problems(tmp_path, _spec(**changes), TARGET | target_changes)
    assert any(expected in p for p in problems), problems


def test_variant_must_be_stated(tmp_path: Path, drafter: Path):
    raw = json.loads((drafter / spec.CONFIG_FILE).read_text())
    del raw["fc_norm"], raw["norm_before_residual"]
    (drafter / spec.CONFIG_FILE).write_text(json.dumps(raw))
    problems = spec.validate(drafter, TARGET)
    assert any("fc_norm: must be stated" in p for p in problems)
    assert any("norm_before_residual: must be stated" in p for p in problems)


def test_tensor_problems(tmp_path: Path):
    drafter = _spec()
    tensors = {name: torch.zeros(shape) for name, shape in drafter.expected_tensors().items()}
    del tensors["fc_norm.1.weight"]
    tensors["fc.weight"] = torch.zeros(64, 64)
    tensors["extra.weight"] = torch.zeros(3)
    problems = _problems(tmp_path, drafter, tensors=tensors)
    assert any("fc_norm.1.weight: missing" in p for p in problems)
    assert any("fc.weight: shape [64, 64], expected [64, 192]" in p for p in problems)
    assert any("extra.weight: unexpected tensor" in p for p in problems)


def _mapping(draft_to_target: torch.Tensor, t2d_ids: torch.Tensor) -> dict:
    drafter = _spec()
    tensors = {name: torch.zeros(shape) for name, shape in drafter.expected_tensors().items()}
    tensors["d2t"] = draft_to_target - torch.arange(100)
    t2d = torch.zeros(512, dtype=torch.bool)
    t2d[t2d_ids] = True
    tensors["t2d"] = t2d
    return tensors


@pytest.mark.parametrize(
    ("draft_to_target", "t2d_ids", "expected"),
    [
        (torch.arange(100).flip(0), torch.arange(100), "must be sorted and unique"),
        (torch.arange(450, 550), torch.arange(100), "outside the target vocabulary"),
        (torch.arange(100), torch.arange(1, 101), "t2d: does not mark exactly"),
    ],
)
def test_mapping_problems(tmp_path, draft_to_target, t2d_ids, expected):
    problems = _problems(tmp_path, _spec(), tensors=_mapping(draft_to_target, t2d_ids))
    assert any(expected in p for p in problems), problems


def test_config_refuses_pool_with_invalid_drafter(tmp_path: Path):
    target_dir = tmp_path / "target"
    target_dir.mkdir()
    (target_dir / spec.CONFIG_FILE).write_text(json.dumps(TARGET))
    _write(tmp_path / "good", _spec())
    _write(tmp_path / "bad", _spec(target_hidden_size=32))

    def config(drafter: str) -> dict:
        return {
            "targets": [{"id": "t", "source": "target"}],
            "pools": [
                {
                    "name": "spec",
                    "target": "t",
                    "role": "speculative",
                    "speculation": {
                        "method": "eagle3",
                        "drafter": drafter,
                        "num_speculative_tokens": 3,
                    },
                }
            ],
        }

    parse_config(config("good"), "c.yaml", tmp_path)
    with pytest.raises(ConfigError) as error:
        parse_config(config("bad"), "c.yaml", tmp_path)
    assert str(error.value).startswith("c.yaml: pools[0].speculation.drafter: ")
    assert "target_hidden_size: 32" in str(error.value)
    with pytest.raises(ConfigError, match=r"pools\[0\].speculation.drafter: missing: no such"):
        parse_config(config("missing"), "c.yaml", tmp_path)


def test_recipe_commands_reproduce_the_recorded_run():
    import shlex
    from dataclasses import asdict

    from cluster.cli import build_parser
    from cluster.drafters.data import DataRecipe
    from cluster.drafters.export import recipe_of
    from cluster.drafters.train import TrainConfig

    data_recipe = DataRecipe(code_long_contexts=(128, 256), chat_short=7, output_tokens=64)
    cfg = TrainConfig(variant="eagle3", steps=123, lr=3e-4, seed=5, bf16=False)
    run_info = {
        "data_recipes": [asdict(data_recipe)],
        "val_data_recipe": asdict(data_recipe.scaled(0.5)),
        "train": asdict(cfg),
    }
    recipe = recipe_of(run_info, step=120, name="d")
    assert recipe["data"]["validation"].endswith("60 prompts per context, 4 chat prompts")
    data_cmd, train_cmd, export_cmd = (shlex.split(c)[1:] for c in recipe["reproduce"])
    data_args, train_args = (
        build_parser().parse_args(data_cmd),
        build_parser().parse_args(train_cmd),
    )
    assert data_args.contexts == (128, 256) and data_args.chat == 7
    assert data_args.output_tokens == 64 and data_args.per_context == 120
    assert (data_args.out, data_args.val_out) == ("data/train-1", "data/val")
    assert (train_args.data, train_args.val) == (["data/train-1"], "data/val")
    assert (train_args.variant, train_args.steps, train_args.lr, train_args.seed) == (
        "eagle3",
        123,
        3e-4,
        5,
    )
    assert build_parser().parse_args(export_cmd).out == "drafters/d"
    assert recipe["exported_step"] == 120 and recipe["train"]["bf16"] is False


def test_recipe_of_a_continued_run_lists_the_base_run_first():
    import shlex
    from dataclasses import asdict

    from cluster.cli import build_parser
    from cluster.drafters.data import DataRecipe
    from cluster.drafters.export import recipe_of
    from cluster.drafters.train import TrainConfig

    first, further = asdict(DataRecipe()), asdict(DataRecipe(seed=1, output_tokens=256))
    base = {"data_recipes": [first], "train": asdict(TrainConfig(steps=150, bf16=False))}
    cfg = TrainConfig(steps=200, lr=1e-3, init_from="/somewhere/else", bf16=False)
    run_info = {
        "data_recipes": [first, further],
        "train": asdict(cfg),
        "init_from": {"run": "/somewhere/else", "step": 150} | base,
    }
    recipe = recipe_of(run_info, step=200, name="d")
    assert recipe["init_from_step"] == 150
    assert [s["dir"] for s in recipe["data"]["sets"]] == ["data/train-1", "data/train-2"]
    data_cmd, further_cmd, base_cmd, cont_cmd, _ = (
        build_parser().parse_args(shlex.split(c)[1:]) for c in recipe["reproduce"]
    )
    assert (data_cmd.out, data_cmd.seed, data_cmd.val_fraction) == ("data/train-1", 0, 0.08)
    assert (further_cmd.out, further_cmd.seed, further_cmd.output_tokens) == (
        "data/train-2",
        1,
        256,
    )
    assert further_cmd.val_fraction == 0  # the first set's validation set is reused
    assert (base_cmd.out, base_cmd.steps, base_cmd.init_from) == ("runs/d-base", 150, "")
    assert base_cmd.data == ["data/train-1"]
    assert (cont_cmd.out, cont_cmd.steps, cont_cmd.lr) == ("runs/d", 200, 1e-3)
    assert cont_cmd.data == ["data/train-1", "data/train-2"]
    assert cont_cmd.init_from == "runs/d-base"  # not the machine-specific path


def test_recipe_of_a_run_continued_from_a_shipped_drafter_starts_with_its_recipe():
    import shlex
    from dataclasses import asdict

    from cluster.cli import build_parser
    from cluster.drafters.data import DataRecipe
    from cluster.drafters.export import recipe_of
    from cluster.drafters.train import TrainConfig

    name = "smollm2-135m-instruct-eagle3"  # a prefix of the other shipped drafter's name
    shipped = yaml.safe_load((SHIPPED_DIR / f"{name}.1" / "recipe.yaml").read_text())
    shipped["reproduce"] = [c.replace(f"{name}.1", name) for c in shipped["reproduce"]]
    new_data = asdict(DataRecipe(seed=1, output_tokens=192))
    cfg = TrainConfig(steps=400, init_from=f"drafters/{name}", bf16=False)
    run_info = {
        "data_recipes": [new_data],
        "val_data_recipe": asdict(DataRecipe(seed=1).scaled(0.08)),
        "train": asdict(cfg),
        "init_from": {
            "drafter": f"drafters/{name}",
            "step": shipped["exported_step"],
            "recipe": shipped,
        },
    }
    recipe = recipe_of(run_info, step=400, name=name)
    assert recipe["continued_from"] == {"drafter": f"drafters/{name}", "recipe": shipped}
    assert recipe["init_from_step"] == shipped["exported_step"]
    commands = recipe["reproduce"]
    prior = len(shipped["reproduce"])
    # The shipped drafter's commands come first, each of its runs one `-base` deeper (this run
    # takes runs/NAME), ending with the export the new run starts from.
    assert commands[:prior] == [
        c.replace(f"runs/{name}", f"runs/{name}-base") for c in shipped["reproduce"]
    ]
    assert commands[prior - 1] == f"cluster drafters export runs/{name}-base --out drafters/{name}"
    # New data sets are numbered after the shipped recipe's.
    shipped_sets = sum(c.startswith("cluster drafters data ") for c in shipped["reproduce"])
    new_set, new_val = f"data/train-{shipped_sets + 1}", f"data/val-{shipped_sets + 1}"
    data_cmd, train_cmd, export_cmd = (
        build_parser().parse_args(shlex.split(c)[1:]) for c in commands[prior:]
    )
    assert (data_cmd.out, data_cmd.val_out, data_cmd.seed) == (new_set, new_val, 1)
    assert (train_cmd.out, train_cmd.data, train_cmd.val) == (f"runs/{name}", [new_set], new_val)
    assert (train_cmd.init_from, train_cmd.steps) == (f"drafters/{name}", 400)
    assert (export_cmd.run, export_cmd.out) == (f"runs/{name}", f"drafters/{name}")


@pytest.mark.parametrize("weight", [0, 1.5])
def test_train_config_refuses_a_prompt_loss_weight_out_of_range(weight: float):
    from cluster.drafters.train import TrainConfig

    with pytest.raises(ValueError, match=r"prompt_loss_weight: must be in \(0, 1\]"):
        TrainConfig(prompt_loss_weight=weight)


def test_eval_markdown_table_from_a_report():
    from cluster.drafters.evaluate import markdown

    def bucket(al, tok_s, positions=None, speedup=None):
        return {
            "requests": 6, "output_tokens": 200, "stopped_by_target": 2, "seconds": 1.0,
            "output_tokens_per_s": tok_s, "decode_tokens_per_s": 2 * tok_s,
            "mean_acceptance_length": al, "per_position_acceptance": positions,
            **({"speedup_vs_none": speedup} if speedup else {}),
            **({"decode_speedup_vs_none": speedup + 0.5} if speedup else {}),
        }  # fmt: skip

    report = {
        "workload": {"buckets": {"<512": 384, "512-2k": 1536}},
        "results": {
            "none": {"<512": bucket(None, 5.0), "512-2k": bucket(None, 4.0)},
            "eagle3.1": {
                "<512": bucket(2.4, 8.0, [0.7, 0.4], 1.6),
                "512-2k": bucket(2.2, 6.0, [0.6, 0.3], 1.5),
            },
            "eagle3": {
                "<512": bucket(2.0, 7.0, [0.6, 0.3], 1.4),
                "512-2k": bucket(1.1, 4.4, [0.1, 0.0], 1.1),
            },
        },
    }
    table = markdown(report)
    assert "| none | 1.00 | 1.00 | - | 5.0 | 4.0 | 10.0 | 8.0 |" in table
    assert (
        "| eagle3.1 | 2.40 | 2.20 | 0.60, 0.30 | 8.0 (x1.60) | 6.0 (x1.50) | 16.0 (x2.10) "
        "| 12.0 (x2.00) |" in table
    )
    assert "ratio: 1.20 (<512), 2.00 (512-2k)." in table
    assert "200 at <512 (2 of 6 responses ended by the target)" in table


def test_untrusted_drafter_may_hold_only_weights_config_and_tokenizer(tmp_path):
    from cluster.drafters.spec import untrusted_content

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert untrusted_content(tmp_path) == []
    (tmp_path / "modeling_evil.py").write_text("import os")
    (tmp_path / "extra.bin").write_bytes(b"pickle")
    (tmp_path / "config.json").write_text(json.dumps({"auto_map": {"AutoModel": "m.M"}}))
    problems = "\n".join(untrusted_content(tmp_path))
    assert "modeling_evil.py" in problems and "extra.bin" in problems and "auto_map" in problems
