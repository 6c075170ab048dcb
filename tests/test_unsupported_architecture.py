"""An architecture ascq does not know is refused at `ascq zoo import-gguf` and at `ascq convert` with one
line naming the supported families, never a traceback (the real CLI, in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ascq.core.families.registry import SUPPORTED_MODEL_TYPES

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, zoo: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(ROOT), "ASCQ_ZOO": str(zoo)}
    code = "import sys; from ascq.cli import main; sys.argv[0] = 'ascq'; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300
    )


def _assert_one_line_refusal(proc: subprocess.CompletedProcess, model_type: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert f"model_type '{model_type}' is not supported" in lines[0]
    assert all(family in lines[0] for family in SUPPORTED_MODEL_TYPES), lines[0]


@pytest.mark.parametrize("model_type", ["falcon", "foo"])
def test_convert_refuses_unknown_model_type_in_one_line(model_type: str, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": 8}))
    proc = _cli("convert", str(model), "--recipe", "w4a16-rtn", "--out", str(tmp_path / "out"), zoo=tmp_path)
    _assert_one_line_refusal(proc, model_type)
    assert not (tmp_path / "out").exists()


def test_import_gguf_refuses_unknown_architecture_in_one_line(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_name("tiny")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    proc = _cli("zoo", "import-gguf", str(path), zoo=tmp_path / "zoo")
    _assert_one_line_refusal(proc, "falcon")
    assert not (tmp_path / "zoo").exists() or not any((tmp_path / "zoo").iterdir())
