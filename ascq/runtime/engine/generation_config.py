"""Default sampling parameters from a generation config (vLLM's `--generation-config` /
`--override-generation-config`, ModelConfig.get_diff_sampling_param): a request field left unset takes the
model's default, and `max_new_tokens` caps every request."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ascq.core.errors import AscqError

# generation_config.json's names -> SamplingParams' (vLLM reads exactly these)
SAMPLING_FIELDS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}
SOURCES = ("auto", "vllm")


def parse_override(text: str | dict[str, Any] | None) -> dict[str, Any]:
    """`--override-generation-config` (JSON text or a dict): only the fields vLLM takes defaults from."""
    if text is None:
        return {}
    if isinstance(text, str):
        try:
            text = json.loads(text)
        except json.JSONDecodeError as exc:
            raise AscqError(f"--override-generation-config is not valid JSON: {exc}") from None
    if not isinstance(text, dict):
        raise AscqError("--override-generation-config must be a JSON object, e.g. '{\"temperature\": 0.5}'")
    unknown = sorted(set(text) - set(SAMPLING_FIELDS))
    if unknown:
        raise AscqError(
            f"--override-generation-config fields {unknown} are not sampling defaults; supported: "
            f"{', '.join(SAMPLING_FIELDS)}"
        )
    for name, value in text.items():
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise AscqError(f"--override-generation-config {name} must be a number, got {value!r}")
    return text


def check_source(source: str) -> None:
    if source not in SOURCES and not (Path(source) / "generation_config.json").is_file():
        raise AscqError(
            f"--generation-config {source!r} is neither auto, vllm nor a folder with a generation_config.json"
        )


def default_sampling_params(model_dir: str | Path, source: str, override: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams defaults (ascq / vLLM names) from `source`'s generation_config.json (auto: the model's;
    vllm: none) with `override` merged over it; only fields that are set."""
    check_source(source)
    config: dict[str, Any] = {}
    folder = Path(model_dir) if source == "auto" else None if source == "vllm" else Path(source)
    if folder is not None and (folder / "generation_config.json").is_file():
        try:
            config = json.loads((folder / "generation_config.json").read_text())
        except (OSError, ValueError) as exc:
            raise AscqError(f"{folder / 'generation_config.json'} is not readable JSON: {exc}") from None
        if not isinstance(config, dict):
            raise AscqError(f"{folder / 'generation_config.json'} is not a JSON object")
    config.update(override)
    return {
        ours: config[theirs] for theirs, ours in SAMPLING_FIELDS.items() if config.get(theirs) is not None
    }
