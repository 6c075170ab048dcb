"""Model classes by the `architectures` entry of config.json: the family's registry row names its serving
class (`ascq.core.families.registry`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ascq.core.families.registry import family_of_architectures, resolve


def model_class_for(config: dict[str, Any]) -> type[nn.Module]:
    return resolve(family_of_architectures(config).serving_model)
