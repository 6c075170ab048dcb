"""Shared test fixtures: paths of the committed fixture models and the bundled eval/calibration text."""

from __future__ import annotations

from pathlib import Path

import pytest

from ascq.paths import CALIB_TEXT, EVAL_TEXT, PROJECT_DIR

ZOO = PROJECT_DIR / "zoo"
TINY_LLAMA = ZOO / "tiny-llama"
TINY_DEEPSEEK_MOE = ZOO / "tiny-deepseek-moe"


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    return TINY_LLAMA


@pytest.fixture(scope="session")
def tiny_deepseek_moe_dir() -> Path:
    return TINY_DEEPSEEK_MOE


@pytest.fixture(scope="session")
def eval_text_path() -> Path:
    return EVAL_TEXT


@pytest.fixture(scope="session")
def calib_text_path() -> Path:
    return CALIB_TEXT
