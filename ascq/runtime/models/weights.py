"""Route checkpoint tensors (HF names) to the weight loaders of merged / sharded runtime modules."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from types import ModuleType

import torch
from torch import nn

from ascq.core.errors import AscqError
from ascq.runtime.layers.attention import Attention
from ascq.runtime.layers.linear import LinearBase
from ascq.runtime.layers.loadable import cast_parameters
from ascq.runtime.layers.moe import FusedMoE

# checkpoint module -> (runtime module, shard id)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
EXPERT_RE = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)$")
KV_SCALE_RE = re.compile(r"^(.*\.self_attn)(?:\.([kv])_proj)?\.(k_scale|v_scale|output_scale)$")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    scheme_for: Callable[[str], str],
    on_loaded: Callable[[nn.Module], None] | None = None,
) -> None:
    """Hand each (name, tensor) to the module that owns it; unknown names are an error.

    `on_loaded(module)`: called for a linear or expert block once loading has moved on from it with all its
    weights in (finalize it there: a quantized checkpoint's unpacked tensors are then never all held at
    once); modules still incomplete then are left to `finalize_model`."""
    modules = dict(model.named_modules())
    current: nn.Module | None = None  # the linear / expert block the last tensor went to

    def moved_to(module: nn.Module) -> None:
        nonlocal current
        if current is not module:
            done_with(current)
            current = module

    def done_with(module: nn.Module | None) -> None:
        if module is not None and on_loaded is not None and module.is_loaded():
            on_loaded(module)

    for name, tensor in weights:
        if name.endswith(IGNORED_SUFFIXES):
            continue
        kv_scale = KV_SCALE_RE.match(name)
        if kv_scale:
            attn_prefix, proj, param = kv_scale.groups()
            param = f"{proj}_scale" if param == "output_scale" else param
            _module(modules, f"{attn_prefix}.attn", name, Attention).weight_loader(param, tensor)
            continue
        prefix, param = name.rsplit(".", 1)
        expert = EXPERT_RE.match(prefix)
        if expert:
            moe_prefix, expert_id, projection = expert.groups()
            moe = _module(modules, moe_prefix, name, FusedMoE)
            moved_to(moe)
            moe.weight_loader(param, tensor, int(expert_id), projection, scheme_for(prefix))
            continue
        parent, _, leaf = prefix.rpartition(".")
        if leaf in PACKED_MODULES and not isinstance(modules.get(prefix), LinearBase):
            target, shard_id = PACKED_MODULES[leaf]
            linear = _module(modules, f"{parent}.{target}", name, LinearBase)
            moved_to(linear)
            linear.weight_loader(param, tensor, shard_id, scheme_for(prefix))
            continue
        module = modules.get(prefix)
        if isinstance(module, LinearBase):
            moved_to(module)
            module.weight_loader(param, tensor, 0, scheme_for(prefix))
        elif module is not None and hasattr(module, "weight_loader") and hasattr(module, param):
            module.weight_loader(param, tensor)
        else:
            raise AscqError(
                f"checkpoint tensor {name!r} does not belong to any layer of {type(model).__name__}"
            )
    done_with(current)


def _module(modules: dict[str, nn.Module], name: str, tensor_name: str, kind: type) -> nn.Module:
    module = modules.get(name)
    if not isinstance(module, kind):
        raise AscqError(f"checkpoint tensor {tensor_name!r} does not belong to any layer of the model")
    return module


def finalize_module(module: nn.Module, backend: ModuleType, dtype: torch.dtype, device: torch.device) -> None:
    """Prepare one module's kernel weights, cast its plain parameters, move its buffers to the device (again
    on a module already finalized: a no-op)."""
    if hasattr(module, "finalize"):
        module.finalize(backend, dtype)
    cast_parameters(module, dtype, device)
    for name, buffer in list(module.named_buffers(recurse=False)):
        setattr(module, name, buffer.to(device))


def finalize_model(model: nn.Module, backend: ModuleType, dtype: torch.dtype, device: torch.device) -> None:
    """After loading: every module not finalized while loading."""
    for module in model.modules():
        finalize_module(module, backend, dtype, device)
