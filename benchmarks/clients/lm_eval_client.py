"""lm-evaluation-harness against the server on the hand-written tasks in lm_eval_tasks/ (the hub is not
reachable): `local-completions` scores the multiple-choice task by loglikelihood (echoed prompt logprobs) and
generates the arithmetic answers; `local-chat-completions` generates them through the chat template. Passes
when lm_eval exits 0 with a score for every task; each run's results go to results/lm_eval_<api>.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from common import RESULTS_DIR, ClientResult, log_tail, run_logged

# lm-eval's api extra leaves transformers out, which its huggingface tokenizer backend needs
REQUIREMENTS = ["torch==2.13.0", "lm-eval[api]==0.4.13", "transformers==5.25.0"]
TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
RUNS = {  # name: (lm_eval model, route, tasks, extra flags)
    "completions": ("local-completions", "completions", ["ascq_mc", "ascq_arith"], []),
    "chat": ("local-chat-completions", "chat/completions", ["ascq_arith"], ["--apply_chat_template"]),
}


def run_lm_eval(
    python: Path, base_url: str, model: str, tokenizer_dir: Path, work_dir: Path, num_concurrent: int
) -> list[ClientResult]:
    return [run_one(name, python, base_url, model, tokenizer_dir, work_dir, num_concurrent) for name in RUNS]


def run_one(
    name: str,
    python: Path,
    base_url: str,
    model: str,
    tokenizer_dir: Path,
    work_dir: Path,
    num_concurrent: int,
) -> ClientResult:
    lm_model, route, tasks, extra = RUNS[name]
    output = work_dir / f"lm_eval_{name}"
    model_args = ",".join([
        f"base_url={base_url}/v1/{route}",
        f"model={model}",
        f"tokenizer={tokenizer_dir}",
        "tokenizer_backend=huggingface",
        f"num_concurrent={num_concurrent}",
        "max_retries=1",
    ])  # fmt: skip
    command = [
        str(python.parent / "lm_eval"),
        "--model", lm_model,
        "--model_args", model_args,
        "--tasks", ",".join(tasks),
        "--include_path", str(TASKS_DIR),
        "--output_path", str(output),
        "--log_samples",
        *extra,
    ]  # fmt: skip
    log = work_dir / f"lm_eval_{name}.log"
    label = f"lm-eval {lm_model}"
    code = run_logged(command, log, timeout_s=1200, cwd=TASKS_DIR)  # data_files are relative to TASKS_DIR
    results = sorted(output.glob("*/results_*.json"))
    if code != 0 or not results:
        return ClientResult(label, False, f"exit {code}; {log_tail(log)}")
    saved = RESULTS_DIR / f"lm_eval_{name}.json"
    saved.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(results[-1], saved)
    scores = json.loads(saved.read_text())["results"]
    missing = [t for t in tasks if t not in scores]
    detail = format_scores(scores) + (f"; no score for {missing}" * bool(missing))
    return ClientResult(label, not missing, detail)


def format_scores(results: dict[str, dict]) -> str:
    """`task metric[,filter] value` for every metric lm_eval reported (stderr left out)."""
    parts = []
    for task, metrics in sorted(results.items()):
        for key, value in metrics.items():
            metric, _, filter_name = key.partition(",")
            if isinstance(value, float) and not metric.endswith("_stderr"):
                shown = metric if filter_name == "none" else f"{metric}[{filter_name}]"
                parts.append(f"{task} {shown} {value:.2f}")
    return ", ".join(parts)
