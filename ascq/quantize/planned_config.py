"""The quantization_config a recipe's conversion writes, planned from a model's config.json alone."""

from __future__ import annotations

from ascq.core.architecture import NEVER_QUANTIZED
from ascq.core.errors import AscqError
from ascq.quantize.architectures import architecture_from_config
from ascq.quantize.ct_writer import quantization_config
from ascq.quantize.layout import decoder_linears
from ascq.quantize.recipe import load_recipes
from ascq.quantize.schemes import fit_group_sizes


def planned_quantization_config(config: dict, recipe: str) -> dict:
    """The quantization_config `ascq convert --recipe RECIPE` writes for a model of this config, from the
    config alone (what `--load-format dummy --quantization RECIPE` serves): the recipe's groups with their
    group size fitted to the model's widths as the converter fits them. Per-layer fallbacks, which only a
    conversion can decide, are not planned."""
    schemes = load_recipes([recipe]).schemes()
    if not any(s.config_groups for s in schemes):
        raise AscqError(f"recipe {recipe!r} quantizes no weights: there is nothing to make dummy weights for")
    fit_group_sizes(schemes, decoder_linears(architecture_from_config(config)))
    return quantization_config(schemes, {}, list(NEVER_QUANTIZED)).model_dump()
