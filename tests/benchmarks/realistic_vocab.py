"""A realistic vocabulary for the benchmarks: a byte-level BPE of 32,768 tokens trained here.

The tiny character tokenizer of the tests (112 tokens) makes the LM head negligible; in real models
it is a large share of every phase (Qwen2.5-0.5B: 136M of 494M parameters). There is no model hub
here, so the benchmarks train a BPE on the GSM8K copy (``../shared/data/gsm8k``) plus Python
standard-library sources (GSM8K alone has too few distinct pairs for 32k merges): about a minute on
the 2-core machine. Used by ``phases.py`` and ``bench_grpo_vs_trl.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

from lightrft.tasks.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS

GSM8K = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k" / "train.jsonl"


def gsm8k_texts() -> list[dict]:
    if not GSM8K.is_file():
        raise SystemExit(f"needs the GSM8K copy at {GSM8K}")
    return [json.loads(line) for line in GSM8K.read_text().splitlines() if line.strip()]


def stdlib_texts(limit_bytes: int = 24 * 2**20) -> list[str]:
    """Python standard-library sources, up to ``limit_bytes`` characters."""
    import sysconfig

    out, size = [], 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if size > limit_bytes:
            break
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append(text)
        size += len(text)
    return out


def train_bpe(records: list[dict], vocab_size: int = 32768):
    """A byte-level BPE on GSM8K questions and answers plus stdlib sources, as a transformers
    tokenizer with the tiny models' ChatML template and special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = [r["question"] + "\n" + r["answer"] for r in records] + stdlib_texts()
    tok.train_from_iterator(texts, trainer)
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    out.chat_template = CHAT_TEMPLATE
    return out
