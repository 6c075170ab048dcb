"""Device knowledge lives in ascq/platforms: no other module (the kernels' backend files aside) compares a
value with a device name or imports torch_npu; and each platform answers as the code before the split did."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from ascq.core.errors import AscqError, UnsupportedError
from ascq.platforms import DEVICES, check_device, device_kind, platform_for

PACKAGE = Path(__file__).resolve().parents[1] / "ascq"
DEVICE_NAMES = {"cpu", "cuda", "npu", "reference"}
# where device-specific code belongs: the platforms and the kernel backends themselves
ALLOWED = (
    "platforms/",
    "kernels/npu/",
    "kernels/cuda.py",
    "kernels/cpu.py",
    "kernels/cpu_attention.py",
    "kernels/reference.py",
)


def _names(node: ast.AST) -> set[str]:
    values = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)}


def device_tests(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            names = set().union(*(_names(o) for o in operands))
            if names & DEVICE_NAMES:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "startswith"
        ):
            if any(_names(a) & DEVICE_NAMES for a in node.args):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(m.split(".")[0] == "torch_npu" for m in modules):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: imports torch_npu")
    return found


def test_device_names_are_tested_only_in_platforms_and_kernel_backends():
    offenders = [
        line
        for p in sorted(PACKAGE.rglob("*.py"))
        if not p.relative_to(PACKAGE).as_posix().startswith(ALLOWED)
        for line in device_tests(p)
    ]
    assert offenders == []


def test_the_scan_finds_a_device_test(tmp_path):
    probe = PACKAGE / "_probe_not_a_module.py"
    try:
        probe.write_text(
            'def f(d):\n    return d.type == "cuda" or str(d).startswith("npu")\nimport torch_npu\n'
        )
        assert len(device_tests(probe)) == 3
    finally:
        probe.unlink()


@pytest.mark.parametrize(
    "device,kind",
    [
        ("cpu", "cpu"),
        ("cuda:1", "cuda"),
        (torch.device("cpu"), "cpu"),
        ("npu:0", "npu"),
        ("reference", "reference"),
    ],
)
def test_device_kind(device, kind):
    assert device_kind(device) == kind and platform_for(device).name == kind


def test_platform_answers():
    assert {d: platform_for(d).dist_backend for d in DEVICES} == {
        "cpu": "gloo",
        "reference": "gloo",
        "cuda": "nccl",
        "npu": "hccl",
    }
    assert {d: platform_for(d).graph_class for d in DEVICES} == {
        "cpu": None,
        "reference": None,
        "cuda": "CUDAGraph",
        "npu": "NPUGraph",
    }
    assert platform_for("reference").torch_device("reference") == torch.device("cpu")
    cpu, ref = platform_for("cpu"), platform_for("reference")
    assert cpu.default_dtype(torch.bfloat16, weight_only_quantized=True) == torch.bfloat16
    assert cpu.default_dtype(torch.bfloat16, weight_only_quantized=False) == torch.float32
    assert ref.default_dtype(torch.bfloat16, weight_only_quantized=True) == torch.float32
    assert platform_for("cuda").default_dtype(torch.float16, weight_only_quantized=True) == torch.float16


def test_unknown_device_and_missing_runtimes_are_one_line():
    with pytest.raises(UnsupportedError, match="unknown device 'tpu'"):
        platform_for("tpu")
    assert check_device("cpu") == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(AscqError, match="no CUDA device"):
            check_device("cuda")
