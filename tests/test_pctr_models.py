"""pCTR models and sparse optimisers: shapes, the row-gather path equals the table lookup, sparse
gradients touch only the batch's rows, and the training step's row optimisers (Adagrad, FTRL) follow the
parameter servers' row rules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from mariana.apps.pctr.models.nets import MODELS, CTRModel
from mariana.platform.sparse.rules import RowOptConfig, apply_rows, init_state


class LocalClient:
    """A worker client over an in-process shard (pull/push as `PSClient`'s); no dense store: the caller
    steps a torch optimiser."""

    def __init__(self, shard):
        self.shard = shard

    def pull(self, reqs: dict, step: int = -1, want_dense: bool = False):
        return {n: self.shard.pull(n, r) for n, r in reqs.items()}, None

    def push(self, grads: dict, dense_grad=None, step: int = -1):
        for n, (r, g) in grads.items():
            self.shard.push(n, r, g)


def batch(B=6, nf=4, R=10, nd=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, R, (B, nf), generator=g) + torch.arange(nf) * R
    return ids, torch.rand(B, nf, generator=g), torch.rand(B, nd, generator=g)


@pytest.mark.parametrize("kind", MODELS)
def test_models_forward_and_sparse_gradients(kind):
    torch.manual_seed(0)
    m = CTRModel(kind, 40, 4, 2, dim=3, hidden=(8, 4), cross_layers=2)
    ids, vals, dense = batch()
    logits = m(ids, vals, dense)
    assert logits.shape == (6,) and torch.isfinite(logits).all()
    uniq, inv = torch.unique(ids, return_inverse=True)
    rows = m.table.weight.index_select(0, uniq)
    torch.testing.assert_close(m.forward_rows(F.embedding(inv, rows), vals, dense), logits)
    F.binary_cross_entropy_with_logits(logits, torch.ones(6)).backward()
    g = m.table.weight.grad
    assert g.is_sparse and set(g.coalesce().indices()[0].tolist()) == set(uniq.tolist())
    assert not any(p is m.table.weight for p in m.dense_parameters())
    assert m.table.weight.shape[1] == (1 if kind == "lr" else 4)


def test_fm_term_is_the_sum_of_pairwise_products():
    m = CTRModel("fm", 40, 4, 0, dim=3)
    ids, vals, _ = batch(nd=0)
    with torch.no_grad():
        e = m.table.weight[ids][..., 1:] * vals[..., None]
        pair = sum((e[:, i] * e[:, j]).sum(1) for i in range(4) for j in range(i + 1, 4))
        lin = (m.table.weight[ids][..., 0] * vals).sum(1) + m.bias
        torch.testing.assert_close(m(ids, vals, torch.zeros(6, 0)), lin + pair)


def _trained_rows(rule: str, model: CTRModel, steps: int = 3, **row_kw) -> torch.Tensor:
    """``model``'s table after ``steps`` batches of the sparse step (`train_step` on an in-process shard:
    `sparse_step`, its pushes applied by the shard's row store with the row optimiser ``rule``), dense
    parameters left alone."""
    from mariana.apps.pctr.data.encoding import Batch
    from mariana.platform.ps.pull import TABLE, train_step
    from mariana.platform.ps.shard import EmbeddingShard, TableSpec

    spec = TableSpec(TABLE, 40, model.table.weight.shape[1], 0.01)
    cfg = RowOptConfig(rule=rule, lr=0.1, **row_kw)
    shard = EmbeddingShard([spec], 0, 1, cfg, weights={TABLE: model.table.weight.data})
    for s in range(steps):
        ids, vals, _ = batch(nd=0, seed=s)
        train_step(model, LocalClient(shard), Batch(ids, vals, torch.zeros(6, 0), torch.ones(6)), s, "cpu")
    return model.table.weight.detach()


@pytest.mark.parametrize("rule", ["adagrad", "ftrl"])
def test_training_row_optimiser_matches_row_rules_and_touches_only_batch_rows(rule):
    """The row optimiser training runs (the one-process step) equals the parameter servers' row rule
    (`apply_rows`) on the batch's summed row gradients (autograd through nn.Embedding), and moves only
    the batch's rows."""
    torch.manual_seed(0)
    ref = CTRModel("fm", 40, 4, 0, dim=3)
    ours = CTRModel("fm", 40, 4, 0, dim=3)
    ours.load_state_dict(ref.state_dict())
    start = ref.table.weight.detach().clone()
    ref_w = start.clone()
    cfg = RowOptConfig(rule=rule, lr=0.1)
    state = init_state(rule, ref_w, cfg)
    for s in range(3):
        ids, vals, _ = batch(nd=0, seed=s)
        ref.zero_grad()
        F.binary_cross_entropy_with_logits(ref(ids, vals, torch.zeros(6, 0)), torch.ones(6)).backward()
        g = ref.table.weight.grad.coalesce()
        apply_rows(ref_w, state, g.indices()[0], g.values(), cfg)
        with torch.no_grad():
            ref.table.weight.copy_(ref_w)
    got = _trained_rows(rule, ours)
    torch.testing.assert_close(got, ref_w)
    untouched = torch.ones(40, dtype=torch.bool)
    for s in range(3):
        untouched[batch(nd=0, seed=s)[0].flatten()] = False
    assert untouched.any() and torch.equal(got[untouched], start[untouched])
    assert not torch.equal(got[~untouched], start[~untouched])


def test_ftrl_l1_gives_exact_zeros():
    """FTRL with a strong L1 in the training step: the batch's rows become exactly zero, the others keep
    their values."""
    torch.manual_seed(0)
    m = CTRModel("fm", 40, 4, 0, dim=3)
    start = m.table.weight.detach().clone()
    got = _trained_rows("ftrl", m, steps=1, ftrl_l1=10.0)
    touched = torch.zeros(40, dtype=torch.bool)
    touched[batch(nd=0, seed=0)[0].flatten()] = True
    assert torch.all(got[touched] == 0) and torch.equal(got[~touched], start[~touched])
    assert torch.all(start[touched] != 0)


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("unit_vals", [False, True])
def test_train_step_equals_autograd_through_the_table(kind, unit_vals):
    """The trainers' step (unique rows -> two gradient leaves -> per-row index_add -> row SGD) gives the
    same loss, the same new table and the same dense gradients as plain autograd over nn.Embedding."""
    from mariana.apps.pctr.data.encoding import Batch
    from mariana.platform.ps.pull import TABLE, train_step
    from mariana.platform.ps.shard import EmbeddingShard, TableSpec

    torch.manual_seed(0)
    ref = CTRModel(kind, 40, 4, 2, dim=3, hidden=(8, 4), cross_layers=2)
    ours = CTRModel(kind, 40, 4, 2, dim=3, hidden=(8, 4), cross_layers=2)
    ours.load_state_dict(ref.state_dict())
    ids, vals, dense = batch(B=16, seed=3)
    if unit_vals:
        vals = torch.ones_like(vals)
    y = (torch.arange(16) % 3 == 0).float()
    lr = 0.5
    loss_ref = F.binary_cross_entropy_with_logits(ref(ids, vals, dense), y)
    loss_ref.backward()
    g = ref.table.weight.grad.coalesce()
    expect = ref.table.weight.detach().clone().index_add_(0, g.indices()[0], g.values(), alpha=-lr)
    spec = TableSpec(TABLE, 40, ours.table.weight.shape[1], 0.01)
    shard = EmbeddingShard(
        [spec], 0, 1, RowOptConfig(rule="sgd", lr=lr), weights={TABLE: ours.table.weight.data}
    )
    loss = train_step(ours, LocalClient(shard), Batch(ids, vals, dense, y), 0, "cpu")
    torch.testing.assert_close(loss, loss_ref.detach())
    torch.testing.assert_close(ours.table.weight.detach(), expect)
    for (n, p), q in zip(ref.named_parameters(), ours.parameters()):
        if n != "table.weight":
            torch.testing.assert_close(q.grad, p.grad, msg=n)


@pytest.mark.parametrize("clip", [1e-3, 1e6])
def test_clip_grad_bounds_the_joint_norm_of_dense_and_row_gradients(clip):
    """``--clip-grad``: with SGD everywhere the step moves the dense parameters and the batch's rows by
    ``lr * g`` with ``g`` the gradient scaled to norm ``<= clip``; a large bound changes nothing."""
    from mariana.apps.pctr.data.encoding import Batch
    from mariana.platform.ps.pull import TABLE, train_step
    from mariana.platform.ps.shard import EmbeddingShard, TableSpec

    def step(model, clip_grad):
        spec = TableSpec(TABLE, 40, model.table.weight.shape[1], 0.01)
        rows = RowOptConfig(rule="sgd", lr=0.5)
        shard = EmbeddingShard([spec], 0, 1, rows, weights={TABLE: model.table.weight.data})
        opt = torch.optim.SGD(model.dense_parameters(), lr=0.5)
        ids, vals, dense = batch(B=16, seed=5)
        y = (torch.arange(16) % 2 == 0).float()
        before = [p.detach().clone() for p in model.parameters()]
        train_step(model, LocalClient(shard), Batch(ids, vals, dense, y), 0, "cpu", opt, clip_grad=clip_grad)
        return torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(model.parameters(), before)])

    torch.manual_seed(0)
    a = CTRModel("deepfm", 40, 4, 2, dim=3, hidden=(8,))
    b = CTRModel("deepfm", 40, 4, 2, dim=3, hidden=(8,))
    b.load_state_dict(a.state_dict())
    free, clipped = step(a, 0.0), step(b, clip)
    if clip > 1:
        torch.testing.assert_close(clipped, free, rtol=0, atol=0)
    else:
        assert float(free.norm()) > 0.5 * clip * 10  # the unclipped step is far larger than the bound
        torch.testing.assert_close(clipped.norm(), torch.tensor(0.5 * clip), rtol=1e-3, atol=0)
        torch.testing.assert_close(clipped / clipped.norm(), free / free.norm(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["lr", "deepfm", "dcn"])
def test_l2_regularised_step_equals_autograd_of_the_regularised_loss(kind):
    """``--l2-emb``/``--weight-decay``: the step equals plain autograd of ``logloss + l2_emb/2 * sum of
    ||row||^2 over the batch's unique rows + weight_decay/2 * sum of ||p||^2 over the dense parameters``
    (rows SGD, dense SGD); rows outside the batch do not move."""
    from mariana.apps.pctr.data.encoding import Batch
    from mariana.platform.ps.pull import TABLE, train_step
    from mariana.platform.ps.shard import EmbeddingShard, TableSpec

    l2_emb, wd, lr = 0.3, 0.2, 0.5
    torch.manual_seed(0)
    ref = CTRModel(kind, 40, 4, 2, dim=3, hidden=(8, 4), cross_layers=2)
    ours = CTRModel(kind, 40, 4, 2, dim=3, hidden=(8, 4), cross_layers=2)
    with torch.no_grad():  # column 0 starts at 0 in training; give it values so its L2 term is checked too
        ref.table.weight.normal_(0, 0.5)
    ours.load_state_dict(ref.state_dict())
    ids, vals, dense = batch(B=16, seed=7)
    ids[:, 0] = ids[0, 0]  # a row repeated in every sample still gets its L2 term once
    y = (torch.arange(16) % 3 == 0).float()
    uniq = torch.unique(ids)
    loss = F.binary_cross_entropy_with_logits(ref(ids, vals, dense), y)
    reg = l2_emb / 2 * ref.table(uniq).pow(2).sum()
    reg = reg + wd / 2 * sum(p.pow(2).sum() for p in ref.dense_parameters())
    (loss + reg).backward()
    g = ref.table.weight.grad.coalesce()
    expect = ref.table.weight.detach().clone().index_add_(0, g.indices()[0], g.values(), alpha=-lr)
    dense_ref = {n: p.detach() - lr * p.grad for n, p in ref.named_parameters() if n != "table.weight"}

    spec = TableSpec(TABLE, 40, ours.table.weight.shape[1], 0.01)
    shard = EmbeddingShard(
        [spec], 0, 1, RowOptConfig(rule="sgd", lr=lr), weights={TABLE: ours.table.weight.data}
    )
    opt = torch.optim.SGD(ours.dense_parameters(), lr=lr)
    before = ours.table.weight.detach().clone()
    out = train_step(
        ours, LocalClient(shard), Batch(ids, vals, dense, y), 0, "cpu", opt, l2_emb=l2_emb, weight_decay=wd
    )
    torch.testing.assert_close(out, loss.detach())  # the reported loss is the data loss
    torch.testing.assert_close(ours.table.weight.detach(), expect)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[uniq] = False
    assert torch.equal(ours.table.weight.detach()[untouched], before[untouched])
    for n, p in ours.named_parameters():
        if n != "table.weight":
            torch.testing.assert_close(p.detach(), dense_ref[n], msg=n)


def test_l2_flag_defaults_and_negative_values_are_refused():
    from mariana.apps.pctr.configs import PctrConfig
    from mariana.platform.core.errors import MarianaError

    cfg = PctrConfig()
    assert cfg.l2_emb_value() == 0.01 and cfg.weight_decay == 0.0
    # LR has no embedding vectors to calibrate: L2 only shrinks its weights (issue 30's AUC regression)
    assert PctrConfig(model="lr").l2_emb_value() == 0.0
    assert PctrConfig(model="lr", l2_emb=0.01).l2_emb_value() == 0.01
    for kw in ({"l2_emb": -1.0}, {"l2_emb": float("nan")}, {"weight_decay": -0.1}):
        with pytest.raises(MarianaError, match="must be a finite number >= 0"):
            PctrConfig(**kw).validate()
    PctrConfig(l2_emb=0.01, weight_decay=1e-5, servers=2, workers=2).validate()  # same math on workers
