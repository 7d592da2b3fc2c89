"""Click-prediction models: LR, FM, DNN, DeepFM, DCN-v2 (plain single-device ``nn.Module``s).

All share one embedding table ``table: nn.Embedding(num_rows, 1 + dim, sparse=True)``: column 0 is the
feature's linear weight, columns 1.. its ``dim``-dimensional embedding (one lookup serves both terms).
Inputs: ``ids`` int64 [B, F] table rows, ``vals`` float32 [B, F] feature values, ``dense`` float32 [B, D].
Output: logits float32 [B].

``forward(ids, vals, dense)`` looks rows up in ``self.table`` (sparse gradient). ``forward_rows(rows,
vals, dense)`` takes the looked-up rows ``[B, F, 1 + dim]`` instead: the trainers gather them from the
unique rows of the batch (pulled from a parameter server or a local shard) so that only those rows carry
gradients. Everything except ``table`` is "dense" (``dense_parameters()``).
"""

from __future__ import annotations

import functools

import torch
from mariana.platform.core.registry import create_model, register_model
from torch import nn

from ..configs import MODELS, Net, Table, hidden_sizes


def mlp(sizes: list[int], dropout: float = 0.0) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


class CTRModel(nn.Module):
    def __init__(
        self,
        kind: str,
        num_rows: int,
        num_fields: int,
        num_dense: int,
        dim: int = 16,
        hidden: tuple[int, ...] = (256, 128),
        cross_layers: int = 3,
        dropout: float = 0.0,
        init_std: float = 0.01,
        table: torch.Tensor | None = None,
    ):
        """``table``: an existing ``[num_rows, 1 + dim]`` weight to adopt (no copy, no initialisation).

        The dense layers are created (and draw from the global RNG) before the table, so their initial
        values do not depend on the table's size or on whether a table was given."""
        super().__init__()
        if kind not in MODELS:
            raise ValueError(f"unknown model {kind!r}; choose from {', '.join(MODELS)}")
        self.kind, self.num_fields, self.num_dense = kind, num_fields, num_dense
        self.dim = 0 if kind == "lr" else dim
        self.bias = nn.Parameter(torch.zeros(1))
        self.dense_linear = nn.Linear(num_dense, 1, bias=False) if num_dense else None
        flat = num_fields * self.dim + num_dense
        if kind in ("dnn", "deepfm", "dcn"):
            self.deep = mlp([flat, *hidden], dropout)
            deep_out = hidden[-1] if hidden else flat
        if kind in ("dnn", "deepfm"):
            self.head = nn.Linear(deep_out, 1)
        if (
            kind == "dcn"
        ):  # DCN-v2 (Wang et al. 2021): x_{l+1} = x0 * (W_l x_l + b_l) + x_l, parallel deep net
            self.cross = nn.ModuleList(nn.Linear(flat, flat) for _ in range(cross_layers))
            self.head = nn.Linear(flat + deep_out, 1)
        if table is not None and tuple(table.shape) != (num_rows, 1 + self.dim):
            raise ValueError(f"table shape {tuple(table.shape)} != {(num_rows, 1 + self.dim)}")
        self.table = nn.Embedding(num_rows, 1 + self.dim, sparse=True, _weight=table)
        if table is None:
            nn.init.normal_(self.table.weight, std=init_std)

    def load_dense_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load every parameter except the table (adopted at construction, see ``table``); ``state`` may
        hold ``table.weight`` too, which is ignored. Raises ValueError naming keys that do not match."""
        # ``image.*``: the image CNN and projection of `--image-features` exports (not this module's)
        state = {k: v for k, v in state.items() if k != "table.weight" and not k.startswith("image.")}
        missing, unexpected = self.load_state_dict(state, strict=False)
        if missing != ["table.weight"] or unexpected:
            raise ValueError(f"parameters do not match the model: {missing=} {unexpected=}")

    def dense_parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.named_parameters() if not n.startswith("table.")]

    def forward(self, ids: torch.Tensor, vals: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        return self.forward_rows(self.table(ids), vals, dense)

    def forward_rows(self, rows: torch.Tensor, vals: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """rows [B, F, 1 + dim] -> logits [B]."""
        return self.forward_parts(rows[..., 0], rows[..., 1:], vals, dense)

    def forward_parts(
        self, w: torch.Tensor, e: torch.Tensor, vals: torch.Tensor, dense: torch.Tensor
    ) -> torch.Tensor:
        """The looked-up rows as two tensors: linear weights w [B, F] and embeddings e [B, F, dim];
        ``vals`` [B, F] or None when all values are 1.

        The trainers pass two gradient leaves here rather than one ``[B, F, 1 + dim]`` tensor: slicing a
        leaf makes autograd allocate and fill a zero tensor of the whole leaf per slice in backward."""
        if vals is not None:  # None: every value is 1 (categorical data), skip two [B, F(, dim)] products
            w = w * vals
        logit = w.sum(1) + self.bias
        if self.dense_linear is not None:
            logit = logit + self.dense_linear(dense).squeeze(1)
        if self.kind == "lr":
            return logit
        emb = e * vals.unsqueeze(-1) if vals is not None else e  # [B, F, dim]
        if self.kind in ("fm", "deepfm"):
            s = emb.sum(1)
            logit = logit + 0.5 * (s * s - (emb * emb).sum(1)).sum(1)
        if self.kind == "fm":
            return logit
        x0 = emb.reshape(emb.shape[0], -1)
        if self.num_dense:
            x0 = torch.cat([x0, dense], 1)
        deep = self.deep(x0)
        if self.kind == "dcn":
            x = x0
            for layer in self.cross:
                x = x0 * layer(x) + x
            return self.head(torch.cat([x, deep], 1)).squeeze(1) + self.bias
        out = self.head(deep).squeeze(1)
        return out + (logit if self.kind == "deepfm" else self.bias)


# The models of this app, by name (`mariana.platform.core.registry`): one class, its ``kind`` the name.
for _kind in MODELS:
    register_model("pctr", _kind)(functools.partial(CTRModel, _kind))


def build_model(
    net: Net, schema, table: torch.Tensor | None = None, init_std: float = Table.init_std
) -> CTRModel:
    """The model of the ``net`` section over ``schema``'s fields and rows (a `data.encoding.Schema`);
    ``table``: an existing ``[rows, 1 + dim]`` weight to adopt, else a fresh one drawn with ``init_std``."""
    return create_model(
        "pctr",
        net.model,
        num_rows=schema.num_rows,
        num_fields=schema.num_fields,
        num_dense=schema.num_dense,
        dim=net.dim,
        hidden=hidden_sizes(net.hidden, net.model),
        cross_layers=net.cross_layers,
        dropout=net.dropout,
        init_std=init_std,
        table=table,
    )
