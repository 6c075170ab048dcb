"""Real clients against a live `ascq serve MODEL` on loopback, each installed from PyPI in its own venv
outside the repository (created once, reused while its pins stay the same): guidellm (a short concurrency
sweep), lm-evaluation-harness (local-completions and local-chat-completions on the tasks in lm_eval_tasks/)
and the openai SDK (Responses API, streamed tool calls). Prints `PASS name: detail` or `FAIL name: reason`
per client check and exits non-zero when any failed. No client may reach the Hugging Face hub: the hub is
switched offline and every tokenizer is the model's own folder. Reports are written to results/. The server
inherits this environment: on a busy shared machine, OMP_NUM_THREADS=1 (docs/benchmarks.md, real clients).

    PYTHONPATH=. python benchmarks/clients/run_all.py --model zoo/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import guidellm_client
import lm_eval_client
import openai_client
from common import RESULTS_DIR, ClientResult
from server import serving
from venvs import ensure_venv

from ascq.core.errors import AscqError
from ascq.formats.manifest import resolve_entry

REQUIREMENTS = {
    "guidellm": guidellm_client.REQUIREMENTS,
    "lm-eval": lm_eval_client.REQUIREMENTS,
    "openai": openai_client.REQUIREMENTS,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="zoo/smollm2-135m-instruct", help="served under this name")
    parser.add_argument("--clients", nargs="+", choices=list(REQUIREMENTS), default=list(REQUIREMENTS))
    parser.add_argument("--port", type=int, default=None, help="server port (default: a free one)")
    parser.add_argument("--venv-root", type=Path, default=Path.home() / ".cache" / "ascq-clients")
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="logs, raw outputs (default: new temp dir)"
    )
    parser.add_argument("--guidellm-streams", type=int, nargs="+", default=[1, 4, 16], help="concurrencies")
    parser.add_argument("--guidellm-requests", type=int, default=16, help="requests per concurrency")
    parser.add_argument("--guidellm-max-seconds", type=int, default=180, help="time limit per concurrency")
    parser.add_argument("--guidellm-data", default="prompt_tokens=128,output_tokens=64")
    parser.add_argument("--lm-eval-concurrent", type=int, default=4, help="lm_eval num_concurrent")
    return parser.parse_args(argv)


def install_clients(clients: list[str], venv_root: Path) -> dict[str, Path]:
    """Each client's venv python, installing what is missing first (before the server starts)."""
    venv_root.mkdir(parents=True, exist_ok=True)
    return {c: ensure_venv(venv_root / c, REQUIREMENTS[c], venv_root / f"{c}-pip.log") for c in clients}


def run_client(
    name: str, python: Path, base_url: str, args: argparse.Namespace, work_dir: Path
) -> list[ClientResult]:
    tokenizer_dir = resolve_entry(args.model).resolve()
    if name == "guidellm":
        return [
            guidellm_client.run_guidellm(
                python, base_url, args.model, tokenizer_dir, work_dir, args.guidellm_streams,
                args.guidellm_requests, args.guidellm_max_seconds, args.guidellm_data,
            )
        ]  # fmt: skip
    if name == "lm-eval":
        return lm_eval_client.run_lm_eval(
            python, base_url, args.model, tokenizer_dir, work_dir, args.lm_eval_concurrent
        )
    return openai_client.run_openai(python, base_url, args.model, work_dir)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="ascq-clients-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs in {work_dir}", file=sys.stderr, flush=True)
    try:
        resolve_entry(args.model)
        pythons = install_clients(args.clients, args.venv_root)
        results: list[ClientResult] = []
        with serving(args.model, args.port, work_dir / "server.log") as base_url:
            for name in args.clients:
                start = time.monotonic()
                try:
                    client_results = run_client(name, pythons[name], base_url, args, work_dir)
                except Exception as e:  # one broken client must not hide the others' results
                    client_results = [ClientResult(name, False, f"{type(e).__name__}: {e}")]
                for result in client_results:
                    print(result.line(), flush=True)
                    for line in result.extra_lines:
                        print(f"    {line}", flush=True)
                print(f"    ({name}: {time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)
                results += client_results
    except AscqError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = [line for r in results for line in [r.line(), *(f"    {x}" for x in r.extra_lines)]]
    summary_dir = RESULTS_DIR if set(args.clients) == set(REQUIREMENTS) else work_dir  # results/: full runs
    summary_dir.mkdir(parents=True, exist_ok=True)
    (summary_dir / "summary.txt").write_text("\n".join(summary) + "\n")
    failed = [r.name for r in results if not r.ok]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
