"""An EAGLE 3 / 3.1 drafter as vLLM loads it (`LlamaForCausalLMEagle3`), and its validation.

A drafter directory holds `config.json` and `model.safetensors`. The tensor layout is the one
`vllm/model_executor/models/llama_eagle3.py` maps: `midlayer.*` (one decoder layer whose q/k/v
take `2 * hidden` inputs: the normed token embedding and the normed hidden state side by side),
`fc.weight` (fuses the captured target hidden states), `fc_norm.{i}.weight` (EAGLE 3.1),
`norm.weight`, `lm_head.weight` over the draft vocabulary, and `d2t` / `t2d` mapping draft ids to
target ids. Embeddings are omitted: vLLM shares the target's.

`validate(drafter, target)` returns one line per problem; no output means deployable. It only
reads headers and the two small mapping tensors (numpy, no torch), so config loading stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import safe_open

ARCHITECTURE = "LlamaForCausalLMEagle3"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
VARIANT_FLAGS = ("fc_norm", "norm_output")
"""Flags a drafter config must state explicitly: vLLM defaults them to false (EAGLE 3)."""


class DrafterSpec(BaseModel):
    """`config.json` of a drafter. Unknown keys are kept, so read + write is lossless."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    architectures: list[str] = Field(default_factory=lambda: [ARCHITECTURE])
    """vLLM picks the drafter class from this; must be `LlamaForCausalLMEagle3`."""
    model_type: str = "llama"
    """Hugging Face config type the drafter's decoder layer follows."""
    hidden_size: int = Field(gt=0)
    """Drafter width; equals the target's hidden size because embeddings are shared."""
    target_hidden_size: int = Field(gt=0)
    """Width of each captured target hidden state."""
    intermediate_size: int = Field(gt=0)
    """MLP width of the drafter's decoder layer."""
    num_attention_heads: int = Field(gt=0)
    """Query heads of the drafter's attention."""
    num_key_value_heads: int = Field(gt=0)
    """Key/value heads (grouped-query attention)."""
    head_dim: int = Field(gt=0)
    """Width of one attention head."""
    num_hidden_layers: int = Field(1, ge=1)
    """Decoder layers; EAGLE 3 uses one."""
    vocab_size: int = Field(gt=0)
    """Target vocabulary size (the embeddings the drafter shares)."""
    draft_vocab_size: int = Field(gt=0)
    """Tokens the drafter can propose: the most frequent target tokens."""
    eagle_aux_hidden_state_layer_ids: list[int] = Field(min_length=1)
    """Target layers whose *input* hidden states feed the drafter (HF `hidden_states[i]`)."""
    fc_norm: bool = False
    """EAGLE 3.1: one RMSNorm per captured hidden state before `fc`."""
    norm_output: bool = False
    """EAGLE 3.1: feed the post-norm output back into the next draft step."""
    norm_before_fc: bool = False
    """One RMSNorm over the whole concatenation before `fc` (not with `fc_norm`)."""
    norm_before_residual: bool = False
    """Normalize the hidden state before it becomes the residual (vLLM's default differs
    between plain and speculators-format configs, so it is always written)."""
    rms_norm_eps: float = Field(1e-5, gt=0)
    """RMSNorm epsilon."""
    hidden_act: str = "silu"
    """MLP activation."""
    max_position_embeddings: int = Field(8192, gt=0)
    """Longest position the rotary embedding is set up for."""
    rope_parameters: dict[str, Any] | None = None
    """Rotary embedding parameters, copied from the target."""
    tie_word_embeddings: bool = False
    """The drafter has its own `lm_head` over the draft vocabulary."""
    dtype: str = "bfloat16"
    """Dtype of the stored weights."""

    @property
    def variant(self) -> str:
        if self.fc_norm and self.norm_output:
            return "eagle3.1"
        if not self.fc_norm and not self.norm_output:
            return "eagle3"
        return f"custom (fc_norm={self.fc_norm}, norm_output={self.norm_output})"

    @classmethod
    def read(cls, drafter_dir: Path) -> DrafterSpec:
        return cls.model_validate(json.loads((Path(drafter_dir) / CONFIG_FILE).read_text()))

    def write(self, drafter_dir: Path) -> Path:
        path = Path(drafter_dir) / CONFIG_FILE
        data = self.model_dump(mode="json")
        path.write_text(json.dumps(data, indent=2) + "\n")
        return path

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor vLLM loads (embeddings optional, not listed)."""
        h, q = self.hidden_size, self.num_attention_heads * self.head_dim
        kv, inter = self.num_key_value_heads * self.head_dim, self.intermediate_size
        aux = len(self.eagle_aux_hidden_state_layer_ids)
        shapes: dict[str, tuple[int, ...]] = {
            "midlayer.self_attn.q_proj.weight": (q, 2 * h),
            "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
            "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
            "midlayer.self_attn.o_proj.weight": (h, q),
            "midlayer.mlp.gate_proj.weight": (inter, h),
            "midlayer.mlp.up_proj.weight": (inter, h),
            "midlayer.mlp.down_proj.weight": (h, inter),
            "midlayer.input_layernorm.weight": (h,),
            "midlayer.hidden_norm.weight": (h,),
            "midlayer.post_attention_layernorm.weight": (h,),
            "fc.weight": (h, aux * self.target_hidden_size),
            "norm.weight": (h,),
            "lm_head.weight": (self.draft_vocab_size, h),
            "t2d": (self.vocab_size,),
        }
        if self.draft_vocab_size != self.vocab_size:
            shapes["d2t"] = (self.draft_vocab_size,)
        if self.fc_norm:
            for i in range(aux):
                shapes[f"fc_norm.{i}.weight"] = (self.target_hidden_size,)
        if self.norm_before_fc:
            shapes["input_norm.weight"] = (aux * self.target_hidden_size,)
        return shapes


def _read_spec(drafter: Path) -> tuple[DrafterSpec | None, list[str]]:
    path = drafter / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except OSError as error:
        return None, [f"{path}: cannot read: {error.strerror}"]
    except json.JSONDecodeError as error:
        return None, [f"{path}: invalid JSON: {error}"]
    try:
        spec = DrafterSpec.model_validate(raw)
    except ValidationError as error:
        problems = []
        for e in error.errors():
            field = ".".join(str(part) for part in e["loc"]) or "(top level)"
            problems.append(f"{path}: {field}: {e['msg']}")
        return None, problems
    problems = [
        f"{path}: {flag}: must be stated (true for EAGLE 3.1, false for EAGLE 3)"
        for flag in (*VARIANT_FLAGS, "norm_before_residual")
        if flag not in raw
    ]
    return spec, problems


def _check_config(spec: DrafterSpec, where: Path) -> list[str]:
    problems = []
    if spec.architectures != [ARCHITECTURE]:
        problems.append(f"{where}: architectures: must be [{ARCHITECTURE!r}]")
    if spec.fc_norm and spec.norm_before_fc:
        problems.append(f"{where}: norm_before_fc: cannot be combined with fc_norm")
    if spec.draft_vocab_size > spec.vocab_size:
        problems.append(f"{where}: draft_vocab_size: larger than vocab_size ({spec.vocab_size})")
    if spec.num_hidden_layers != 1:
        problems.append(f"{where}: num_hidden_layers: the tensor layout has one midlayer")
    return problems


def _check_target(spec: DrafterSpec, target: dict[str, Any], where: Path) -> list[str]:
    problems = []
    layers = target.get("num_hidden_layers")
    for field, target_field in (
        ("target_hidden_size", "hidden_size"),
        ("hidden_size", "hidden_size"),
        ("vocab_size", "vocab_size"),
    ):
        if target.get(target_field) != getattr(spec, field):
            problems.append(
                f"{where}: {field}: {getattr(spec, field)} but the target's {target_field} "
                f"is {target.get(target_field)}"
            )
    if isinstance(layers, int):
        for i, layer in enumerate(spec.eagle_aux_hidden_state_layer_ids):
            if not 0 <= layer < layers:
                problems.append(
                    f"{where}: eagle_aux_hidden_state_layer_ids.{i}: {layer} is outside the "
                    f"target's layers 0..{layers - 1}"
                )
    return problems


def _check_tensors(spec: DrafterSpec, drafter: Path) -> list[str]:
    path = drafter / WEIGHTS_FILE
    if not path.is_file():
        return [f"{path}: missing"]
    problems = []
    expected = spec.expected_tensors()
    optional = {"embed_tokens.weight": (spec.vocab_size, spec.hidden_size)}
    with safe_open(str(path), framework="numpy") as f:
        names = set(f.keys())
        for name, shape in (expected | optional).items():
            if name not in names:
                if name in expected:
                    problems.append(f"{path}: {name}: missing (expected shape {list(shape)})")
                continue
            actual = tuple(f.get_slice(name).get_shape())
            if actual != shape:
                problems.append(f"{path}: {name}: shape {list(actual)}, expected {list(shape)}")
        for name in sorted(names - expected.keys() - optional.keys()):
            problems.append(f"{path}: {name}: unexpected tensor (vLLM would reject it)")
        if problems:
            return problems
        t2d = f.get_tensor("t2d")
        d2t = f.get_tensor("d2t") if "d2t" in names else np.zeros(spec.draft_vocab_size, np.int64)
    return problems + _check_mapping(spec, d2t, t2d, path)


def _check_mapping(spec: DrafterSpec, d2t: np.ndarray, t2d: np.ndarray, path: Path) -> list[str]:
    if t2d.dtype != np.bool_:
        return [f"{path}: t2d: dtype {t2d.dtype}, expected bool"]
    if d2t.dtype != np.int64:
        return [f"{path}: d2t: dtype {d2t.dtype}, expected int64"]
    targets = np.arange(spec.draft_vocab_size) + d2t
    problems = []
    if targets.min() < 0 or targets.max() >= spec.vocab_size:
        problems.append(f"{path}: d2t: maps draft ids outside the target vocabulary")
    elif np.any(np.diff(targets) <= 0):
        problems.append(f"{path}: d2t: target ids must be sorted and unique (id + d2t[id])")
    elif int(t2d.sum()) != spec.draft_vocab_size or not t2d[targets].all():
        problems.append(f"{path}: t2d: does not mark exactly the target ids that d2t maps to")
    return problems


def validate(drafter: Path, target_config: dict[str, Any] | None = None) -> list[str]:
    """Problems that would stop the drafter from loading or working with the target.

    `target_config` is the target's `config.json` (skipped checks when None)."""
    drafter = Path(drafter)
    spec, problems = _read_spec(drafter)
    if spec is None:
        return problems
    where = drafter / CONFIG_FILE
    problems += _check_config(spec, where)
    if target_config is not None:
        problems += _check_target(spec, target_config, where)
    return problems + _check_tensors(spec, drafter)


def read_target_config(target: Path) -> dict[str, Any]:
    """The target's `config.json` (a Hugging Face checkpoint directory)."""
    return json.loads((Path(target) / CONFIG_FILE).read_text())


SAFE_FILES = (
    "*.safetensors", "config.json", "generation_config.json", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "recipe.yaml", "metrics.json", "MANIFEST.json",
    "model.safetensors.index.json",
)  # fmt: skip
"""What a drafter from an untrusted source may contain: weights, configs, tokenizer, our notes."""


def untrusted_content(drafter: Path) -> list[str]:
    """Why a drafter from a source the config does not trust is refused: files that are not
    weights/config/tokenizer (pickles, Python), or an `auto_map` that loads remote code."""
    drafter = Path(drafter)
    problems = [
        f"{path}: not a safetensors, config or tokenizer file (trust_drafter_code allows it)"
        for path in sorted(drafter.rglob("*"))
        if path.is_file() and not any(path.match(pattern) for pattern in SAFE_FILES)
    ]
    config = drafter / CONFIG_FILE
    if config.is_file() and "auto_map" in json.loads(config.read_text()):
        problems.append(f"{config}: auto_map loads remote code (trust_drafter_code allows it)")
    return problems
