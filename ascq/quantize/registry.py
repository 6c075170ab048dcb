"""Recipe modifier names -> classes. A new modifier is added here (one import, one entry)."""

from __future__ import annotations

from ascq.quantize.modifier import Modifier


def modifier_classes() -> dict[str, type[Modifier]]:
    from ascq.quantize.awq_modifier import AWQModifier
    from ascq.quantize.gptq_modifier import GPTQModifier
    from ascq.quantize.msmodelslim import KVCacheInt8Modifier
    from ascq.quantize.quantization_modifier import QuantizationModifier
    from ascq.quantize.smoothquant import SmoothQuantModifier

    classes: list[type[Modifier]] = [
        SmoothQuantModifier,
        QuantizationModifier,
        AWQModifier,
        GPTQModifier,
        KVCacheInt8Modifier,
    ]
    return {cls.name: cls for cls in classes}
