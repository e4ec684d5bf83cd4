"""Audio question answering with choices (R1-AQA style): records for the prompt dataset.

R1-AQA (Li et al. 2025, arXiv:2503.11197) trains Qwen2-Audio with GRPO on multiple-choice audio
questions (AVQA), asking for the chosen option inside ``<answer></answer>`` and rewarding an exact
option match. :func:`prepare_aqa` turns records holding a question, its options, the correct
option and an audio file into :class:`~lightrft.data.PromptDataset` records:

    {"prompt": "<audio>{question} Options: {a}; {b}; ... Reply with the chosen option inside
     <answer></answer>.", "audios": [audio], "answer": correct option, "label": "choice"}

scored by :class:`~lightrft.rewards.ChoiceVerifier`. Audio paths stay relative to the source
file's directory (the output is written beside it unless ``out`` says otherwise, in which case
relative paths are rewritten against the source directory).
"""

from __future__ import annotations

import os
from pathlib import Path

from lightrft.data.io import DataError, load_records, require_field, write_jsonl


def prepare_aqa(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    question_field: str = "question",
    choices_field: str = "choices",
    answer_field: str = "answer",
    audio_field: str = "audio",
) -> Path:
    """Write ``out`` (a ``.jsonl`` file) with one prompt record per record of ``src``.

    Raises:
        DataError: naming file, line and field: a missing field, options that are not a list of
            at least two, or an answer that is not one of the options.
    """
    records = load_records(src)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(len(records)):
        where = records.where(i)
        question = require_field(records, i, question_field, str)
        choices = require_field(records, i, choices_field, (list, tuple))
        answer = require_field(records, i, answer_field, str)
        audio = require_field(records, i, audio_field, str)
        if len(choices) < 2:
            raise DataError(f"{where}: field {choices_field!r} needs at least two options")
        if answer not in [str(c) for c in choices]:
            raise DataError(
                f"{where}: field {answer_field!r}: {answer!r} is not one of the options {choices}"
            )
        path = Path(audio)
        if not path.is_absolute():
            path = Path(os.path.relpath(records.base_dir(i) / path, out.parent.resolve()))
        # The user prompt: the audio tag, the question, the options, the format.
        options = "; ".join(str(c) for c in choices)
        rows.append(
            {
                "prompt": f"<audio>{question.strip()} Options: {options}. "
                "Reply with the chosen option inside <answer></answer>.",
                "audios": [str(path)],
                "answer": answer,
                "label": "choice",
            }
        )
    write_jsonl(out, rows)
    return out
