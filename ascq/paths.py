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
