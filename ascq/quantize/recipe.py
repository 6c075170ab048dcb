"""Recipes: YAML in llm-compressor's shape (stage -> modifier group -> modifier -> arguments), validated.

    description: one line for `ascq recipes`
    quant_stage:
      quant_modifiers:
        SmoothQuantModifier: {smoothing_strength: 0.8}
        QuantizationModifier: {targets: [Linear], ignore: [lm_head], scheme: W8A8}

Several recipes compose (`--recipe w8a8 --recipe fp8-kv`): their modifiers run in the order given.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from ascq.core.errors import AscqError
from ascq.paths import shipped_recipes
from ascq.quantize.modifier import Modifier
from ascq.quantize.registry import modifier_classes
from ascq.quantize.schemes import RecipeError, RecipeScheme


@dataclasses.dataclass
class Recipe:
    name: str
    description: str
    text: str
    modifiers: list[Modifier]


@dataclasses.dataclass
class ComposedRecipe:
    recipes: list[Recipe]

    def __post_init__(self) -> None:
        if not self.recipes:
            raise RecipeError("at least one recipe is needed")
        weight_owners = [
            (r.name, m.name)
            for r in self.recipes
            for m in r.modifiers
            if _scheme(m) and _scheme(m).config_groups
        ]
        if len(weight_owners) > 1:
            listed = ", ".join(f"{m} in {r}" for r, m in weight_owners)
            raise RecipeError(
                f"more than one modifier quantizes weights ({listed}); combine one weight recipe with fp8-kv"
            )
        kv_owners = [
            r.name for r in self.recipes for m in r.modifiers if _scheme(m) and _scheme(m).kv_cache_scheme
        ]
        if len(kv_owners) > 1:
            raise RecipeError(f"more than one recipe sets kv_cache_scheme ({', '.join(kv_owners)})")
        if not any(_scheme(m) for m in self.modifiers):
            raise RecipeError(
                f"recipe {'+'.join(self.names)} quantizes nothing (no QuantizationModifier or scheme)"
            )

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.recipes]

    @property
    def modifiers(self) -> list[Modifier]:
        return [m for r in self.recipes for m in r.modifiers]

    def schemes(self) -> list[RecipeScheme]:
        return [s for m in self.modifiers if (s := m.quant_scheme()) is not None]


def _scheme(modifier: Modifier) -> RecipeScheme | None:
    return modifier.quant_scheme()


def parse_recipe(name: str, text: str) -> Recipe:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise RecipeError(
            f"recipe {name}: malformed YAML{where}: {getattr(exc, 'problem', None) or exc}"
        ) from None
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {name}: expected a mapping of stages, got {type(data).__name__}")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise RecipeError(f"recipe {name}: description must be a string")
    classes = modifier_classes()
    modifiers: list[Modifier] = []
    for stage, groups in data.items():
        if stage == "description":
            continue
        if not stage.endswith("_stage") or not isinstance(groups, dict):
            raise RecipeError(
                f"recipe {name}: top-level key {stage!r} must be a '<name>_stage' mapping (or description)"
            )
        for group, entries in groups.items():
            if not str(group).endswith("_modifiers") or not isinstance(entries, dict):
                raise RecipeError(f"recipe {name}: {stage}.{group} must be a '<name>_modifiers' mapping")
            for modifier_name, args in entries.items():
                if modifier_name not in classes:
                    raise RecipeError(
                        f"recipe {name}: unknown modifier {modifier_name!r} (known: "
                        f"{', '.join(sorted(classes))})"
                    )
                try:
                    modifiers.append(classes[modifier_name].from_args(args or {}))
                except AscqError as exc:
                    raise type(exc)(f"recipe {name}: {exc}") from None
                except (ValueError, TypeError) as exc:  # a modifier's own validation
                    raise RecipeError(f"recipe {name}: {modifier_name}: {exc}") from None
    if not modifiers:
        raise RecipeError(f"recipe {name}: no modifiers")
    return Recipe(name, description, text, modifiers)


def available_recipes() -> dict[str, Path]:
    return shipped_recipes()


def load_recipe(name_or_path: str) -> Recipe:
    """A shipped recipe by name (`w8a8`) or a YAML file path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        if not path.is_file():
            raise RecipeError(f"recipe file {path} does not exist")
        return parse_recipe(path.stem, path.read_text())
    shipped = available_recipes()
    if name_or_path not in shipped:
        raise RecipeError(
            f"unknown recipe {name_or_path!r}; available: {', '.join(shipped)} (or a path to a .yaml file)"
        )
    return parse_recipe(name_or_path, shipped[name_or_path].read_text())


def load_recipes(names: list[str]) -> ComposedRecipe:
    return ComposedRecipe([load_recipe(n) for n in names])


def list_recipes() -> list[tuple[str, str]]:
    """(name, description) of every shipped recipe; a broken one is listed with its error."""
    rows = []
    for name, path in available_recipes().items():
        try:
            rows.append((name, parse_recipe(name, path.read_text()).description))
        except RecipeError as exc:
            rows.append((name, f"(invalid: {exc})"))
    return rows
