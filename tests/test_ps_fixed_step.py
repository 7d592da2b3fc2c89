"""The one sparse step (`mariana.platform.sparse.step.sparse_step`) over its row stores: the padded slots
equal ``torch.unique``'s rows and inverse, and the whole step (gather, forward/backward, row update) compiles
with ``torch.compile(fullgraph=True)``, i.e. without a host read or a data-dependent size, and gives the eager
step's numbers.

Each pair of paths of the step and of the row update, and how equal they are (issue 42):

| paths                                                     | equal                                  | test |
|-----------------------------------------------------------|----------------------------------------|------|
| `TorchRows` (unique rows) vs padded `TorchRows`, compiled  | fp tolerance (``assert_close``): ``w + (new - w)`` vs ``new``, torch.func vs autograd | here |
| `CRows` (C loops) vs `TorchRows`, 3 steps, every rule      | bits for sgd/ftrl unclipped; rtol 1e-5, atol 1e-7 with adagrad (sqrt 1 ulp) or clipping (norm summed in another row order) | test_cpu_rows |
| `kernels.update_rows` vs `rules.apply_rows`                | bits, but adagrad's weights: 1e-6 (bits against a correctly rounded sqrt) | test_cpu_rows |
| `rules.apply_slots` (any slot order) vs `apply_rows`       | rtol 1e-6, atol 1e-7                   | test_pctr_compile |
| `LocalStep` compiled vs eager, lr changing every step      | rtol 1e-5, atol 1e-6 (1e-4/1e-5 on CUDA) | test_pctr_compile |
| `train_step` on a shard's store vs autograd through ``nn.Embedding`` | ``assert_close`` defaults     | test_pctr_models |
| 2 servers x 2 workers bulk-synchronous vs one process      | atol 1e-5                              | test_ps_train |
| killed and restarted servers/workers vs uninterrupted      | bits                                   | test_ps_train |
| stopped/killed and resumed one process vs uninterrupted    | atol 1e-6                              | test_pctr_resume |
"""

from __future__ import annotations

import pytest
import torch
from mariana.apps.pctr.configs import MODELS
from mariana.apps.pctr.models.nets import CTRModel
from mariana.platform.sparse.rules import RULES, RowOptConfig, init_state
from mariana.platform.sparse.step import SparseStep
from mariana.platform.sparse.store import slots_of


def hashed_batch(B=32, F=4, R=50, seed=0):
    """Hashed ids with repeats (power law inside each field's R rows), values, 2 dense features, labels."""
    g = torch.Generator().manual_seed(seed)
    local = (torch.rand(B, F, generator=g) ** 3 * R).long()
    ids = local + torch.arange(F) * R
    vals = torch.rand(B, F, generator=g) + 0.5
    return ids, vals, torch.randn(B, 2, generator=g), (torch.rand(B, generator=g) < 0.3).float()


def test_slots_are_unique_rows_and_inverse_padded():
    ids, *_ = hashed_batch()
    s = slots_of(ids)
    uniq, inv = torch.unique(ids, return_inverse=True)
    U = uniq.numel()
    assert s.rows.shape == (ids.numel(),) and U < ids.numel()  # repeats: some padding
    assert torch.equal(s.rows[:U], uniq) and torch.equal(s.pos, inv)
    assert torch.equal(s.valid, torch.arange(ids.numel()) < U)
    assert torch.all(s.rows[U:] == uniq[0])  # the padding points at a row of the batch


def make(kind, rule, trim, seed=0):
    torch.manual_seed(seed)
    model = CTRModel(kind, 200, 4, 2, dim=3, hidden=(8, 4), cross_layers=1)
    w = model.table.weight.data
    opt = RowOptConfig(rule=rule, lr=0.3, ftrl_l1=0.01)
    fixed = SparseStep(
        model,
        w,
        init_state(rule, w, opt),
        torch.zeros(200, dtype=torch.bool),
        l2_emb=0.1,
        clip_grad=5.0,
        trim=trim,
    )
    return model, fixed, opt


# every model and every row optimiser, each rule on two models (a full cross would cost a minute of CI)
CASES = [
    ("lr", "sgd"),
    ("fm", "ftrl"),
    ("dnn", "adagrad"),
    ("deepfm", "adagrad"),
    ("deepfm", "ftrl"),
    ("dcn", "sgd"),
]
assert {k for k, _ in CASES} == set(MODELS) and {r for _, r in CASES} == set(RULES)


@pytest.mark.parametrize("kind,rule", CASES)
def test_whole_step_compiles_fullgraph_and_matches_eager(kind, rule):
    torch._dynamo.reset()  # each case compiles afresh (the cache would count them as recompiles)
    ids, vals, dense, y = hashed_batch(seed=1)
    eager_model, eager, opt = make(kind, rule, trim=True)  # the CPU's eager step: U distinct rows
    comp_model, comp, _ = make(kind, rule, trim=False)  # fixed shapes: B * F slots
    losses = {}
    for name, (model, fixed) in {"eager": (eager_model, eager), "compiled": (comp_model, comp)}.items():
        fixed.used = fixed.used_parameters(ids[:1], vals[:1], dense[:1])
        params = {f"m.{n}": p.detach() for n, p in model.named_parameters() if n in fixed.names}
        fn = fixed.step
        if name == "compiled":  # graph breaks (host reads, data-dependent shapes) raise here
            fn = torch.compile(fixed.step, fullgraph=True, backend="aot_eager")
        losses[name], grads = fn(params, ids, vals, dense, y, opt)
        assert len(grads) == len(fixed.names)
    torch.testing.assert_close(losses["compiled"], losses["eager"])
    torch.testing.assert_close(comp.weight, eager.weight)
    for k in eager.state:
        torch.testing.assert_close(comp.state[k], eager.state[k], msg=k)
    assert torch.equal(comp.seen, eager.seen) and int(eager.seen.sum()) == torch.unique(ids).numel()
