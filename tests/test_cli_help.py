"""Help text a user reads: extras named literally, option names never cut, wide enough for vLLM's flags."""

from __future__ import annotations

from ascq.cli import expand_multi_value_flags, main


def help_of(capsys, *argv: str) -> str:
    try:
        main([*argv, "--help"])
    except SystemExit as exc:
        assert exc.code in (0, None)
    return capsys.readouterr().out


def test_import_gguf_help_names_its_extra(capsys):
    assert "(needs the [gguf] extra)" in help_of(capsys, "zoo", "import-gguf")


def test_serve_help_shows_every_flag_whole(capsys):
    text = help_of(capsys, "serve")
    for flag in (
        "--served-model-name",
        "--enable-expert-parallel",
        "--max-num-batched-tokens",
        "--gpu-memory-utilization",
        "--speculative-config",
    ):
        assert flag in text, flag
    assert "…" not in text


def test_multi_value_flags_become_repeated_options():
    argv = ["serve", "m", "--served-model-name", "a", "b", "--port", "1"]
    assert expand_multi_value_flags(argv) == [
        "serve",
        "m",
        "--served-model-name",
        "a",
        "--served-model-name",
        "b",
        "--port",
        "1",
    ]
