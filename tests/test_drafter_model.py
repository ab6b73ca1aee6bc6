"""The drafter's TTT unrolling at a subset of anchors computes exactly what the full unrolling
computes there (training relies on it to skip most prompt positions)."""

from __future__ import annotations

import torch

from cluster.drafters.model import Eagle3Drafter
from cluster.drafters.train import TrainConfig, drafter_spec

TINY_TARGET = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
}


def _drafter(variant: str) -> Eagle3Drafter:
    cfg = TrainConfig(variant=variant, draft_vocab_size=40, bf16=False)
    spec = drafter_spec(TINY_TARGET, [0, 1, 2], cfg)
    model = Eagle3Drafter(spec, torch.randn(100, 32, generator=torch.Generator().manual_seed(1)))
    model.init_weights(torch.arange(0, 80, 2), seed=3)
    return model


def test_unroll_at_anchors_matches_the_full_unroll():
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 100, (23,), generator=generator)
    aux = torch.randn(23, 3, 32, generator=generator)
    anchors = torch.tensor([0, 3, 4, 9, 15, 20, 21])
    for variant in ("eagle3.1", "eagle3"):
        model = _drafter(variant)
        full = model.unroll(input_ids, aux, steps=4)
        part = model.unroll(input_ids, aux, steps=4, anchors=anchors)
        assert len(part) == 4
        for s, (f, p) in enumerate(zip(full, part, strict=True)):
            assert p.logits.shape == (len(anchors), 40)
            torch.testing.assert_close(p.logits, f.logits[anchors], msg=f"{variant} step {s}")
            torch.testing.assert_close(p.hidden, f.hidden[anchors])


def test_gradients_at_anchors_match_the_full_unroll():
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 100, (17,), generator=generator)
    aux = torch.randn(17, 3, 32, generator=generator)
    anchors = torch.tensor([2, 5, 6, 13])
    model = _drafter("eagle3.1")
    grads = []
    for use in (None, anchors):
        model.zero_grad()
        outputs = model.unroll(input_ids, aux, steps=3, anchors=use)
        picked = [o.logits if use is not None else o.logits[anchors] for o in outputs]
        sum(p.square().sum() for p in picked).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)
