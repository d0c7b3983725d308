"""`plait.data.text`: the character vocabulary and next-token windows."""

from __future__ import annotations

import pytest
import torch

from plait.data.text import BlockDataset, CharVocab, load_text_split


def test_vocab_round_trip_and_unknown_characters() -> None:
    vocab = CharVocab.from_text("hello world")
    assert vocab.chars == " dehlorw" and vocab.size == 8
    assert vocab.decode(vocab.encode("old row")) == "old row"
    assert vocab.encode("z").tolist() == [0]  # unknown: index 0


def test_block_windows_and_bad_sizes() -> None:
    data = BlockDataset(torch.arange(10), block_size=3)
    assert len(data) == 3
    x, y = data[1]
    assert x.tolist() == [3, 4, 5] and y.tolist() == [4, 5, 6]
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        BlockDataset(torch.arange(10), block_size=0)
    with pytest.raises(ValueError, match="too few"):
        BlockDataset(torch.arange(3), block_size=3)


def test_text_split_covers_the_corpus() -> None:
    train, val, vocab = load_text_split(block_size=64, val_fraction=0.1)
    assert len(train) > 5 * len(val) > 0
    x, _ = train[0]
    assert x.shape == (64,) and int(x.max()) < vocab.size
