"""Where the project's own data lives: recipes, the zoo and the bundled fixture corpus."""

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
PROJECT_DIR = PACKAGE_DIR.parent
DATA_DIR = PACKAGE_DIR / "data"
RECIPES_DIR = PROJECT_DIR / "recipes"
EVAL_TEXT = DATA_DIR / "eval.txt"
CALIB_TEXT = DATA_DIR / "calib.txt"


def zoo_root() -> Path:
    """The zoo folder: $ASCQ_ZOO, else the project's `zoo/`."""
    return Path(os.environ.get("ASCQ_ZOO", PROJECT_DIR / "zoo"))


def portable_name(path: str | os.PathLike) -> str:
    """How a manifest or model card names a local file or folder, never by an absolute path: relative to the
    project for its own data (`ascq/data/eval.txt`), a zoo entry by its name, anything else by its base name."""
    text = str(path)
    resolved = Path(text).resolve()
    if not Path(text).exists():
        return text  # a Hub id
    if resolved.is_relative_to(PROJECT_DIR):
        return resolved.relative_to(PROJECT_DIR).as_posix()
    return resolved.name
