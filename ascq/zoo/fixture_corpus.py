"""Corpus and tokenizer of the fixture models: the running interpreter's standard-library `.py` sources.

Split (deterministic for a given interpreter, by the sorted list of relative paths): files under 40 KB at the indices
that are multiples of 40 go to the held-out eval text until it holds ~100 KB; files under 40 KB at the other
multiples of 10 go to the calibration text until ~200 KB. Both are committed (`ascq/data/eval.txt`, `calib.txt`), documents joined by
`<|endoftext|>`. Training uses every other file, minus any whose text appears in the committed eval/calib texts
(so another interpreter version never trains on the held-out split).
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ascq.paths import CALIB_TEXT, EVAL_TEXT

EOT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END]
VOCAB_SIZE = 4096
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data", "__pycache__"}
EVAL_STRIDE, CALIB_STRIDE, MAX_HELD_OUT_FILE_BYTES = 40, 10, 40_000
EVAL_BYTES, CALIB_BYTES = 100_000, 200_000


def stdlib_sources() -> dict[str, str]:
    """{relative path: text} of the standard library's .py files, sorted by path (tests and data tables left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = {}
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS & set(rel.parts[:-1]) or rel.name.startswith("_sysconfigdata"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            sources[rel.as_posix()] = text
    return sources


def _pick(names: list[str], sources: dict[str, str], budget: int) -> list[str]:
    picked, total = [], 0
    for name in names:
        size = len(sources[name].encode())
        if size < MAX_HELD_OUT_FILE_BYTES and total < budget:
            picked.append(name)
            total += size
    return picked


def write_held_out_texts(sources: dict[str, str], eval_path: Path = EVAL_TEXT, calib_path: Path = CALIB_TEXT) -> None:
    """Write the eval and calibration texts from this interpreter's sources (regenerates the committed split)."""
    names = list(sources)
    eval_names = _pick(names[::EVAL_STRIDE], sources, EVAL_BYTES)
    calib_names = _pick([n for i, n in enumerate(names) if i % CALIB_STRIDE == 0 and i % EVAL_STRIDE], sources, CALIB_BYTES)
    for path, picked in ((eval_path, eval_names), (calib_path, calib_names)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(EOT.join(sources[n] for n in picked), encoding="utf-8")


def held_out_documents(paths: tuple[Path, ...] = (EVAL_TEXT, CALIB_TEXT)) -> set[str]:
    return {doc for path in paths for doc in path.read_text(encoding="utf-8").split(EOT)}


def training_texts(sources: dict[str, str]) -> list[str]:
    """Every source text that is in neither committed held-out text."""
    held_out = held_out_documents()
    return [text for text in sources.values() if text not in held_out]


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenization), vocab 4096, special tokens first (ids 0, 1, 2)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def save_hf_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json (ChatML template, <|endoftext|> as bos/eos/pad) for AutoTokenizer."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    hf.save_pretrained(out_dir, save_jinja_files=False)
    # generic class name and 4.x key, so that transformers 4.x (e.g. on Ascend serving stacks) loads it too
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["additional_special_tokens"] = config.pop("extra_special_tokens", [IM_START, IM_END])
    config_path.write_text(json.dumps(config, indent=2) + "\n")
