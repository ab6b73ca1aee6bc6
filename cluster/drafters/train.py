"""Training an EAGLE 3 / 3.1 drafter on captured target states (see `data.py`).

- Draft vocabulary: the `draft_vocab_size` most frequent tokens of the training data (target
  greedy tokens and input tokens), sorted by target id; `d2t = draft_to_target - arange`.
- Loss and validation: `objective.py` (EAGLE 3's TTT loss; per-position accuracy and an
  acceptance-length estimate on held-out samples).
- Where the budget goes: the drafter only ever drafts after the prompt, on the target's own
  greedy text, yet prompts are ~90% of the captured tokens. So each sample keeps only the last
  `prompt_context_tokens` of its prompt (enough context to attend to) and prompt positions count
  `prompt_loss_weight` as much as response positions, by training on that fraction of them:
  the unrolling skips the others (`Eagle3Drafter.unroll(anchors=...)`), about 4x less compute
  per sample than weighting every position.
- `checkpoint.pt` (model, optimizer, step, data position, RNG) is written every
  `checkpoint_every` steps and at the end; a run with the same output directory resumes.
  `init_from` starts a new run from another run's weights instead (continued training).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file
from tqdm import tqdm

from cluster.drafters import data
from cluster.drafters.hardware import cpu_has_bf16
from cluster.drafters.model import Eagle3Drafter
from cluster.drafters.objective import sample_loss, validate
from cluster.drafters.spec import WEIGHTS_FILE, DrafterSpec

CHECKPOINT = "checkpoint.pt"
HISTORY = "history.jsonl"
RUN_INFO = "run.json"
VARIANTS = ("eagle3.1", "eagle3")


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one training run (recorded in the drafter's recipe)."""

    variant: str = "eagle3.1"
    """`eagle3.1` (fc_norm + norm_output) or `eagle3` (neither)."""
    steps: int = 1000
    """Optimizer steps."""
    ttt_steps: int = 5
    """Draft steps unrolled per sample (training-time test)."""
    tokens_per_step: int = 4096
    """Tokens per optimizer step (samples are accumulated until this many)."""
    max_sample_tokens: int = 2048
    """Longer samples are cropped to a random window of this many tokens."""
    prompt_context_tokens: int = 512
    """Prompt tokens kept before each response (0: the whole prompt). Shorter context means
    more responses per step; the drafter still attends over that much prompt."""
    prompt_loss_weight: float = 0.1
    """Loss weight of a prompt position relative to a response position (where the drafter
    actually drafts), in (0, 1]: each step trains on that fraction of the prompt positions,
    drawn at random."""
    draft_vocab_size: int = 8192
    """Tokens the drafter can propose."""
    lr: float = 6e-4
    """Peak learning rate (AdamW), after a linear warm-up; cosine decay to 10%."""
    warmup_steps: int = 40
    """Linear warm-up steps."""
    grad_clip: float = 0.5
    """Gradient norm clip."""
    seed: int = 0
    """Seed of initialization and data order."""
    threads: int = 0
    """Torch CPU threads (0: torch's default)."""
    bf16: bool = field(default_factory=cpu_has_bf16)
    """Autocast matmuls to bfloat16. Default: only on CPUs with AMX or AVX-512 BF16; without
    them bf16 matmuls are emulated (measured here: 4x slower than float32)."""
    checkpoint_every: int = 50
    """Steps between checkpoints (and validation)."""
    val_samples: int = 48
    """Held-out samples used by validation."""
    init_from: str = ""
    """Run directory or exported drafter directory to start from: its weights and draft
    vocabulary, with a fresh optimizer, schedule and data order (to continue a run, or a
    shipped drafter, on more data or for more steps). Empty: random initialization."""

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant: {self.variant!r} is not one of {', '.join(VARIANTS)}")
        if not 0 < self.prompt_loss_weight <= 1:  # a fraction of the prompt positions
            raise ValueError(
                f"prompt_loss_weight: must be in (0, 1], got {self.prompt_loss_weight}"
            )


