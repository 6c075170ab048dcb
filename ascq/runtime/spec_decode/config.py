"""vLLM's `speculative_config` dict, validated: `{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4, "prompt_lookup_min": 2}` or `{"method": "draft_model", "model": "zoo/NAME",
"num_speculative_tokens": 4}`."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ascq.core.errors import AscqError, UnsupportedError

METHODS = ("ngram", "draft_model")
NOT_SUPPORTED_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "deepseek_mtp", "mtp", "suffix")


@dataclass
class SpeculativeConfig:
    method: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | Path | None = None
    draft_tensor_parallel_size: int | None = None
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.method is None:  # vLLM: a draft `model` without a method is a draft model
            self.method = "draft_model" if self.model is not None else None
        if self.method in NOT_SUPPORTED_METHODS:
            raise UnsupportedError(
                f"speculative method {self.method!r} is not supported; supported: {', '.join(METHODS)}"
            )
        if self.method not in METHODS:
            raise AscqError(
                f"speculative_config needs a method, one of: {', '.join(METHODS)} (got {self.method!r})"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise AscqError(
                f"speculative_config num_speculative_tokens must be a positive integer, got {k!r}"
            )
        if self.method == "ngram":
            self._check_ngram()
        else:
            self._check_draft_model()

    def _check_ngram(self) -> None:
        if self.model is not None:
            raise AscqError("speculative_config: method 'ngram' takes no draft model")
        if self.prompt_lookup_max is None and self.prompt_lookup_min is None:
            self.prompt_lookup_max = self.prompt_lookup_min = 5  # vLLM's defaults when neither is given
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise AscqError(f"speculative_config {name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise AscqError(
                f"speculative_config prompt_lookup_min {self.prompt_lookup_min} exceeds prompt_lookup_max "
                f"{self.prompt_lookup_max}"
            )

    def _check_draft_model(self) -> None:
        if self.model is None:
            raise AscqError(
                "speculative_config: method 'draft_model' needs a draft 'model' (a zoo entry or folder)"
            )
        if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
            raise AscqError("speculative_config: prompt_lookup_max/min only apply to method 'ngram'")
        if self.draft_tensor_parallel_size not in (None, 1):
            raise UnsupportedError("speculative_config draft_tensor_parallel_size must be 1")
        if self.quantization is not None:
            raise UnsupportedError(
                "speculative_config quantization is not supported; use a quantized zoo entry as the draft "
                "model"
            )
        from ascq.formats.manifest import resolve_entry

        self.model = resolve_entry(str(self.model))


def parse_speculative_config(
    value: SpeculativeConfig | dict[str, Any] | str | None,
) -> SpeculativeConfig | None:
    """A dict or its JSON text (the CLI's `--speculative-config`) -> validated config; None stays None."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise AscqError(
                f"--speculative-config is not valid JSON: {exc.msg} (at character {exc.pos})"
            ) from exc
    if not isinstance(value, dict):
        raise AscqError("speculative_config must be a JSON object / dict")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise AscqError(
            f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    return SpeculativeConfig(**value)
