"""`ascq bench latency|throughput`: vLLM's metric names, result files, and `--compare` catching a real
slowdown (the test slows the model runner's step down itself)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ascq.cli import main
from ascq.paths import PROJECT_DIR
from ascq.runtime.bench.offline import compare, load_result, parse_goodput
from ascq.runtime.worker.model_runner import ModelRunner

BASELINES = PROJECT_DIR / "benchmarks" / "baselines"
WORKLOAD = ["--num-prompts", "8", "--input-len", "24", "--output-len", "12"]


def run_cli(argv: list[str]) -> int:
    try:
        main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def test_throughput_compare_passes_unchanged_and_fails_on_slowdown(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    baseline = tmp_path / "baseline.json"
    common = ["bench", "throughput", "--model", str(tiny_llama_dir), *WORKLOAD]
    assert run_cli([*common, "--save-result", str(baseline), "--goodput", "ttft:60000 tpot:5000"]) == 0
    data = json.loads(baseline.read_text())
    for metric in ("request_throughput", "output_throughput", "total_token_throughput", "request_goodput"):
        assert data["metrics"][metric] > 0
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert all(f"{stat}_{name}_ms" in data["metrics"] for stat in ("mean", "p50", "p90", "p99"))
    assert data["machine"]["num_cpus"] >= 1 and data["bench"] == "throughput"
    # every request met the (loose) SLOs: goodput is the request throughput
    assert data["metrics"]["request_goodput"] == pytest.approx(data["metrics"]["request_throughput"])

    # an unchanged result never regresses, even at 0 %; a second real run is only checked for the passing exit
    # code and its table: how much slower it is depends on what else the machine runs (a CI run beside a
    # 2-thread job came out more than 3x slower than its own baseline)
    assert compare(data["metrics"], data["metrics"], 0.0)[1] is False
    assert run_cli([*common, "--compare", str(baseline), "--max-regression", "1000000"]) == 0
    assert "ratio" in capsys.readouterr().out

    # ten times a step as measured (steps slow down a lot on a loaded shared machine), 400 ms at least
    delay_ms = max(400.0, 10 * data["metrics"]["p50_tpot_ms"])
    execute = ModelRunner.execute

    def slowed_execute(self, out):
        time.sleep(delay_ms / 1000)
        return execute(self, out)

    monkeypatch.setattr(ModelRunner, "execute", slowed_execute)
    assert run_cli([*common, "--compare", str(baseline), "--max-regression", "200"]) == 1
    assert "REGRESSION" in capsys.readouterr().out


def test_latency_reports_batch_latency(tiny_llama_dir: Path, tmp_path: Path) -> None:
    result = tmp_path / "latency.json"
    argv = [
        "bench",
        "latency",
        "--model",
        str(tiny_llama_dir),
        "--batch-size",
        "2",
        "--input-len",
        "8",
        "--output-len",
        "6",
        "--num-iters",
        "2",
        "--num-iters-warmup",
        "0",
        "--save-result",
        str(result),
    ]
    assert run_cli(argv) == 0
    metrics = load_result(result)["metrics"]
    assert metrics["p50_latency_ms"] > 0 and metrics["completed"] == 2
    assert metrics["output_throughput"] == pytest.approx(12 / metrics["duration_s"])


def test_compare_direction_and_threshold() -> None:
    base = {"output_throughput": 100.0, "p99_tpot_ms": 10.0, "completed": 8}
    _, regressed = compare({"output_throughput": 95.0, "p99_tpot_ms": 10.5, "completed": 1}, base, 10)
    assert not regressed  # counts are not compared
    _, regressed = compare({"output_throughput": 80.0, "p99_tpot_ms": 10.0}, base, 10)
    assert regressed  # throughput down 20 %
    _, regressed = compare({"output_throughput": 300.0, "p99_tpot_ms": 12.0}, base, 10)
    assert regressed  # tpot up 20 %, even with throughput up
    assert parse_goodput(["ttft:500,tpot:50", "e2el:9000"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 9000.0}
    with pytest.raises(Exception, match="KEY:MS"):
        parse_goodput(["itl:5"])


@pytest.mark.parametrize("path", sorted(BASELINES.glob("*.json")), ids=lambda p: p.name)
def test_committed_baselines_compare_clean_against_themselves(path: Path) -> None:
    data = load_result(path)
    assert data["machine"]["cpu"] and data["options"]
    report, regressed = compare(data["metrics"], data["metrics"], 0.0)
    assert not regressed and "1.00" in report
