"""The check that a converted entry loads in transformers (compressed-tensors decompressing it) with logits
equal to ascq's reference forward: shared by the converter and W4 tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ascq.evaluate import eval_windows, load_eval_token_ids
from ascq.quantize.reference_forward import reference_logits


def _max_diff_bound(entry: Path) -> tuple[float, bool]:
    """(max |diff| bound as a fraction of the logit range, whether the mean is bounded too), by the entry's
    scheme."""
    qconfig = json.loads((entry / "config.json").read_text())["quantization_config"]
    dynamic = any(
        (g.get("input_activations") or {}).get("dynamic") for g in qconfig["config_groups"].values()
    )
    if not dynamic:
        return 1e-3, False
    return (2e-2 if qconfig.get("kv_cache_scheme") is not None else 1e-2), True


def assert_transformers_matches_reference(entry: Path, base_dir: Path, num_windows: int = 4) -> None:
    """On `num_windows` x 256 held-out tokens: max |logit diff| <= 1e-3 of the logit range, top-1 agreement >=
    99 %.

    Dynamic per-token int8 activations are quantized by compressed-tensors' fake quantization in transformers
    with scale absmax / 127.5 and by ascq (and vLLM's kernels, the rule served) with absmax / 127: the two
    round some activations to neighbouring codes, so for those checkpoints the bound is 1e-3 of the range on
    the mean |diff| and 1e-2 on the max (2e-2 with an fp8 KV cache, whose codes flip the same way); the
    weights, read back by compressed-tensors, are compared exactly elsewhere (test_group_size_fit)."""
    from transformers import AutoModelForCausalLM

    ids = eval_windows(load_eval_token_ids(base_dir), 256)[:num_windows]
    model = AutoModelForCausalLM.from_pretrained(entry, dtype=torch.float32)
    with torch.no_grad():
        hf_logits = model(ids).logits
    ours = reference_logits(entry, ids)
    logit_range = (ours.max() - ours.min()).item()
    diff = (hf_logits - ours).abs()
    max_bound, bound_mean = _max_diff_bound(entry)
    if bound_mean:
        assert diff.mean().item() <= 1e-3 * logit_range
    assert diff.max().item() <= max_bound * logit_range
    assert (hf_logits.argmax(-1) == ours.argmax(-1)).float().mean().item() >= 0.99
