"""A plain embedding-bag + MLP click model (knows nothing of distribution)."""

from __future__ import annotations

import torch
from torch import nn


class ClickMLP(nn.Module):
    """ids [B, F] (int64 bucket ids), mask [B, F] (1 = real id) -> logits [B]."""

    def __init__(self, buckets: int, embed_dim: int, hidden: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(buckets, embed_dim)
        nn.init.normal_(self.embed.weight, std=0.05)
        dims = [embed_dim] + [hidden] * layers
        blocks: list[nn.Module] = []
        for a, b in zip(dims[:-1], dims[1:]):
            blocks += [nn.Linear(a, b), nn.ReLU()]
        blocks.append(nn.Linear(dims[-1], 1))
        self.mlp = nn.Sequential(*blocks)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # Sum of the row's embeddings (padding masked out), so rows with different field counts mix.
        pooled = (self.embed(ids) * mask.unsqueeze(-1)).sum(1)
        return self.mlp(pooled).squeeze(-1)
