"""The check that a converted entry loads in transformers (compressed-tensors decompressing it) with logits equal to
ascq's reference forward: shared by the converter and W4 tests."""

from __future__ import annotations

from pathlib import Path

import torch

from ascq.evaluate import eval_windows, load_eval_token_ids
from ascq.quantize.reference_forward import reference_logits


def assert_transformers_matches_reference(entry: Path, base_dir: Path, num_windows: int = 4) -> None:
    """On `num_windows` x 256 held-out tokens: max |logit diff| <= 1e-3 of the logit range, top-1 agreement >= 99 %."""
    from transformers import AutoModelForCausalLM

    ids = eval_windows(load_eval_token_ids(base_dir), 256)[:num_windows]
    model = AutoModelForCausalLM.from_pretrained(entry, dtype=torch.float32)
    with torch.no_grad():
        hf_logits = model(ids).logits
    ours = reference_logits(entry, ids)
    logit_range = (ours.max() - ours.min()).item()
    assert (hf_logits - ours).abs().max().item() <= 1e-3 * logit_range
    assert (hf_logits.argmax(-1) == ours.argmax(-1)).float().mean().item() >= 0.99
