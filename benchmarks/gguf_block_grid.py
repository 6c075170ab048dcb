"""Why int4 re-quantization of a GGUF Q4_1 import loses quality, as plain round-to-nearest variants (issue
13).

SmolLM2's zoo entry holds the GGUF's Q4_1 values dequantized: every 32-column block is `d·k + m`, k in 0..15,
with its own float scale d and float min m. This scores (transformers, fp32, the first `--windows` windows of
512 tokens of GPL-3) the model with every linear but lm_head fake-quantized in place by:
- rtnG: ascq's int4 asymmetric min-max round-to-nearest (`observer.fake_quantize_weight`, integer zero point),
  group G;
- fzpG: the same with a float zero point (min + scale·q, the Q4_1 form), group G;
- mseG: integer zero point, (scale, zero point) searched per group for the smallest weight MSE.

    OMP_NUM_THREADS=1 python benchmarks/gguf_block_grid.py --model zoo/smollm2-135m-instruct \\
        rtn64 rtn32 fzp32 fzp64
"""

from __future__ import annotations

import argparse

import torch
from compressed_tensors.quantization import QuantizationArgs

from ascq.evaluate import load_eval_token_ids, perplexity
from ascq.quantize import observer

EVAL_TEXT = "/usr/share/common-licenses/GPL-3"


def float_zero_point(w: torch.Tensor, group: int) -> torch.Tensor:
    g = w.view(w.shape[0], -1, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    step = ((hi - lo) / 15).clamp(min=1e-12)
    return ((g - lo) / step).round().clamp(0, 15).mul(step).add(lo).view_as(w)


def mse_integer_zero_point(w: torch.Tensor, group: int) -> torch.Tensor:
    g = w.view(w.shape[0], -1, group)
    lo, hi = g.amin(-1), g.amax(-1)
    best, best_err = None, None
    for factor in torch.linspace(0.80, 1.10, 31):
        scale = ((hi - lo) / 15 * factor).clamp(min=1e-12)
        for shift in (-1, 0, 1):
            zero = ((-8 - lo / scale).round() + shift).clamp(-8, 7)
            deq = ((g / scale[..., None] + zero[..., None]).round().clamp(-8, 7) - zero[..., None]) * scale[
                ..., None
            ]
            err = (deq - g).pow(2).sum(-1)
            if best is None:
                best, best_err = deq, err
            else:
                better = err < best_err
                best, best_err = torch.where(better[..., None], deq, best), torch.where(better, err, best_err)
    return best.view_as(w)


def variant(name: str):
    kind, group = name[:3], int(name[3:])
    if kind == "rtn":
        args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=group)
        return lambda w: observer.fake_quantize_weight(w, args)
    search = {"fzp": float_zero_point, "mse": mse_integer_zero_point}[kind]
    return lambda w: search(w, group)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="zoo/smollm2-135m-instruct")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("variants", nargs="+", help="rtnG, fzpG, mseG (G: group size)")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    ids = load_eval_token_ids(args.model, EVAL_TEXT)[: args.windows * 512]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    original = {n: m.weight.data.clone() for n, m in linears.items()}

    def score() -> float:
        with torch.no_grad():
            return perplexity(lambda b: model(b).logits, ids, seq_len=512, batch_size=1)

    print(f"FP {score():.3f}", flush=True)
    for name in args.variants:
        quantize = variant(name)
        for n, m in linears.items():
            m.weight.data = quantize(original[n])
        print(f"{name} {score():.3f}", flush=True)


if __name__ == "__main__":
    main()
