"""Qwen's real tokenizer (Qwen2 / Qwen2.5 / Qwen3 share it), built without a model hub from the
BPE ranks in ``qwen/qwen.tiktoken.xz`` (see ``qwen/README.md``): the vocabulary is the ranked
byte strings, each merge is the pair that byte-pair encoding with the lower ranks leaves for a
token, and the pre-tokenizer, normaliser and added tokens are Qwen2's."""

from __future__ import annotations

import base64
import lzma
from pathlib import Path

RANKS = Path(__file__).with_name("qwen") / "qwen.tiktoken.xz"
# Qwen2's pre-tokenizer split (its tokenizer.json's ``Split`` pattern).
PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The added tokens from id 151643 on, in order; the ``<|...|>`` ones are special.
ADDED = (
    "<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|> <|box_start|> "
    "<|box_end|> <|quad_start|> <|quad_end|> <|vision_start|> <|vision_end|> <|vision_pad|> "
    "<|image_pad|> <|video_pad|> <tool_call> </tool_call> <|fim_prefix|> <|fim_middle|> "
    "<|fim_suffix|> <|fim_pad|> <|repo_name|> <|file_sep|> <tool_response> </tool_response> "
    "<think> </think>"
).split()


def _byte_chars() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for each byte (``Ġ`` for a space, ``Ċ`` for a newline)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


def _merge_of(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The last merge that makes ``token``: BPE over its bytes with the merges ranked below it."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        pairs = [(ranks.get(parts[i] + parts[i + 1], rank), i) for i in range(len(parts) - 1)]
        best, i = min(pairs)
        if best >= rank:
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise ValueError(f"{token!r} (rank {rank}) is not one merge of two lower tokens")
    return parts[0], parts[1]


def qwen_tokenizer():
    """A ``PreTrainedTokenizerFast`` with Qwen's vocabulary, merges and added tokens (no chat
    template: the caller sets one)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pre
    from transformers import PreTrainedTokenizerFast

    ranks = {}
    for line in lzma.decompress(RANKS.read_bytes()).splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    chars = _byte_chars()
    text = lambda b: "".join(chars[x] for x in b)  # noqa: E731
    merges = [
        tuple(map(text, _merge_of(t, r, ranks)))
        for t, r in sorted(ranks.items(), key=lambda kv: kv[1])
        if len(t) > 1
    ]
    core = Tokenizer(models.BPE(vocab={text(t): r for t, r in ranks.items()}, merges=merges))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre.Sequence(
        [
            pre.Split(Regex(PATTERN), behavior="isolated"),
            pre.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    core.add_tokens([AddedToken(t, special=t.startswith("<|"), normalized=False) for t in ADDED])
    assert core.token_to_id("<|endoftext|>") == len(ranks) == 151643
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
