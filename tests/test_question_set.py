"""The answer-retention question set (issue 44) and the scorer's matching: the file's format, that each
regex accepts the correct answer written beside it and rejects non-answers, and the retention count."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from answer_retention import (  # noqa: E402
    QUESTIONS,
    correct_ids,
    is_correct,
    load_questions,
    retention,
)

NON_ANSWERS = ("", "I don't know.", "I'm sorry, I cannot answer that question.", "Sure! Here is the answer:")


def test_question_file_has_at_least_50_well_formed_questions() -> None:
    questions = load_questions(QUESTIONS)
    assert len(questions) >= 50
    assert all(q.question.rstrip().endswith("?") for q in questions)


@pytest.mark.parametrize("question", load_questions(QUESTIONS), ids=lambda q: q.id)
def test_regex_accepts_its_example_in_any_case_and_rejects_non_answers(question) -> None:
    assert is_correct(question, question.example)
    assert is_correct(question, question.example.upper())
    assert is_correct(question, question.example.lower())
    assert not any(is_correct(question, text) for text in NON_ANSWERS)


def test_matching_is_a_search_on_word_boundaries() -> None:
    by_id = {q.id: q for q in load_questions(QUESTIONS)}
    assert is_correct(by_id["capital-france"], "Sure! The capital of France is PARIS, a large city.")
    assert not is_correct(by_id["capital-france"], "The capital of France is Lyon.")
    assert not is_correct(by_id["days-week"], "A week is approximately 315 days.")
    assert is_correct(by_id["days-week"], "There are 7 days in a week.")
    assert not is_correct(by_id["red-planet"], "The Red Planet is Venus.")
    assert not is_correct(by_id["star-solar-system"], "It is called Sunday.")


def test_correct_ids_and_retention() -> None:
    questions = load_questions(QUESTIONS)[:3]
    fp = correct_ids(questions, [q.example for q in questions])
    row = correct_ids(questions, [questions[0].example, "no idea", questions[2].example])
    assert fp == {q.id for q in questions}
    assert row == {questions[0].id, questions[2].id}
    assert retention(fp, row) == (2, 3)
    # a question only the row gets right does not count: retention is of the reference's correct set
    assert retention({questions[0].id}, row) == (1, 1)
    with pytest.raises(ValueError, match="3 questions but 2 answers"):
        correct_ids(questions, ["a", "b"])


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not JSON"),
        (json.dumps({"id": "a", "question": "Q?", "answer": "x"}), "exactly the fields"),
        (
            json.dumps({"id": "a", "question": "Q?", "answer": "x", "example": "x", "more": 1}),
            "exactly the fields",
        ),
        (json.dumps({"id": "a", "question": "Q?", "answer": "", "example": "x"}), "non-empty string"),
        (
            json.dumps({"id": "a", "question": "Q?", "answer": "(", "example": "x"}),
            "not a regular expression",
        ),
    ],
)
def test_malformed_lines_are_rejected_with_their_line_number(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "q.jsonl"
    good = json.dumps({"id": "ok", "question": "Fine?", "answer": "yes", "example": "yes"})
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(ValueError, match=rf"q.jsonl:2: .*{message}"):
        load_questions(path)


def test_repeated_ids_are_rejected(tmp_path: Path) -> None:
    path = tmp_path / "q.jsonl"
    line = json.dumps({"id": "same", "question": "Fine?", "answer": "yes", "example": "yes"})
    other = json.dumps({"id": "same", "question": "Other?", "answer": "no", "example": "no"})
    path.write_text(f"{line}\n{other}\n")
    with pytest.raises(ValueError, match="repeated id or question"):
        load_questions(path)
