"""ChatCollator: right padding, attention mask, IGNORE_INDEX on pads, pad_to_multiple_of."""

import pytest
import torch

from data.chat import IGNORE_INDEX
from data.collate import ChatCollator
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
