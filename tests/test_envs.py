"""ascq/envs.py declares every ASCQ_* variable once; nothing else in the package reads one from os.environ."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ascq import envs
from ascq.core.errors import AscqError

PACKAGE = Path(__file__).resolve().parents[1] / "ascq"
# a direct read, a membership test, or a name kept in a constant to read later
READ = re.compile(
    r"""(environ\.get\(|environ\[|getenv\()\s*["']ASCQ_|["']ASCQ_\w+["']\s+in\s+os\.environ|(?<![!=<>])=\s*["']ASCQ_"""
)


def test_only_envs_reads_ascq_variables():
    readers = [
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if p.name != "envs.py" and READ.search(p.read_text())
    ]
    assert readers == []


def test_every_variable_read_is_declared():
    names = {m for p in PACKAGE.rglob("*.py") for m in re.findall(r"\benvs\.(ASCQ_\w+)", p.read_text())}
    assert names and names - set(envs.VARIABLES) == set()


def test_defaults_and_parsing(monkeypatch):
    for name in envs.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert envs.ASCQ_NATIVE_KERNELS is True and envs.ASCQ_BF16_GEMM is None
    assert envs.ASCQ_BF16_WEIGHT_CACHE_MB == 1024 and envs.ASCQ_ZOO is None
    assert envs.ASCQ_W4_ACTIVATION_BITS == 8
    monkeypatch.setenv("ASCQ_BF16_WEIGHT_CACHE_MB", "12")
    monkeypatch.setenv("ASCQ_ZOO", "/tmp/zoo")
    monkeypatch.setenv("ASCQ_FUSED_DECODE", "0")
    assert envs.ASCQ_BF16_WEIGHT_CACHE_MB == 12 and envs.ASCQ_ZOO == Path("/tmp/zoo")
    assert envs.ASCQ_FUSED_DECODE is False


@pytest.mark.parametrize(
    "name,value",
    [
        ("ASCQ_NATIVE_KERNELS", "yes"),
        ("ASCQ_BF16_WEIGHT_CACHE_MB", "-1"),
        ("ASCQ_LM_HEAD_QUANT", "int4"),
        ("ASCQ_W4_ACTIVATION_BITS", "4"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(AscqError, match=f"^{name}=") as info:
        getattr(envs, name)
    assert "\n" not in str(info.value)


def test_an_undeclared_name_is_an_attribute_error():
    with pytest.raises(AttributeError):
        envs.ASCQ_NOT_DECLARED  # noqa: B018
