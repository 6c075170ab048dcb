"""Packaging and first-hour CLI: the wheel ships the recipes, `python -m ascq`, `--version`, no torch for
`recipes`."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ascq import __version__, paths
from ascq.core.errors import AscqError

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_ships_recipes_and_main(tmp_path: Path) -> None:
    pytest.importorskip("setuptools")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            "-q",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    names = zipfile.ZipFile(next(tmp_path.glob("ascq-*.whl"))).namelist()
    shipped = {Path(n).stem for n in names if n.startswith("ascq/recipes/") and n.endswith(".yaml")}
    assert shipped == set(paths.shipped_recipes()) and len(shipped) >= 9
    assert "ascq/__main__.py" in names and "ascq/data/eval.txt" in names


def test_installed_zoo_root_is_not_in_site_packages(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("ASCQ_ZOO", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.setattr(paths, "PROJECT_DIR", tmp_path / "site-packages")  # what an installed package sees
    assert paths.zoo_root() == tmp_path / "ascq" / "zoo"
    monkeypatch.setattr(paths, "PROJECT_DIR", ROOT)
    assert paths.zoo_root() == ROOT / "zoo"


def test_version_and_python_m_and_recipes_without_torch(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ascq", "--version"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
    )
    assert out.returncode == 0 and out.stdout.strip() == f"ascq {__version__}"
    code = (
        "import sys; from ascq.cli import main\n"
        "try:\n    main(['recipes'])\nexcept SystemExit as e:\n    assert not e.code\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "main(['--help'])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
    )
    assert proc.returncode == 0, proc.stderr
    for name in paths.shipped_recipes():
        assert f"\n{name} " in "\n" + proc.stdout


def test_generate_resolves_zoo_names_and_explains_hub_ids(capsys) -> None:
    from ascq.cli import main

    # the committed fixture, by name
    main(["generate", "tiny-llama", "--prompt", "def f(", "--max-tokens", "2"])
    assert capsys.readouterr().out.strip()
    with pytest.raises(SystemExit) as info:
        main(["serve", "someorg/some-model"])
    err = capsys.readouterr().err
    assert info.value.code == 1 and "ascq zoo pull someorg/some-model" in err and err.count("\n") == 1


def test_convert_resolves_zoo_names() -> None:
    from ascq.quantize.convert import resolve_model_dir

    assert resolve_model_dir("tiny-llama") == paths.zoo_root() / "tiny-llama"
    with pytest.raises(AscqError, match="does not exist"):
        resolve_model_dir("no-such-entry")
