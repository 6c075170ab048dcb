"""Every `ASCQ_*` environment variable, declared once: its type, default and meaning (vLLM's `envs.py`). Other
modules read `envs.ASCQ_ZOO` and so on, never `os.environ` for an `ASCQ_*` name. Each read happens when
called, so a test's `monkeypatch.setenv` takes effect; a bad value is a one-line `AscqError` naming the
variable."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ascq.core.errors import AscqError


@dataclass(frozen=True)
class EnvVar:
    name: str
    doc: str
    parse: Callable[[str], Any]
    default: Any = None

    def get(self) -> Any:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise AscqError(f"{self.name}={raw!r}: {exc}") from None


def _switch(raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError("use 1 (on) or 0 (off)")
    return raw == "1"


def _mebibytes(raw: str) -> int:
    if not raw.strip().isdigit():
        raise ValueError("a whole number of MiB (0: none)")
    return int(raw)


def _activation_bits(raw: str) -> int:
    if raw not in ("8", "16"):
        raise ValueError("8 or 16")
    return int(raw)


def _lm_head_quant(raw: str) -> str:
    if raw != "int8":
        raise ValueError("the only value is int8 (unset: the bf16 head)")
    return raw


VARIABLES = {
    v.name: v
    for v in (
        EnvVar(
            "ASCQ_ZOO", "The zoo folder (default: the checkout's zoo/, else $XDG_DATA_HOME/ascq/zoo).", Path
        ),
        EnvVar(
            "ASCQ_CACHE_DIR",
            "Where the native CPU kernels are built and cached "
            "(default: $XDG_CACHE_HOME/ascq/kernels, ~/.cache/ascq/kernels).",
            Path,
        ),
        EnvVar(
            "ASCQ_NATIVE_KERNELS",
            "1: build and use the native CPU kernels (default); 0: torch's ops only.",
            _switch,
            True,
        ),
        EnvVar(
            "ASCQ_FUSED_DECODE",
            "1: pure decode steps of Llama-family models on the CPU run as one native call "
            "(default); 0: layer by layer.",
            _switch,
            True,
        ),
        EnvVar(
            "ASCQ_BF16_GEMM",
            "Force torch's bf16 GEMM paths on (1) or off (0); unset: detected from the CPU "
            "(AMX or AVX-512 BF16).",
            _switch,
        ),
        EnvVar(
            "ASCQ_BF16_WEIGHT_CACHE_MB",
            "MiB of bf16 weight copies the CPU backend may keep for linears on the "
            "bf16 GEMM path (0: none, dequantize per call).",
            _mebibytes,
            1024,
        ),
        EnvVar(
            "ASCQ_W4_ACTIVATION_BITS",
            "8 (default): the CPU's 4-bit weight-only products of 2 or more rows round activations to "
            "int8 per row and group (as vLLM's CPU AWQ/GPTQ path through IPEX does; about 1.5x faster on "
            "AVX2); 16: 16-bit fixed point.",
            _activation_bits,
            8,
        ),
        EnvVar(
            "ASCQ_LM_HEAD_QUANT",
            "int8: opt in to an int8 per-row copy of the LM head on the CPU (changes the "
            "logits); unset: bf16.",
            _lm_head_quant,
        ),
        EnvVar(
            "ASCQ_API_KEY",
            "API key `ascq serve` requires on /v1 routes when --api-key and $VLLM_API_KEY are unset.",
            str,
        ),
    )
}


def __getattr__(name: str) -> Any:
    """`envs.ASCQ_ZOO` etc.: the parsed value of a declared variable, its default when unset."""
    if name in VARIABLES:
        return VARIABLES[name].get()
    raise AttributeError(f"module 'ascq.envs' has no attribute {name!r}")
