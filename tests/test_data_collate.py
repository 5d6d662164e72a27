"""ChatCollator: right padding, attention mask, IGNORE_INDEX on pads, pad_to_multiple_of; length_batches."""

import pytest
import torch

from data.chat import IGNORE_INDEX
from data.collate import ChatCollator, length_batches
from data.datasets import build_datasets
from tests.data_support import SHAREGPT, tiny_tokenizer


def test_right_pads_ids_mask_and_labels():
    batch = ChatCollator(pad_token_id=0)([
        {"input_ids": [5, 6, 7], "labels": [IGNORE_INDEX, 6, 7]},
        {"input_ids": torch.tensor([8]), "labels": torch.tensor([8])},
    ])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 6, 7], [8, IGNORE_INDEX, IGNORE_INDEX]]
    assert all(t.dtype == torch.long for t in batch.values())


def test_pad_to_multiple_of_and_missing_labels():
    batch = ChatCollator(pad_token_id=3, pad_to_multiple_of=4)([{"input_ids": [1, 2, 9, 9, 9]}])
    assert batch["input_ids"].tolist() == [[1, 2, 9, 9, 9, 3, 3, 3]]
    assert batch["labels"].tolist() == [[1, 2, 9, 9, 9] + [IGNORE_INDEX] * 3]


def test_rejects_bad_batches():
    with pytest.raises(ValueError, match="sample 0: 2 input_ids but 1 labels"):
        ChatCollator(pad_token_id=0)([{"input_ids": [1, 2], "labels": [1]}])
    with pytest.raises(ValueError, match="empty batch"):
        ChatCollator(pad_token_id=0)([])


def test_dataloader_over_built_dataset_roundtrips():
    tok = tiny_tokenizer()
    train = build_datasets(SHAREGPT, tok).train
    loader = torch.utils.data.DataLoader(train, batch_size=3, collate_fn=ChatCollator(tok.pad_token_id))
    batch = next(iter(loader))  # [B, T]
    for b in range(3):
        n = int(batch["attention_mask"][b].sum())
        assert batch["input_ids"][b, :n].tolist() == train[b]["input_ids"]
        assert batch["labels"][b, :n].tolist() == train[b]["labels"]
        assert (batch["input_ids"][b, n:] == tok.pad_token_id).all()


def test_length_batches_keep_a_long_prompt_from_padding_short_ones():
    """The held-out prompts of the smollm2 recipe: in file order, batches of 8 padded 6,628 prompt tokens to 38,992;
    grouped by length the padding stays within a quarter of each batch and every row appears once."""
    lengths = [43, 44, 44, 39, 44, 57, 49, 35, 39, 52, 42, 49, 640, 171, 53, 43, 56, 2598, 104, 41, 52, 88, 35, 278,
               45, 49, 32, 43, 80, 1579, 32, 72]
    new = 64
    batches = length_batches(lengths, max_rows=8, extra=new)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(1 <= len(b) <= 8 for b in batches)
    padded = 0
    for b in batches:
        width = max(lengths[i] for i in b) + new
        real = sum(lengths[i] + new for i in b)
        assert width * len(b) - real <= 0.25 * width * len(b)
        padded += width * len(b)
    assert padded < 1.25 * sum(n + new for n in lengths)
    assert [lengths[b[0]] for b in batches] == sorted((lengths[b[0]] for b in batches), reverse=True)  # longest first


def test_length_batches_edge_cases():
    assert length_batches([], max_rows=4) == []
    assert length_batches([5, 5, 5, 5, 5], max_rows=2) == [[0, 1], [2, 3], [4]]  # ties keep their order
    assert length_batches([1, 100], max_rows=8) == [[1], [0]]  # 99 pads of 200 tokens: apart
    assert length_batches([1, 100], max_rows=8, max_padding=1.0) == [[1, 0]]
    with pytest.raises(ValueError, match="max_rows=0"):
        length_batches([3], max_rows=0)
