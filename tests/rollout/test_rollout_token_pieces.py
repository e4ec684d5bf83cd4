"""The per-token text of the trajectory files (``trajectory_tokens``): each token's piece, joined,
is the decoded response, for byte-level tokens that split a character and for SentencePiece's
leading-space marker, which a token decoded alone loses."""

from __future__ import annotations

from lightrft.rollout.metrics import token_pieces


def _bytes_decode(rows: list[list[int]]) -> list[str]:
    """A byte-level tokenizer: each id is one byte (as GPT-2 / Qwen BPE at worst)."""
    return [bytes(r).decode("utf-8", errors="replace") for r in rows]


VOCAB = ["▁Hello", "▁wor", "ld", "!", "▁", "x"]


def _sentencepiece_decode(rows: list[list[int]]) -> list[str]:
    """SentencePiece: ``▁`` is a space, and the decoded text drops its leading space."""
    return ["".join(VOCAB[i] for i in r).replace("▁", " ").removeprefix(" ") for r in rows]


def test_a_character_split_over_byte_tokens_goes_to_its_last_token():
    text = "añ日😀b"
    ids = list(text.encode())
    pieces = token_pieces(_bytes_decode, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == text
    # ñ is 2 bytes, 日 3, 😀 4: the earlier bytes of each get "", the last the character.
    assert pieces == ["a", "", "ñ", "", "", "日", "", "", "", "😀", "b"]


def test_a_cut_character_at_the_end_stays_visible():
    ids = list("a日".encode())[:-1]  # a response cut inside a character
    assert token_pieces(_bytes_decode, ids) == ["a", "", "\ufffd"]


def test_sentencepiece_spaces_are_kept_between_tokens():
    ids = [0, 1, 2, 3, 4, 5]
    pieces = token_pieces(_sentencepiece_decode, ids)
    assert pieces == ["Hello", " wor", "ld", "!", " ", "x"]
    assert "".join(pieces) == _sentencepiece_decode([ids])[0]


def test_an_empty_response_has_no_pieces():
    assert token_pieces(_bytes_decode, []) == []
