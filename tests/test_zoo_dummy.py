"""`ascq zoo dummy`: a synthetic source at an entry's real shape (here the tiny MoE fixture's), written
tensor by tensor, drawn like a trained model's, marked synthetic through conversion; never over a folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ascq.cli import main
from ascq.core.tensors import checkpoint_tensors
from ascq.quantize.outlier_stress import DEFAULT_K, choose_channels

FIXTURE = Path(__file__).resolve().parents[1] / "zoo" / "tiny-deepseek-moe"


def _run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        main(argv)
    except SystemExit as exc:
        return exc.code or 0, capsys.readouterr().err
    return 0, capsys.readouterr().err


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dummy") / "synthetic-moe"
    main(["zoo", "dummy", str(FIXTURE), "--out", str(out), "--seed", "3"])
    return out


def test_real_names_shapes_and_synthetic_marks(source):
    config = json.loads((FIXTURE / "config.json").read_text())
    tensors = _tensors(source)
    assert {n: tuple(t.shape) for n, t in tensors.items()} == dict(checkpoint_tensors(config))
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    manifest = json.loads((source / "ascq.json").read_text())
    assert manifest["synthetic"]["seed"] == 3 and "NOT a model" in manifest["synthetic"]["kind"]
    assert "**SYNTHETIC**" in (source / "README.md").read_text()
    assert json.loads((source / "config.json").read_text()) == config


def test_weights_drawn_like_a_trained_models(source):
    config = json.loads((FIXTURE / "config.json").read_text())
    tensors = _tensors(source)
    channels = choose_channels(config["hidden_size"], seed=3)
    others = [c for c in range(config["hidden_size"]) if c not in channels]
    for layer in range(config["num_hidden_layers"]):
        norm = tensors[f"model.layers.{layer}.post_attention_layernorm.weight"].float()
        assert torch.equal(norm[channels], torch.full((len(channels),), DEFAULT_K))
        assert torch.equal(norm[others], torch.ones(len(others)))
        q = tensors[f"model.layers.{layer}.self_attn.q_proj.weight"].float()
        # the columns that read the outlier channels are k times smaller
        assert q[:, channels].std() * DEFAULT_K == pytest.approx(q[:, others].std(), rel=0.25)
    stds = [
        tensors[f"model.layers.{i}.self_attn.o_proj.weight"].float().std().item()
        for i in range(config["num_hidden_layers"])
    ]
    assert max(stds) / min(stds) > 1.1  # each layer its own scale


def test_existing_folder_is_kept(source, capsys):
    before = (source / "ascq.json").read_bytes()
    code, err = _run(["zoo", "dummy", str(FIXTURE), "--out", str(source)], capsys)
    assert code != 0 and "already exists" in err and "Traceback" not in err
    assert (source / "ascq.json").read_bytes() == before


def test_converted_entry_stays_marked_synthetic(source, tmp_path):
    out = tmp_path / "synthetic-moe-rtn"
    main(
        ["convert", str(source), "--recipe", "w4a16-rtn", "--out", str(out), "--num-samples", "2"]
        + ["--seq-len", "32", "--no-eval"]
    )
    manifest = json.loads((out / "ascq.json").read_text())
    assert manifest["synthetic"]["seed"] == 3
    from ascq.zoo.card import render_card

    assert "**SYNTHETIC**" in render_card(out)
