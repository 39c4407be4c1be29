"""Hugging Face models as a user's factory returns them: built from their configs (no weights are
downloaded) and not wrapped, so their forward returns a ``ModelOutput``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from trainforge.config import DataConfig
from trainforge.data import UserData


def gpt2_lm(vocab_size: int = 64) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab_size, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


def bert_mlm(vocab_size: int = 65) -> nn.Module:
    """BERT's masked LM; the data's vocabulary plus the mask token."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    return BertForMaskedLM(config)


def vit_classifier(num_labels: int = 10) -> nn.Module:
    """A ViT for the 8x8 one-channel digits: 4 patches of 4x4."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=1,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=num_labels,
    )
    return ViTForImageClassification(config)


def distilbert_classifier(vocab_size: int = 20, num_labels: int = 2) -> nn.Module:
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    config = DistilBertConfig(
        vocab_size=vocab_size, dim=32, n_layers=2, n_heads=2, hidden_dim=64, num_labels=num_labels, dropout=0.0
    )
    return DistilBertForSequenceClassification(config)


class Hidden(nn.Module):
    """Returns its features in a dict with no logits: no task can read it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"hidden": self.linear(x.flatten(1))}


def unreadable() -> nn.Module:
    return Hidden()


class RaisesInForward(nn.Module):
    """A user's bug in forward, raised on every rank at the first step."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("the user's bug: features must be normalised")


def raises_in_forward() -> nn.Module:
    return RaisesInForward()


class TokenClasses(Dataset[Any]):
    """Token sequences to classify: the label is whether the first token is in the vocabulary's
    upper half, which a small encoder learns in a few dozen steps."""

    def __init__(self, count: int, vocab: int, seq_len: int, offset: int = 0) -> None:
        generator = torch.Generator().manual_seed(1234 + offset)
        self.tokens = torch.randint(vocab, (count, seq_len), generator=generator)
        self.labels = (self.tokens[:, 0] >= vocab // 2).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[index], self.labels[index]


def token_classes(data: DataConfig, seed: int) -> UserData:
    """Sequence classification: integer token ids and one class per sequence (vocab_size given)."""
    return UserData(
        train=TokenClasses(512, 20, 12), val=TokenClasses(128, 20, 12, offset=1), num_classes=2, vocab_size=20
    )
