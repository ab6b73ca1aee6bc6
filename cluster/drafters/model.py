"""The EAGLE 3 / 3.1 drafter in plain PyTorch, for training, computing what vLLM computes.

Parameter names are vLLM's checkpoint names (`midlayer.*`, `fc.*`, `fc_norm.*`, `norm.*`,
`lm_head.*`, `d2t`, `t2d`), so export is a filter of the state dict. The forward mirrors
`vllm/model_executor/models/llama_eagle3.py`:

    h0      = fc(concat(fc_norm_i(aux_i)))                # first step: target hidden states
    x       = concat(input_layernorm(embed(token)), hidden_norm(h))
    r       = h + o_proj(attn(x))                         # residual is the raw h
    pre     = r + mlp(post_attention_layernorm(r))
    logits  = lm_head(norm(pre))
    h_next  = norm(pre) if norm_output else pre           # EAGLE 3.1 feeds back post-norm

Training-time test (TTT) unrolls `steps` draft steps over a whole sequence at once. Index `i`
is an anchor: at step `s` it holds the drafter's guess for token `i + 2 + s`, at rotary
position `i + s`, attending to the step-0 keys of positions `<= i` (the context the target
verified) plus its own keys of steps `1..s` at the same anchor (its earlier drafts), which is
exactly what vLLM's KV cache holds when it drafts `s` tokens deep.

`anchors` restricts the unrolling to some anchors (training computes the loss at a sample of
them): step 0 still computes keys and values at every position (the context every anchor
attends to), but queries, MLP and `lm_head` only at the anchors, and later steps only there.
The outputs at those anchors are exactly those of the full unrolling.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cluster.drafters.spec import DrafterSpec


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.heads, self.kv_heads, self.head_dim = (
            spec.num_attention_heads,
            spec.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(2 * h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        theta = (spec.rope_parameters or {}).get("rope_theta", 10000.0)
        inv_freq = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, d/2]
        cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
        x1, x2 = x[..., : self.head_dim // 2], x[..., self.head_dim // 2 :]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(
        self,
        x: torch.Tensor,
        step: int,
        cache: list[tuple[torch.Tensor, torch.Tensor]],
        anchors: torch.Tensor | None,
        context_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention output at the anchors (every position when `anchors` is None).

        `x`: [T, 2H] inputs at every position for step 0, [N, 2H] at the anchors for later
        steps; `cache` holds (k, v) of earlier steps; `context_mask` is the additive
        [N, T] mask of the step-0 keys an anchor sees (None: causal over every position)."""
        rows = x.shape[0]
        positions = torch.arange(rows) if anchors is None or step == 0 else anchors
        k = self._rotate(self.k_proj(x).view(rows, self.kv_heads, self.head_dim), positions + step)
        v = self.v_proj(x).view(rows, self.kv_heads, self.head_dim)
        if step == 0 and anchors is not None:
            x, positions = x[anchors], anchors
        q = self.q_proj(x).view(x.shape[0], self.heads, self.head_dim)
        q = self._rotate(q, positions + step)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        cache.append((k, v))
        k0, v0 = (t.transpose(0, 1) for t in cache[0])  # [heads, T, d]
        if step == 0:  # no earlier drafts: plain masked attention (a fused kernel)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1),
                k0,
                v0,
                attn_mask=None if context_mask is None else context_mask.to(q.dtype),
                is_causal=context_mask is None,
            )
            return self.o_proj(out.transpose(0, 1).reshape(q.shape[0], -1))
        q = q.transpose(0, 1) / math.sqrt(self.head_dim)
        if context_mask is None:
            context_mask = _causal_mask(q.shape[1], q.dtype)
        # Context keys (step 0) under the mask, added inside the matmul.
        scores = [torch.baddbmm(context_mask.to(q.dtype), q, k0.transpose(1, 2))]
        # Earlier drafts at the same anchor: one score each (the diagonal of the TTT mask).
        scores += [(q * ks.transpose(0, 1)).sum(-1, keepdim=True) for ks, _ in cache[1:]]
        probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
        # split, not slicing: its backward concatenates instead of zero-filling full copies.
        context_probs, *draft_probs = probs.split([k0.shape[1]] + [1] * (len(cache) - 1), dim=-1)
        out = context_probs @ v0
        for p, (_, vs) in zip(draft_probs, cache[1:], strict=True):
            out = out + p * vs.transpose(0, 1)
        return self.o_proj(out.transpose(0, 1).reshape(q.shape[1], -1))


