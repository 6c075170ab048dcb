"""Structured outputs (JSON schema, JSON object, regex, choice, EBNF grammar) with xgrammar, vLLM's default
engine.

`StructuredOutputsParams` is vLLM's request-side shape (exactly one constraint). `StructuredOutputManager`
compiles each constraint once (cached by its canonical JSON), keeps one `GrammarMatcher` per sequence and,
each step, fills one token bitmask row per sequence that the sampler applies to the logits as a batch.
xgrammar is an optional dependency (`pip install ascq[structured]`): a request that needs it without it
installed fails with a clear error.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from typing import Any

import torch

from ascq.core.errors import UnsupportedError

MAX_CACHED_GRAMMARS = 256


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        chosen = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(
                f"structured outputs need exactly one of json, regex, choice, grammar, json_object; got "
                f"{', '.join(chosen) or 'none'}"
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured outputs choice must be a non-empty list of strings")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"structured outputs json is not a valid JSON schema document: {exc.msg}"
                ) from exc
        if self.json is not None and not isinstance(self.json, dict | bool):
            raise ValueError("structured outputs json must be a JSON schema object")

    @property
    def key(self) -> str:
        """Canonical text of the constraint: the compile cache key (no two constraints share one)."""
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}, sort_keys=True)


def require_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:
        raise UnsupportedError(
            "structured outputs need the xgrammar package: pip install 'ascq[structured]'"
        ) from exc
    return xgrammar


def choice_regex(choices: list[str]) -> str:
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


class StructuredOutputManager:
    """Grammar compilation and per-sequence matchers for one tokenizer and vocabulary (created lazily)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler = None
        self._compiled: dict[str, Any] = {}
        self.matchers: dict[int, Any] = {}  # id(request) -> GrammarMatcher

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar; ValueError for an invalid schema / regex / grammar (a 400 at the server)."""
        compiled = self._compiled.get(params.key)
        if compiled is not None:
            return compiled
        compiler = self._get_compiler()
        try:
            if params.json is not None:
                compiled = compiler.compile_json_schema(json.dumps(params.json), any_whitespace=False)
            elif params.json_object:
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif params.regex is not None:
                compiled = compiler.compile_regex(params.regex)
            elif params.choice is not None:
                compiled = compiler.compile_regex(choice_regex(params.choice))
            else:
                compiled = compiler.compile_grammar(params.grammar)
        except (
            Exception
        ) as exc:  # xgrammar reports bad input as RuntimeError (some as other types): user input
            kind = next(f.name for f in fields(params) if getattr(params, f.name) not in (None, False))
            reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", " ".join(str(exc).split()))  # drop the C++ location
            raise ValueError(f"invalid structured outputs {kind}: {reason[:300]}") from exc
        if len(self._compiled) >= MAX_CACHED_GRAMMARS:
            self._compiled.pop(next(iter(self._compiled)))
        self._compiled[params.key] = compiled
        return compiled

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            xgr = require_xgrammar()
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def add(self, key: int, params: StructuredOutputsParams) -> None:
        import xgrammar as xgr

        self.matchers[key] = xgr.GrammarMatcher(self.compile(params))

    def remove(self, key: int) -> None:
        self.matchers.pop(key, None)

    def bitmask(self, keys: list[int]) -> torch.Tensor | None:
        """int32 [len(keys), ceil(vocab/32)] allowed-token bits (all set for unconstrained rows), or None."""
        rows = [(i, self.matchers[k]) for i, k in enumerate(keys) if k in self.matchers]
        if not rows:
            return None
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(len(keys), self.vocab_size)
        for i, matcher in rows:
            matcher.fill_next_token_bitmask(mask, i)
        return mask

    def accept(self, key: int, token_id: int) -> bool:
        """Advance the sequence's matcher; True when the grammar has terminated (its output is complete)."""
        matcher = self.matchers.get(key)
        if matcher is None:
            return False
        if not matcher.accept_token(token_id):
            raise RuntimeError(f"token {token_id} was sampled although the grammar mask forbids it")
        return matcher.is_terminated()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """-inf on every token whose bit is clear (in place, xgrammar's batched kernel)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=logits.shape[-1])
