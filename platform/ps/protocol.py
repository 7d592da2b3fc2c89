"""What the parameter-server framework needs from an application: its model, its batches, its settings.

The steps (`mariana.platform.sparse`'s `LocalStep` and `SparseStep`; this package's `PSWorkerStep` and
`train_step`) never import an application. An application (pCTR: `mariana.apps.pctr`) hands them objects with these shapes:

- `SparseModel`: an ``nn.Module`` whose embedding rows live outside it (a local shard or the servers).
  It names its dense parameters and computes logits from the batch's looked-up rows;
- `SparseBatch`: a dataclass of one batch (``ids`` select the table rows; ``dataclasses.replace`` swaps
  ``ids`` for the rows a key map assigned);
- `StepConfig`: the settings the steps read (a `TrainConfig` with the sparse fields);
- `KeyMap`: an optional map from the data's keys to table rows (pCTR's ``--ids dynamic``).

One table, named `TABLE`, with rows ``[1 + dim]``: column 0 a linear weight, the rest an embedding.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

TABLE = "table"  # the name of the one table in the shards' dicts and the servers' requests


class SparseModel(Protocol):
    """A model whose rows are looked up outside it. Besides these, the steps use ``nn.Module``'s
    ``named_parameters``/``state_dict``/``train``/``eval``."""

    def dense_parameters(self) -> list[nn.Parameter]:
        """Every trained parameter except the table, in a fixed order (the servers' flat vector)."""
        ...

    def forward_parts(
        self, w: torch.Tensor, e: torch.Tensor, vals: torch.Tensor | None, dense: torch.Tensor
    ) -> torch.Tensor:
        """Linear weights ``w`` [B, F], embeddings ``e`` [B, F, dim], values ``vals`` [B, F] (None: all
        1), dense features [B, D] -> logits [B]."""
        ...

    def forward_rows(self, rows: torch.Tensor, vals: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """Looked-up rows [B, F, 1 + dim] -> logits [B] (scoring)."""
        ...


class SparseBatch(Protocol):
    """One batch: ``ids`` int64 [B, F] table rows (or keys, under a `KeyMap`), ``vals`` float [B, F],
    ``dense`` float [B, D], ``labels`` float [B] in {0, 1}. A dataclass."""

    ids: torch.Tensor
    vals: torch.Tensor
    dense: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int: ...

    def to(self, device) -> SparseBatch: ...


class StepConfig(Protocol):
    """The settings the steps read: learning rates (dense ``lr``, rows ``sparse_lr``), their schedule,
    regularisers, clipping, the seed of fresh rows, and for workers the consistency and logging."""

    seed: int
    lr: float
    sparse_lr: float
    schedule: str
    warmup_steps: int
    clip_grad: float
    weight_decay: float
    init_std: float
    amp: str
    staleness: int
    pull_ahead: bool
    log_every: int
    compile: str  # the one-process step compiled: on, off or auto (on CUDA only), see `local.compile_mode`
    compile_backend: str  # torch.compile backend: inductor, or aot_eager (tests: compiles in seconds)

    def l2_emb_value(self) -> float: ...


class KeyMap(Protocol):
    """Keys -> table rows, counting, admitting and evicting (pCTR's `IdMap`)."""

    row_key: np.ndarray  # [rows] the key held by each row, -1 none

    def assign(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """keys [B, F] -> (rows [B, F], rows evicted for them [E])."""
        ...

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Read-only: keys [n, F] -> rows [n, F]."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, sd: dict[str, Any]) -> None: ...

    def counters(self) -> dict[str, Any]: ...
