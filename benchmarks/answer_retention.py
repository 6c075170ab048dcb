"""Answer retention (issue 44): of the short factual chat questions in `data/factual_questions.jsonl`
that the full-precision model answers correctly, how many a quantized row still answers correctly.

Every question is one user turn put through the model's own chat template (the tokenizer's
`apply_chat_template` with the assistant turn opened) and answered greedily in at most `--max-tokens` tokens.
An answer is correct when the question's regular expression is found in it (`re.search`, case-insensitive).
ascq entries (and the FP source) are answered by ascq's runtime in bf16, the way users run them (the offline
`LLM` API); GGUF files by llama.cpp's `llama-server` on loopback, sent the very same prompt token ids on its
`/completion` endpoint (temperature 0, top-k 1), so both runtimes see one prompt.

    python benchmarks/answer_retention.py --model zoo/smollm2-135m-instruct [--entry NAME=zoo/x ...] \
        [--gguf NAME=file.gguf ... --llama-server LLAMA/build/bin/llama-server] [--show]

prints, per row, the correct answers and the retention against the FP model (`--model`, answered by ascq).
`benchmarks/quality_vs_anchors.py` scores its rows with the same functions.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

QUESTIONS = Path(__file__).resolve().parent / "data" / "factual_questions.jsonl"
MAX_TOKENS = 32  # short answers: the regex is searched in the whole answer
QUESTION_FIELDS = ("id", "question", "answer", "example")


@dataclass(frozen=True)
class Question:
    id: str
    question: str
    answer: re.Pattern[str]  # a correct answer contains a match (case-insensitive)
    example: str  # a correct answer, written with the question (the test checks `answer` accepts it)


def load_questions(path: Path = QUESTIONS) -> list[Question]:
    """The question set; a malformed line (bad JSON, missing / unknown / empty field, bad regex, repeated id
    or question) raises ValueError naming the line."""
    questions: list[Question] = []
    seen_ids: set[str] = set()
    seen_questions: set[str] = set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not JSON ({error})") from None
        if not isinstance(record, dict) or sorted(record) != sorted(QUESTION_FIELDS):
            raise ValueError(f"{where}: want exactly the fields {', '.join(QUESTION_FIELDS)}")
        if not all(isinstance(record[f], str) and record[f].strip() for f in QUESTION_FIELDS):
            raise ValueError(f"{where}: every field must be a non-empty string")
        if record["id"] in seen_ids or record["question"] in seen_questions:
            raise ValueError(f"{where}: repeated id or question ({record['id']})")
        seen_ids.add(record["id"])
        seen_questions.add(record["question"])
        try:
            pattern = re.compile(record["answer"], re.IGNORECASE)
        except re.error as error:
            raise ValueError(f"{where}: answer is not a regular expression ({error})") from None
        questions.append(Question(record["id"], record["question"], pattern, record["example"]))
    return questions


def is_correct(question: Question, answer: str) -> bool:
    return question.answer.search(answer) is not None


def correct_ids(questions: Sequence[Question], answers: Sequence[str]) -> set[str]:
    """The ids of the questions whose answer (same order) is correct."""
    if len(questions) != len(answers):
        raise ValueError(f"{len(questions)} questions but {len(answers)} answers")
    return {q.id for q, a in zip(questions, answers, strict=True) if is_correct(q, a)}


def retention(reference: set[str], row: set[str]) -> tuple[int, int]:
    """(how many of the reference's correct questions the row also answers correctly, how many the
    reference answers correctly)."""
    return len(reference & row), len(reference)


def chat_prompt_ids(tokenizer: Any, questions: Sequence[Question]) -> list[list[int]]:
    """One user turn per question through the tokenizer's chat template, assistant turn opened (as
    `LLM.chat`), as token ids: the prompt every runtime is given."""
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q.question}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        for q in questions
    ]


def ascq_answers(entry: Path, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[str]:
    """Greedy answers of an ascq entry (or plain checkpoint) served by ascq's runtime in bf16."""
    from ascq import LLM, SamplingParams

    llm = LLM(str(entry), dtype="bfloat16")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        return [output.outputs[0].text for output in llm.generate(prompts, params)]
    finally:
        llm.shutdown()


def llama_cpp_answers(
    server_binary: Path, gguf: Path, prompts: list[list[int]], max_tokens: int = MAX_TOKENS, threads: int = 2
) -> list[str]:
    """Greedy answers of a GGUF file served by llama-server (one slot, prompt token ids on `/completion`);
    the server is stopped on every path."""
    import httpx

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from vs_llamacpp import LlamaServer

    server = LlamaServer(str(server_binary), str(gguf), threads, parallel=1, ctx_size=2048)
    try:
        answers = []
        for prompt in prompts:
            body = {
                "prompt": prompt,
                "n_predict": max_tokens,
                "temperature": 0.0,
                "top_k": 1,
                "cache_prompt": False,
                "stream": False,
            }
            response = httpx.post(f"{server.url}/completion", json=body, timeout=300)
            response.raise_for_status()
            answers.append(response.json()["content"])
        return answers
    finally:
        server.stop()


def named_paths(values: Sequence[str] | None, flag: str) -> list[tuple[str, Path]]:
    """NAME=PATH arguments (a bare PATH is named after its file / folder); a missing path exits."""
    pairs = []
    for value in values or ():
        name, _, path = value.rpartition("=") if "=" in value else ("", "", value)
        if not Path(path).exists():
            sys.exit(f"{flag} {value}: {path} does not exist")
        pairs.append((name or Path(path).name, Path(path)))
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="FP checkpoint (the reference and the tokenizer)")
    parser.add_argument("--entry", action="append", help="NAME=PATH of an ascq entry (repeatable)")
    parser.add_argument("--gguf", action="append", help="NAME=PATH of a GGUF file (repeatable)")
    parser.add_argument("--llama-server", help="llama-server binary (for --gguf)")
    parser.add_argument("--questions", default=str(QUESTIONS))
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--threads", type=int, default=2, help="llama-server threads")
    parser.add_argument("--show", action="store_true", help="print every answer")
    args = parser.parse_args()
    ggufs = named_paths(args.gguf, "--gguf")
    if ggufs and not (args.llama_server and Path(args.llama_server).exists()):
        sys.exit("--gguf needs --llama-server, an existing llama-server binary")
    from transformers import AutoTokenizer

    questions = load_questions(Path(args.questions))
    prompts = chat_prompt_ids(AutoTokenizer.from_pretrained(args.model), questions)
    rows = [("FP", lambda: ascq_answers(Path(args.model), prompts, args.max_tokens))]
    rows += [
        (n, lambda p=p: ascq_answers(p, prompts, args.max_tokens))
        for n, p in named_paths(args.entry, "--entry")
    ]
    rows += [
        (n, lambda p=p: llama_cpp_answers(Path(args.llama_server), p, prompts, args.max_tokens, args.threads))
        for n, p in ggufs
    ]
    reference: set[str] = set()
    for name, answer in rows:
        answers = answer()
        correct = correct_ids(questions, answers)
        reference = reference if name != "FP" else correct
        kept, of = retention(reference, correct)
        print(f"{name}: {len(correct)}/{len(questions)} correct, retains {kept}/{of} of FP's", flush=True)
        if args.show:
            for q, a in zip(questions, answers, strict=True):
                print(f"  [{'x' if q.id in correct else ' '}] {q.id}: {a.strip()!r}")


if __name__ == "__main__":
    main()
