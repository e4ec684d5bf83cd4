import json

import pytest


@pytest.fixture(scope="session")
def tok(tiny_model_dir):
    """The tiny char-level tokenizer (ChatML template, eos <|im_end|>, pad <|endoftext|>)."""
    from lightrft.models import load_tokenizer

    return load_tokenizer(tiny_model_dir)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