@functools.lru_cache(maxsize=4)
def _causal_mask(length: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((length, length), float("-inf"), dtype=dtype).triu(1)


class MLP(nn.Module):
    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        h, inter = spec.hidden_size, spec.intermediate_size
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        eps = spec.rms_norm_eps
        self.input_layernorm = RMSNorm(spec.hidden_size, eps)
        self.hidden_norm = RMSNorm(spec.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps)
        self.self_attn = Attention(spec)
        self.mlp = MLP(spec)
        self.norm_before_residual = spec.norm_before_residual

    def forward(self, embeds, hidden, step, cache, anchors, context_mask) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        if step == 0 and anchors is not None:  # every position feeds keys, anchors go on
            residual = residual[anchors]
        residual = residual + self.self_attn(x, step, cache, anchors, context_mask)
        return residual + self.mlp(self.post_attention_layernorm(residual))


@dataclass
class StepOutput:
    logits: torch.Tensor  # [T, draft_vocab]
    hidden: torch.Tensor  # [T, H], fed into the next step


class Eagle3Drafter(nn.Module):
    def __init__(self, spec: DrafterSpec, embed_tokens: torch.Tensor) -> None:
        super().__init__()
        self.spec = spec
        aux, th, h = (
            len(spec.eagle_aux_hidden_state_layer_ids),
            spec.target_hidden_size,
            (spec.hidden_size),
        )
        # Frozen and shared with the target; never exported.
        self.register_buffer("embed_tokens", embed_tokens.detach().clone(), persistent=False)
        if spec.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(th, spec.rms_norm_eps) for _ in range(aux))
        if spec.norm_before_fc:
            self.input_norm = RMSNorm(aux * th, spec.rms_norm_eps)
        self.fc = nn.Linear(aux * th, h, bias=False)
        self.midlayer = MidLayer(spec)
        self.norm = RMSNorm(h, spec.rms_norm_eps)
        self.lm_head = nn.Linear(h, spec.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(spec.vocab_size, dtype=torch.bool))

    def init_weights(self, draft_to_target: torch.Tensor, seed: int) -> None:
        """Random decoder layer, `lm_head` from the target's (tied) embedding rows."""
        generator = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("weight") and param.dim() == 2:
                with torch.no_grad():
                    param.normal_(0.0, 0.02, generator=generator)
        with torch.no_grad():
            self.lm_head.weight.copy_(self.embed_tokens[draft_to_target])
            self.d2t.copy_(draft_to_target - torch.arange(len(draft_to_target)))
            self.t2d.zero_()
            self.t2d[draft_to_target] = True

    @property
    def draft_to_target(self) -> torch.Tensor:
        return self.d2t + torch.arange(len(self.d2t))

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[T, A, H_target] captured states -> [T, H] first-step hidden input."""
        if self.spec.fc_norm:
            aux_hidden = torch.stack(
                [norm(aux_hidden[:, i]) for i, norm in enumerate(self.fc_norm)], dim=1
            )
        flat = aux_hidden.flatten(1)
        if self.spec.norm_before_fc:
            flat = self.input_norm(flat)
        return self.fc(flat)

    def unroll(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        steps: int,
        anchors: torch.Tensor | None = None,
    ) -> list[StepOutput]:
        """TTT over one sequence of T tokens: `steps` outputs at each of the sorted `anchors`
        (default: all T - 1)."""
        length = input_ids.shape[0] - 1
        hidden = self.fuse(aux_hidden[:length])
        padded = torch.cat([input_ids, input_ids.new_zeros(steps)])
        rows = torch.arange(length) if anchors is None else anchors
        context_mask = None
        if anchors is not None:
            context_mask = torch.zeros(len(anchors), length).masked_fill(
                torch.arange(length)[None, :] > anchors[:, None], float("-inf")
            )
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        outputs = []
        for step in range(steps):
            # Step 0 reads every position (context keys); later steps only the anchors.
            tokens = padded[1 : 1 + length] if step == 0 else padded[1 + step + rows]
            embeds = self.embed_tokens[tokens]
            pre = self.midlayer(embeds, hidden, step, cache, anchors, context_mask)
            post = self.norm(pre)
            outputs.append(StepOutput(self.lm_head(post), post if self.spec.norm_output else pre))
            hidden = outputs[-1].hidden
        return outputs
