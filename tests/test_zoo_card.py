"""`ascq zoo card`: the README.md model card parses with huggingface_hub and carries the Hub's metadata for
quantized models, the recipe verbatim and the before/after quality table; the manifest records it."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import ModelCard, metadata_load
from zoo_builder import RECIPE_TEXT, run

from ascq.formats.manifest import read_manifest, write_manifest
from ascq.zoo.card import render_card
from ascq.zoo.verify import verify_entry


def test_card_of_a_quantized_entry_has_hub_metadata_recipe_and_quality_table(zoo: Path) -> None:
    assert run("zoo", "card", "tiny-test-llama-w4a16") == 0
    readme = zoo / "tiny-test-llama-w4a16" / "README.md"
    card = ModelCard.load(readme)
    metadata = metadata_load(readme)
    assert metadata["base_model"] == card.data.base_model == "test-org/tiny-test-llama"
    assert metadata["base_model_relation"] == "quantized"
    assert metadata["pipeline_tag"] == "text-generation" and metadata["library_name"] == "transformers"
    assert metadata["license"] == "apache-2.0"
    assert {"w4a16", "compressed-tensors", "w4a16-rtn", "quantized"} <= set(metadata["tags"])
    assert RECIPE_TEXT.rstrip() in card.text
    assert "| test-org/tiny-test-llama (bf16) | 300.5000 | |" in card.text
    assert "| tiny-test-llama-w4a16 (w4a16) | 310.7500 | +3.41% |" in card.text
    assert "ascq/data/calib.txt, 16 samples of 128 tokens" in card.text
    for command in (
        "ascq serve zoo/tiny-test-llama-w4a16",
        "vllm serve zoo/tiny-test-llama-w4a16",
        "vllm-ascend",
    ):
        assert command in card.text
    verify_entry(zoo / "tiny-test-llama-w4a16")  # the manifest records README.md


def test_card_with_a_repo_id_serves_from_the_hub(zoo: Path) -> None:
    text = render_card(zoo / "tiny-test-llama-w4a16", repo_id="org/tiny-w4a16")
    assert "ascq zoo pull org/tiny-w4a16\nascq serve tiny-w4a16" in text
    assert "vllm serve org/tiny-w4a16" in text


def test_card_of_a_fixture_says_no_recipe(zoo: Path) -> None:
    assert run("zoo", "card", str(zoo / "tiny-test-llama")) == 0
    card = ModelCard.load(zoo / "tiny-test-llama" / "README.md")
    assert "base_model_relation" not in card.data.to_dict()
    assert "No quantization recipe was applied" in card.text and "None: this is a fixture model" in card.text
    assert "| tiny-test-llama (dense) | 300.5000 |" in card.text


def test_license_is_inherited_from_the_base_entry(zoo: Path) -> None:
    entry = zoo / "tiny-test-llama-w4a16"
    write_manifest(entry, dict(read_manifest(entry), license=None, base_model="tiny-test-llama"))
    base = zoo / "tiny-test-llama"
    write_manifest(
        base, dict(read_manifest(base), license="other", license_name="fixture", license_link="LICENSE")
    )
    metadata = ModelCard(render_card(entry)).data.to_dict()
    assert (metadata["license"], metadata["license_name"], metadata["license_link"]) == (
        "other",
        "fixture",
        "LICENSE",
    )


def test_card_is_stable_once_recorded(zoo: Path) -> None:
    entry = zoo / "tiny-test-llama-w4a16"
    assert run("zoo", "card", str(entry)) == 0
    first = (entry / "README.md").read_text()
    assert render_card(entry) == first


def test_card_of_an_entry_outside_the_zoo_names_no_local_path(zoo: Path, tmp_path: Path) -> None:
    import shutil

    outside = tmp_path / "elsewhere" / "my-w4a16"
    shutil.copytree(zoo / "tiny-test-llama-w4a16", outside)
    text = render_card(outside)
    assert str(tmp_path) not in text and "ascq serve my-w4a16" in text
