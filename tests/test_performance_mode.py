"""--performance-mode presets set only the scheduler knobs the user left unset: an explicit flag always
wins."""

from __future__ import annotations

import pytest

from ascq.core.errors import UnsupportedError
from ascq.runtime.engine.engine_args import PERFORMANCE_MODES, SCHEDULER_DEFAULTS, EngineArgs
from ascq.runtime.server.launcher import launch_server, stop_server


def test_unset_knobs_take_the_preset(tiny_llama_dir):
    args = EngineArgs(tiny_llama_dir, performance_mode="latency")
    assert args.max_num_seqs == PERFORMANCE_MODES["latency"]["max_num_seqs"]
    assert args.max_num_batched_tokens == PERFORMANCE_MODES["latency"]["max_num_batched_tokens"]


@pytest.mark.parametrize("mode", sorted(PERFORMANCE_MODES))
def test_explicit_values_win_even_when_equal_to_the_defaults(tiny_llama_dir, mode):
    explicit = dict(SCHEDULER_DEFAULTS)  # the values a user types that happen to equal the defaults
    args = EngineArgs(tiny_llama_dir, performance_mode=mode, **explicit)
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (
        explicit["max_num_seqs"],
        explicit["max_num_batched_tokens"],
    )


def test_no_mode_gives_the_defaults(tiny_llama_dir):
    args = EngineArgs(tiny_llama_dir)
    assert (args.max_num_seqs, args.max_num_batched_tokens) == tuple(SCHEDULER_DEFAULTS.values())


def test_unknown_mode_is_refused(tiny_llama_dir):
    with pytest.raises(UnsupportedError, match="performance mode"):
        EngineArgs(tiny_llama_dir, performance_mode="fastest")


def test_serve_with_max_num_seqs_64_and_latency_mode_runs_64_sequences(tiny_llama_dir, tmp_path):
    log = tmp_path / "serve.log"
    process, _ = launch_server(tiny_llama_dir, log, "--max-num-seqs", "64", "--performance-mode", "latency")
    try:
        assert "max_num_seqs: 64" in log.read_text()
    finally:
        stop_server(process)
