"""What an EAGLE 3 / 3.1 drafter is trained on and judged by (`train.py` runs it).

- Loss per TTT step `s`: cross-entropy of the drafter against the target's distribution over
  the draft vocabulary, at the positions whose target greedy token is in the draft vocabulary,
  weighted `0.8 ** s` (EAGLE 3's weighting).
- Validation: per-position accuracy (the drafter's top token is the target's greedy token) and
  an acceptance-length estimate `1 + sum_s P(steps 0..s all correct)` on response tokens of
  held-out samples, which is what vLLM measures when the drafter runs for real.
"""

from __future__ import annotations

import torch

from cluster.drafters import data
from cluster.drafters.model import Eagle3Drafter, StepOutput


def sample_loss(
    model: Eagle3Drafter,
    sample: data.Sample,
    ttt_steps: int,
    target_head: torch.Tensor,
    prompt_loss_weight: float = 1.0,
) -> tuple[torch.Tensor, list[tuple[int, int]], list[StepOutput], torch.Tensor]:
    """TTT loss of one sample; per position (correct, counted) and the step outputs.

    Every response anchor counts; each prompt anchor counts with probability
    `prompt_loss_weight` (drawn from torch's RNG), which weighs prompt positions that much in
    expectation while the unrolling skips the rest. At 1.0 every anchor counts and the outputs
    cover the whole sequence (validation)."""
    length = sample.input_ids.shape[0] - 1
    # Anchor i predicts token i + 1, a response token from anchor prompt_len - 1 on.
    prompt_anchors = min(length, max(0, sample.prompt_len - 1))
    anchors = None
    if prompt_loss_weight < 1 and prompt_anchors:
        kept = (torch.rand(prompt_anchors) < prompt_loss_weight).nonzero()[:, 0]
        anchors = torch.cat([kept, torch.arange(prompt_anchors, length)])
        if not len(anchors):  # a cropped all-prompt sample with none drawn
            anchors = torch.tensor([length - 1])
    outputs = model.unroll(sample.input_ids, sample.aux_hidden.float(), ttt_steps, anchors)
    rows = torch.arange(length) if anchors is None else anchors
    with torch.no_grad():
        # Anchor i at step s guesses token i + 2 + s: the target's distribution at position
        # i + 1 + s, i.e. row i + s of the shifted states. Only the rows some step needs.
        needed = torch.unique(torch.cat([rows + s for s in range(ttt_steps)]).clamp(max=length - 1))
        row_of = torch.full((length,), -1, dtype=torch.long)
        row_of[needed] = torch.arange(len(needed))
        logits = sample.final_hidden[1:][needed].float() @ target_head.T
        target_p = torch.softmax(logits.float(), dim=-1)
        target_top = target_p.argmax(-1)
        in_vocab = model.t2d[sample.target_greedy[1:][needed]].float()
    loss = torch.zeros(())
    counts = []
    for s, out in enumerate(outputs):
        # Anchors past the end at this depth have no target: zero weight.
        with torch.no_grad():
            valid = rows + s < length
            picked = row_of[(rows + s).clamp(max=length - 1)]
            mask = in_vocab[picked] * valid
        counted = int(mask.sum())
        if counted == 0:
            counts.append((0, 0))
            continue
        logp = torch.log_softmax(out.logits, dim=-1, dtype=torch.float32)
        per_anchor = -(target_p[picked] * logp).sum(-1)
        loss = loss + (0.8**s) * (per_anchor * mask).sum() / mask.sum()
        with torch.no_grad():
            hits = (out.logits.argmax(-1) == target_top[picked]).float() * mask
        counts.append((int(hits.sum()), counted))
    return loss, counts, outputs, sample.target_greedy[1:]


@torch.no_grad()
def validate(
    model: Eagle3Drafter,
    val_samples: list[data.Sample],
    ttt_steps: int,
    target_head: torch.Tensor,
    bf16: bool,
) -> dict:
    """Loss, per-position accuracy, and acceptance-length estimate on held-out samples."""
    model.eval()
    losses, correct, counted = [], [0] * ttt_steps, [0] * ttt_steps
    chain_hits = torch.zeros(ttt_steps)
    anchors_total = 0
    for sample in val_samples:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, counts, outputs, greedy = sample_loss(model, sample, ttt_steps, target_head)
        losses.append(float(loss))
        for s, (c, n) in enumerate(counts):
            correct[s] += c
            counted[s] += n
        # Chain acceptance on response anchors (there the text is the target's greedy output).
        anchors = sample.input_ids.shape[0] - 1
        first = max(0, sample.prompt_len - 1)
        usable = anchors - ttt_steps - first
        if usable <= 0:
            continue
        alive = torch.ones(usable, dtype=torch.bool)
        for s, out in enumerate(outputs):
            drafted = model.draft_to_target[out.logits[first : first + usable].argmax(-1)]
            alive &= drafted == greedy[first + s : first + s + usable]
            chain_hits[s] += alive.sum()
        anchors_total += usable
    model.train()
    return {
        "val_loss": sum(losses) / max(1, len(losses)),
        "val_accuracy": [c / max(1, n) for c, n in zip(correct, counted, strict=True)],
        "val_acceptance_estimate": 1 + float(chain_hits.sum()) / max(1, anchors_total),
        # Comparable with vLLM's per-position acceptance (`cluster drafters eval`).
        "val_acceptance_per_position": (chain_hits / max(1, anchors_total)).tolist(),
    }
