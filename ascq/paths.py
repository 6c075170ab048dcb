"""Where the project's own data lives: recipes, the zoo and the bundled fixture corpus."""

import os
from pathlib import Path

from ascq import envs

PACKAGE_DIR = Path(__file__).resolve().parent
PROJECT_DIR = PACKAGE_DIR.parent
DATA_DIR = PACKAGE_DIR / "data"
# in a checkout a symlink to the project's recipes/; package data when installed
RECIPES_DIR = PACKAGE_DIR / "recipes"
EVAL_TEXT = DATA_DIR / "eval.txt"
DEFAULT_MAX_EVAL_TOKENS = 8192  # convert's perplexity before/after reads this many eval tokens by default
CALIB_TEXT = DATA_DIR / "calib.txt"


def zoo_root() -> Path:
    """The zoo folder: $ASCQ_ZOO, else the project's `zoo/` in a source checkout, else (a plain `pip install`,
    where the package lives in site-packages) `$XDG_DATA_HOME/ascq/zoo`, by default
    `~/.local/share/ascq/zoo`."""
    if envs.ASCQ_ZOO is not None:
        return envs.ASCQ_ZOO
    if (PROJECT_DIR / "pyproject.toml").is_file() and (PROJECT_DIR / "zoo").is_dir():
        return PROJECT_DIR / "zoo"
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "ascq" / "zoo"


def portable_name(path: str | os.PathLike) -> str:
    """How a manifest or model card names a local file or folder, never by an absolute path: relative to the
    project for its own data (`ascq/data/eval.txt`), a zoo entry by its name, anything else by its base
    name."""
    text = str(path)
    resolved = Path(text).resolve()
    if not Path(text).exists():
        return text  # a Hub id
    if resolved.is_relative_to(PROJECT_DIR):
        return resolved.relative_to(PROJECT_DIR).as_posix()
    return resolved.name


def shipped_recipes() -> dict[str, Path]:
    """Recipe name -> YAML file of every recipe shipped with ascq."""
    return {p.stem: p for p in sorted(RECIPES_DIR.glob("*.yaml"))}


def recipe_descriptions() -> list[tuple[str, str]]:
    """(name, description line) of every shipped recipe, read without importing torch (`ascq recipes`)."""
    import yaml

    rows = []
    for name, path in shipped_recipes().items():
        try:
            description = (yaml.safe_load(path.read_text()) or {}).get("description") or ""
        except (yaml.YAMLError, AttributeError) as exc:
            description = f"(invalid YAML: {type(exc).__name__})"
        rows.append((name, str(description)))
    return rows
