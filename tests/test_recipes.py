"""Recipe parsing, validation, composition and `ascq recipes`."""

from __future__ import annotations

import pytest

from ascq.cli import main
from ascq.core.errors import AscqError
from ascq.quantize.recipe import (
    ComposedRecipe,
    available_recipes,
    list_recipes,
    load_recipe,
    load_recipes,
    parse_recipe,
)
from ascq.quantize.schemes import DEFAULT_IGNORE

SHIPPED = ("w8a8", "w8a8-static", "w4a16-rtn", "w8a16", "fp8-kv")


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipes_parse(name):
    recipe = load_recipe(name)
    assert recipe.description and recipe.modifiers
    assert recipe.text == available_recipes()[name].read_text()


def test_shipped_schemes():
    w8a8 = load_recipe("w8a8")
    assert [m.name for m in w8a8.modifiers] == ["SmoothQuantModifier", "QuantizationModifier"]
    assert w8a8.modifiers[0].smoothing_strength == 0.8
    group = w8a8.modifiers[1].quant_scheme().config_groups["group_0"]
    assert (group.weights.num_bits, group.weights.strategy, group.weights.symmetric) == (8, "channel", True)
    assert (group.input_activations.strategy, group.input_activations.dynamic) == ("token", True)
    static = load_recipe("w8a8-static").modifiers[1].quant_scheme().config_groups["group_0"]
    assert (static.input_activations.strategy, static.input_activations.dynamic) == ("tensor", False)
    w4 = load_recipe("w4a16-rtn").modifiers[0].quant_scheme()
    weights = w4.config_groups["group_0"].weights
    assert (weights.num_bits, weights.group_size, weights.symmetric) == (4, 128, False)
    assert w4.ignore == DEFAULT_IGNORE
    w8a16 = load_recipe("w8a16").modifiers[0].quant_scheme().config_groups["group_0"]
    assert (w8a16.weights.strategy, w8a16.input_activations) == ("channel", None)
    kv = load_recipe("fp8-kv").modifiers[0].quant_scheme()
    assert kv.config_groups == {} and kv.kv_cache_scheme.type == "float"


def test_recipes_compose():
    composed = load_recipes(["w8a8", "fp8-kv"])
    assert composed.names == ["w8a8", "fp8-kv"]
    assert [m.name for m in composed.modifiers] == [
        "SmoothQuantModifier",
        "QuantizationModifier",
        "QuantizationModifier",
    ]
    assert len(composed.schemes()) == 2
    with pytest.raises(AscqError, match="more than one modifier quantizes weights"):
        load_recipes(["w8a8", "w4a16-rtn"])
    with pytest.raises(AscqError, match="more than one recipe sets kv_cache_scheme"):
        load_recipes(["fp8-kv", "fp8-kv"])
    with pytest.raises(AscqError, match="quantizes nothing"):
        ComposedRecipe([parse_recipe("sq", "s_stage:\n  m_modifiers:\n    SmoothQuantModifier: {}\n")])


BAD_RECIPES = {
    "unknown modifier": (
        "a_stage:\n  b_modifiers:\n    FancyModifier: {}\n",
        "unknown modifier 'FancyModifier'",
    ),
    "bad type": (
        "a_stage:\n  b_modifiers:\n    SmoothQuantModifier: {smoothing_strength: high}\n",
        "smoothing_strength must be float",
    ),
    "bad value": (
        "a_stage:\n  b_modifiers:\n    SmoothQuantModifier: {smoothing_strength: 1.5}\n",
        r"must be in \(0, 1\)",
    ),
    "unknown argument": (
        "a_stage:\n  b_modifiers:\n    QuantizationModifier: {scheme: W8A8, colour: red}\n",
        "unknown argument 'colour'",
    ),
    "malformed yaml": ("a_stage:\n  b_modifiers: [unclosed\n", "malformed YAML at line"),
    "not a mapping": ("- just\n- a list\n", "expected a mapping of stages"),
    "bad stage": ("quant:\n  x_modifiers: {}\n", "must be a '<name>_stage' mapping"),
    "bad preset": (
        "a_stage:\n  b_modifiers:\n    QuantizationModifier: {scheme: NVFP4}\n",
        "scheme 'NVFP4' is not supported",
    ),
    "bad qargs": (
        "a_stage:\n  b_modifiers:\n    QuantizationModifier:\n      config_groups:\n        g: {weights: "
        "{num_bits: eight}}\n",
        "config_groups.g.weights.num_bits",
    ),
    "unsupported qargs": (
        "a_stage:\n  b_modifiers:\n    QuantizationModifier:\n      config_groups:\n        g: {weights: "
        "{num_bits: 3}}\n",
        "weights must be int4 or int8",
    ),
    "bad kv": (
        "a_stage:\n  b_modifiers:\n    QuantizationModifier: {kv_cache_scheme: {num_bits: 8, type: int}}\n",
        "kv_cache_scheme must be fp8",
    ),
    "nothing": ("a_stage:\n  b_modifiers:\n    QuantizationModifier: {}\n", "needs a scheme"),
    "ignore type": (
        "a_stage:\n  b_modifiers:\n    QuantizationModifier: {scheme: W8A8, ignore: lm_head}\n",
        "ignore must be list",
    ),
}


@pytest.mark.parametrize("case", BAD_RECIPES)
def test_bad_recipes_give_one_line_errors(case):
    text, message = BAD_RECIPES[case]
    with pytest.raises(AscqError, match=message) as info:
        parse_recipe("bad", text)
    assert "\n" not in str(info.value) and str(info.value).startswith("recipe bad:")


def test_unknown_recipe_name_and_missing_file(tmp_path):
    with pytest.raises(AscqError, match="unknown recipe 'w3a3'; available: .*w8a8"):
        load_recipe("w3a3")
    with pytest.raises(AscqError, match="does not exist"):
        load_recipe(str(tmp_path / "nope.yaml"))
    custom = tmp_path / "mine.yaml"
    custom.write_text(available_recipes()["w8a16"].read_text())
    assert load_recipe(str(custom)).name == "mine"


def test_cli_recipes_lists_names_and_descriptions(capsys):
    main(["recipes"])
    out = capsys.readouterr().out
    for name, description in list_recipes():
        assert any(line.startswith(name + " ") and line.endswith(description) for line in out.splitlines())
    assert all(name in out for name in SHIPPED)


def test_shipped_recipes_take_the_one_ignore_default():
    """The ignore default lives in ascq/core/architecture.py; no shipped recipe writes it again."""
    from ascq.core.architecture import DEFAULT_IGNORE
    from ascq.paths import shipped_recipes

    for name, path in shipped_recipes().items():
        assert "ignore:" not in path.read_text(), name
        schemes = [s for m in load_recipe(name).modifiers if (s := m.quant_scheme()) is not None]
        assert all(s.ignore == list(DEFAULT_IGNORE) for s in schemes), name