def drafter_spec(target_config: dict, aux_layer_ids: list[int], cfg: TrainConfig) -> DrafterSpec:
    heads = target_config["num_attention_heads"]
    return DrafterSpec(
        hidden_size=target_config["hidden_size"],
        target_hidden_size=target_config["hidden_size"],
        intermediate_size=target_config["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=target_config.get("num_key_value_heads", heads),
        head_dim=target_config.get("head_dim", target_config["hidden_size"] // heads),
        vocab_size=target_config["vocab_size"],
        draft_vocab_size=cfg.draft_vocab_size,
        eagle_aux_hidden_state_layer_ids=list(aux_layer_ids),
        fc_norm=cfg.variant == "eagle3.1",
        norm_output=cfg.variant == "eagle3.1",
        norm_before_fc=False,
        norm_before_residual=False,
        rms_norm_eps=target_config.get("rms_norm_eps", 1e-5),
        max_position_embeddings=target_config.get("max_position_embeddings", 8192),
        rope_parameters=target_config.get("rope_parameters")
        or {"rope_type": "default", "rope_theta": target_config.get("rope_theta", 10000.0)},
    )


def draft_vocabulary(shards: list[Path], size: int) -> torch.Tensor:
    """The `size` most frequent target ids in the data, sorted (ties broken by id)."""
    counts: Counter[int] = Counter()
    for shard in shards:
        t = load_file(str(shard))
        counts.update(t["target_greedy"].tolist())
        counts.update(t["input_ids"].tolist())
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]
    chosen = {token for token, _ in ranked}
    # Tiny data sets: fill up with the lowest unseen ids so the size stays as configured.
    filler = (t for t in range(size * 2) if t not in chosen)
    while len(chosen) < size:
        chosen.add(next(filler))
    return torch.tensor(sorted(chosen), dtype=torch.long)


def load_target_embeddings(target: Path) -> tuple[dict, torch.Tensor]:
    from safetensors import safe_open

    config = json.loads((target / "config.json").read_text())
    with safe_open(str(target / "model.safetensors"), framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    return config, embed.float()


def _crop(sample: data.Sample, cfg: TrainConfig, rng: random.Random) -> data.Sample:
    """At most `prompt_context_tokens` of prompt, then a random window of `max_sample_tokens`."""
    length = sample.input_ids.shape[0]
    first = 0
    if cfg.prompt_context_tokens:
        first = max(0, sample.prompt_len - cfg.prompt_context_tokens)
    if length - first > cfg.max_sample_tokens:
        first = rng.randrange(first, length - cfg.max_sample_tokens + 1)
    window = slice(first, first + cfg.max_sample_tokens)
    return data.Sample(
        input_ids=sample.input_ids[window],
        aux_hidden=sample.aux_hidden[window],
        final_hidden=sample.final_hidden[window],
        target_greedy=sample.target_greedy[window],
        prompt_len=max(0, sample.prompt_len - first),
    )


def _lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


class _SampleStream:
    """Samples in a seeded order: shards shuffled per epoch, samples shuffled within a shard
    (one shard in memory at a time). `position` counts samples consumed, for resume."""

    def __init__(self, shards: list[Path], seed: int, position: int = 0) -> None:
        self.shards = shards
        self.seed = seed
        self.position = 0
        self._iter = self._generate()
        for _ in range(position):
            next(self._iter)

    def _generate(self):
        epoch = 0
        while True:
            rng = random.Random(self.seed * 1000 + epoch)
            order = self.shards[:]
            rng.shuffle(order)
            for shard in order:
                samples = list(data.samples_of_shard(shard))
                rng.shuffle(samples)
                for sample in samples:
                    self.position += 1
                    yield sample
            epoch += 1

    def __next__(self) -> data.Sample:
        return next(self._iter)


def train(
    target: Path, datasets: list[Path], val_dataset: Path, out: Path, cfg: TrainConfig
) -> dict:
    """Train (or resume) into `out` on the shards of all `datasets`; returns the final
    validation metrics."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out.mkdir(parents=True, exist_ok=True)
    target_config, embed = load_target_embeddings(target)
    infos = [json.loads((d / data.DATASET_INFO).read_text()) for d in datasets]
    aux_layer_ids = {tuple(info["aux_layer_ids"]) for info in infos}
    if len(aux_layer_ids) != 1:
        raise ValueError(f"datasets captured different aux layers {sorted(aux_layer_ids)}")
    spec = drafter_spec(target_config, infos[0]["aux_layer_ids"], cfg)
    spec.write(out)  # the exported config.json, known before training starts
    val_info = json.loads((val_dataset / data.DATASET_INFO).read_text())
    shards = [shard for d in datasets for shard in data.shards_of(d)]
    run_info = {
        "data_recipes": [info["recipe"] for info in infos],
        "val_data_recipe": val_info["recipe"],
        "train": asdict(cfg),
    }
    model = Eagle3Drafter(spec, embed)
    checkpoint_path = out / CHECKPOINT
    if cfg.init_from:
        # A resumed run's own checkpoint replaces the source weights: keep what it recorded.
        run_info["init_from"] = (
            json.loads((out / RUN_INFO).read_text())["init_from"]
            if checkpoint_path.exists()
            else _init_from(model, Path(cfg.init_from), cfg)
        )
    (out / RUN_INFO).write_text(json.dumps(run_info, indent=2) + "\n")  # becomes recipe.yaml
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0
    )
    if checkpoint_path.exists():
        state = torch.load(checkpoint_path, weights_only=True)
        if state["config"] != asdict(cfg):
            raise ValueError(f"{checkpoint_path}: written with a different config; use a new --out")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, position = state["step"], state["position"]
        torch.set_rng_state(state["torch_rng"])
        crop_rng = random.Random()
        crop_rng.setstate(state["crop_rng"])
        _keep_history_until(out / HISTORY, step)
    else:
        if not cfg.init_from:
            model.init_weights(draft_vocabulary(shards, cfg.draft_vocab_size), cfg.seed)
        step, position, crop_rng = 0, 0, random.Random(cfg.seed)
        (out / HISTORY).write_text("")
    target_head = embed[model.draft_to_target]  # tied target lm_head, draft rows only
    stream = _SampleStream(shards, cfg.seed, position)
    val_samples = list(data.samples(val_dataset))[: cfg.val_samples]
    metrics: dict = {}
    model.train()
    started = time.monotonic()
    with tqdm(total=cfg.steps, initial=step, desc=f"train {cfg.variant}", unit="step") as bar:
        while step < cfg.steps:
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(step, cfg)
            tokens, loss_sum, correct, counted = 0, 0.0, [0] * cfg.ttt_steps, [0] * cfg.ttt_steps
            optimizer.zero_grad(set_to_none=True)
            while tokens < cfg.tokens_per_step:
                sample = _crop(next(stream), cfg, crop_rng)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
                    loss, counts, _, _ = sample_loss(
                        model, sample, cfg.ttt_steps, target_head, cfg.prompt_loss_weight
                    )
                weight = sample.input_ids.shape[0] / cfg.tokens_per_step
                (loss * weight).backward()
                tokens += sample.input_ids.shape[0]
                loss_sum += loss.item() * weight
                for s, (c, n) in enumerate(counts):
                    correct[s] += c
                    counted[s] += n
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            step += 1
            accuracy = [c / max(1, n) for c, n in zip(correct, counted, strict=True)]
            bar.update(1)
            bar.set_postfix(loss=f"{loss_sum:.3f}", acc="/".join(f"{a:.2f}" for a in accuracy))
            record = {"step": step, "loss": loss_sum, "accuracy": accuracy, "tokens": tokens}
            if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                metrics = validate(model, val_samples, cfg.ttt_steps, target_head, cfg.bf16)
                record |= metrics
                bar.write(
                    f"step {step}: val_loss {metrics['val_loss']:.3f} acceptance estimate "
                    f"{metrics['val_acceptance_estimate']:.2f} ({time.monotonic() - started:.0f}s)"
                )
                _save_checkpoint(checkpoint_path, model, optimizer, step, stream, crop_rng, cfg)
            with (out / HISTORY).open("a") as f:
                f.write(json.dumps(record) + "\n")
    return metrics


def _keep_history_until(path: Path, step: int) -> None:
    """Drop the records of steps after the checkpoint: the resumed run replays them."""
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    path.write_text("".join(line for line in lines if json.loads(line)["step"] <= step))


def _init_from(model: Eagle3Drafter, source: Path, cfg: TrainConfig) -> dict:
    """Load `source`'s final weights into `model`; returns what the recipe records of it.

    `source` is a run directory (its checkpoint) or an exported drafter directory
    (`config.json` + `model.safetensors`, e.g. a shipped drafter: its `recipe.yaml` is kept)."""
    if (source / CHECKPOINT).is_file():
        state = torch.load(source / CHECKPOINT, weights_only=True)
        _check_same(source, state["config"], cfg)
        model.load_state_dict(state["model"])
        source_info = json.loads((source / RUN_INFO).read_text())
        return {"run": str(source), "step": state["step"]} | source_info
    if not (source / WEIGHTS_FILE).is_file():
        raise ValueError(f"init_from: {source} has neither {CHECKPOINT} nor {WEIGHTS_FILE}")
    source_spec = DrafterSpec.read(source)
    _check_same(
        source,
        {"variant": source_spec.variant, "draft_vocab_size": source_spec.draft_vocab_size},
        cfg,
    )
    model.load_state_dict(load_file(str(source / WEIGHTS_FILE)))  # bf16 -> the model's dtype
    recipe_file = source / "recipe.yaml"
    recipe = yaml.safe_load(recipe_file.read_text()) if recipe_file.is_file() else {}
    return {"drafter": str(source), "step": recipe.get("exported_step"), "recipe": recipe}


def _check_same(source: Path, source_config: dict, cfg: TrainConfig) -> None:
    for field_name in ("variant", "draft_vocab_size"):
        if source_config[field_name] != getattr(cfg, field_name):
            raise ValueError(
                f"init_from: {source} has {field_name} {source_config[field_name]!r}, "
                f"this run {getattr(cfg, field_name)!r}"
            )


def _save_checkpoint(path, model, optimizer, step, stream, crop_rng, cfg) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": step,
            "position": stream.position,
            "torch_rng": torch.get_rng_state(),
            "crop_rng": crop_rng.getstate(),
            "config": asdict(cfg),
        },
        tmp,
    )
    tmp.rename(path)
