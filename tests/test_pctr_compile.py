"""The compiled one-process pCTR step (`SparseStep.compile`, `LocalStep`, ``--compile``): the row
optimiser's learning rate reaches the graph as a 0-d tensor (a schedule does not recompile it), ``pctr train
--compile on`` trains the eager step's model, and on a GPU the default (inductor, CUDA graphs) trains the
eager model with no recompile, no host sync and graphs that replay."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from helpers import DATA
from mariana.apps.pctr.configs import PctrConfig
from mariana.apps.pctr.data.encoding import Batch
from mariana.apps.pctr.models.nets import build_model
from mariana.apps.pctr.models.optim import build_dense, row_config
from mariana.platform.core.export import load_exported
from mariana.platform.ps.protocol import TABLE
from mariana.platform.ps.shard import TableSpec, init_rows
from mariana.platform.sparse import rules
from mariana.platform.sparse.local import LocalStep, compile_mode
from mariana.platform.sparse.rules import RULES, RowOptConfig, apply_rows, apply_slots, init_state
from mariana.platform.sparse.store import slots_of
from torch._dynamo.exc import RecompileError
from torch._dynamo.utils import counters

FRAPPE = DATA / "frappe" / "frappe.validation.libfm"
F_, D_, R_ = 4, 2, 50


def batches(n: int, B: int = 32, seed: int = 0, device="cpu") -> list[Batch]:
    """``n`` batches of hashed ids with repeats (power law inside each field's R_ rows), values all 1."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = (torch.rand(B, F_, generator=g) ** 3 * R_).long() + torch.arange(F_) * R_
        dense, y = torch.randn(B, D_, generator=g), (torch.rand(B, generator=g) < 0.3).float()
        out.append(Batch(ids, torch.ones(B, F_), dense, y).to(device))
    return out


def local_step(device: str, steps: int, **kw) -> LocalStep:
    """A `LocalStep` of DeepFM over F_ fields of R_ rows on ``device`` as `make_local_step` builds it, for
    ``steps`` steps of a cosine schedule (both learning rates change every step); ``kw`` over the settings."""
    kw = {"amp": "off", **kw}
    cfg = PctrConfig(
        model="deepfm", dim=4, hidden="16,8", rows_per_field=R_, schedule="cosine", dropout=0.0,
        clip_grad=5.0, weight_decay=1e-4, device=str(device), **kw,
    )  # fmt: skip
    schema = SimpleNamespace(num_rows=F_ * R_, num_fields=F_, num_dense=D_)
    spec = TableSpec(TABLE, F_ * R_, 1 + cfg.dim, cfg.init_std)
    device = torch.device(device)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, schema, table=init_rows(spec, cfg.seed)).to(device)
    opt = build_dense(cfg, model.dense_parameters())
    step = LocalStep(cfg, model, model.table.weight.data, row_config(cfg), opt, device, unit_vals=True)
    step.setup(steps + 1)  # the last step's factor is not 0
    return step


def state_of(step: LocalStep) -> dict[str, torch.Tensor]:
    """What training changed: the model (dense layers and table), the row-optimiser state, ``seen``."""
    rows = {f"rows.{k}": v for k, v in step.store.state.items()}
    return {**step.model.state_dict(), **rows, "seen": step.store.seen}


def train(step: LocalStep, data: list[Batch]) -> list[float]:
    """Every batch once, one per step; the table learning rates the steps used."""
    lrs = []
    for b in data:
        step.train_step([b])
        lrs.append(step.lrs()["sparse_lr"])
    return lrs


def test_compile_mode_is_auto_on_cuda_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compile_mode(PctrConfig(), cpu) is None  # the CPU's trimmed eager step
    assert compile_mode(PctrConfig(), cuda) == ("inductor", "reduce-overhead")
    assert compile_mode(PctrConfig(compile="on"), cpu) == ("inductor", None)
    assert compile_mode(PctrConfig(compile="on", compile_backend="aot_eager"), cuda) == ("aot_eager", None)
    assert compile_mode(PctrConfig(compile="off"), cuda) is None


def test_changing_learning_rates_reach_one_compiled_graph_and_train_the_eager_model():
    # 4 steps of cosine decay: 4 different table learning rates, one graph, no recompile (a float
    # learning rate is a constant of the graph: see the next test); the same model as the eager step's.
    torch._dynamo.reset()
    counters.clear()
    data = batches(4)
    eager = local_step("cpu", 4)
    compiled = local_step("cpu", 4, compile="on", compile_backend="aot_eager")
    assert compiled.fixed.compiled is not None and eager.fixed.compiled is None
    with torch._dynamo.config.patch(error_on_recompile=True):
        lrs = train(compiled, data)
    assert len(set(lrs)) == 4 and counters["stats"]["unique_graphs"] == 1
    assert train(eager, data) == lrs
    # fp tolerance, not bits: the graph multiplies by the tensor lr where the eager update folds the float
    # into sub_(alpha=lr) (one fused multiply-add), and differentiates with torch.func, not autograd
    want = state_of(eager)
    for k, v in state_of(compiled).items():
        torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_a_float_learning_rate_recompiles_the_step(monkeypatch):
    # The fault the tensor learning rate removes, planted: the row update drops the tensor and reads the
    # float row_opt.lr, which the graph then guards on: the second learning rate recompiles.
    real = rules.apply_slots
    monkeypatch.setattr(rules, "apply_slots", lambda *a, lr=None, **kw: real(*a, **kw))
    torch._dynamo.reset()
    step = local_step("cpu", 3, compile="on", compile_backend="aot_eager")
    data = batches(3)
    with torch._dynamo.config.patch(error_on_recompile=True), pytest.raises(RecompileError, match="lr"):
        train(step, data)


def test_pctr_train_compile_on_trains_the_eager_model(tmp_path):
    # `mariana pctr train --compile on` (aot_eager: compiles in seconds on the CPU) against the default CPU
    # step (eager, unique rows), a learning rate changing every step; in this process, so that a recompile
    # fails the run.
    from mariana.platform.cli.main import main

    lines = FRAPPE.read_text().splitlines(keepends=True)[:3000]
    (tmp_path / "f.libfm").write_text("".join(lines))
    base = ["pctr", "train", "--data", str(tmp_path / "f.libfm"), "--format", "libfm", "--preset", "debug"]
    base += ["--max-steps", "6", "--schedule", "cosine", "--warmup-steps", "2", "--no-progress"]
    torch._dynamo.reset()
    counters.clear()
    assert main([*base, "--out", str(tmp_path / "eager")]) == 0
    assert counters["stats"]["unique_graphs"] == 0  # the CPU default: eager
    with torch._dynamo.config.patch(error_on_recompile=True):
        argv = [
            *base,
            "--out",
            str(tmp_path / "compiled"),
            "--compile",
            "on",
            "--compile-backend",
            "aot_eager",
        ]
        assert main(argv) == 0
    assert counters["stats"]["unique_graphs"] == 1
    a, b = load_exported(tmp_path / "eager")[0], load_exported(tmp_path / "compiled")[0]
    assert a.keys() == b.keys() and "table.weight" in a
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
    m = [json.loads(x) for x in (tmp_path / "compiled" / "metrics.jsonl").read_text().splitlines()]
    assert len({r["sparse_lr"] for r in m if "sparse_lr" in r}) > 1  # the schedule moved the table's lr


def padded_update(rule: str, seed: int = 0):
    """(table [R, K], its row state, slots of a batch with repeats (rows, valid, U), slot gradients [N, K]
    zero past U, the row rule) for `apply_slots` against `apply_rows` on the U distinct rows."""
    g = torch.Generator().manual_seed(seed)
    s = slots_of((torch.rand(16, 3, generator=g) ** 3 * 40).long())
    U, K = int(s.count), 3
    grad = torch.randn(s.rows.numel(), K, generator=g) * s.valid.unsqueeze(1)
    cfg = RowOptConfig(rule=rule, lr=0.1, ftrl_l1=0.01)
    w = torch.randn(40, K, generator=g)
    return w, init_state(rule, w, cfg), s, U, grad, cfg


def one_slot_at_a_time(update, w, state, rows, grad, valid) -> None:
    """``update`` slot by slot: what a compiled kernel that fuses each slot's read of its row into its write
    does when it runs the slots in order (inductor's CPU loop; a GPU's threads in any order)."""
    for i in range(rows.numel()):
        update(w, state, rows[i : i + 1], grad[i : i + 1], valid[i : i + 1])


@pytest.mark.parametrize("rule", RULES)
def test_padded_row_update_does_not_depend_on_the_order_of_the_slots(rule):
    # The padding slots (gradient 0, repeated rows) add exactly 0: the slots applied all at once, one at a
    # time, or in reverse, give the unique-row update (within rounding: w + (new - w) against new).
    w0, st0, s, U, grad, cfg = padded_update(rule)
    want, want_st = w0.clone(), {k: v.clone() for k, v in st0.items()}
    apply_rows(want, want_st, s.rows[:U], grad[:U], cfg)
    spread = torch.where(s.valid, s.rows, torch.arange(s.rows.numel()) % len(w0))  # as TorchRows.update
    n = s.rows.numel()
    orders = {"at once": None, "in order": torch.arange(n), "reversed": torch.arange(n).flip(0)}
    for name, order in orders.items():
        w, st = w0.clone(), {k: v.clone() for k, v in st0.items()}
        if order is None:
            apply_slots(w, st, spread, grad, s.valid, cfg)
        else:
            step = lambda w_, st_, r, g_, v: apply_slots(w_, st_, r, g_, v, cfg)  # noqa: E731
            one_slot_at_a_time(step, w, st, spread[order], grad[order], s.valid[order])
        torch.testing.assert_close(w, want, rtol=1e-6, atol=1e-7, msg=f"{rule} {name}")
        for k in st:
            torch.testing.assert_close(st[k], want_st[k], rtol=1e-6, atol=1e-7, msg=f"{rule} {name} {k}")


def test_the_earlier_padded_update_is_caught_when_slots_run_one_at_a_time():
    # The form this replaced, planted: padding slots repeating slot 0's row and gradient, written with
    # apply_rows' index_copy_. At once (eager) it equals the unique-row update; slot by slot (inductor's
    # fused loop) it updates slot 0's row once per padding slot.
    w0, st0, s, U, grad, cfg = padded_update("adagrad")
    want, want_st = w0.clone(), {k: v.clone() for k, v in st0.items()}
    apply_rows(want, want_st, s.rows[:U], grad[:U], cfg)
    old_grad = torch.where(s.valid.unsqueeze(1), grad, grad[:1])
    w, st = w0.clone(), {k: v.clone() for k, v in st0.items()}
    apply_rows(w, st, s.rows, old_grad, cfg)
    torch.testing.assert_close(w, want)  # at once: right
    w, st = w0.clone(), {k: v.clone() for k, v in st0.items()}
    one_slot_at_a_time(
        lambda w_, st_, r, g_, v: apply_rows(w_, st_, r, g_, cfg), w, st, s.rows, old_grad, s.valid
    )
    assert U < s.rows.numel() and not torch.allclose(w, want)  # slot by slot: row rows[0] updated again


@pytest.mark.gpu
def test_default_cuda_step_is_compiled_graph_replayed_sync_free_and_trains_the_eager_model():
    # What `pctr train --device cuda` runs by default (inductor, CUDA graphs), fp32: the eager step's model
    # within fp tolerance, no recompile while the learning rates change, no host sync in steady steps
    # (torch.cuda.set_sync_debug_mode("error")), no CUDA-graph skip and a graph recorded.
    torch._dynamo.reset()
    counters.clear()
    n, warm = 9, 4
    data = batches(n, B=256, device="cuda")
    eager, default = local_step("cuda", n, compile="off"), local_step("cuda", n)
    assert (
        default.compiled == ("inductor", "reduce-overhead")
        and default.fixed.graphs
        and eager.compiled is None
    )
    with torch._dynamo.config.patch(error_on_recompile=True):
        train(default, data[:warm])  # compile, warm up, record
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            train(default, data[warm:])
        finally:
            torch.cuda.set_sync_debug_mode(0)
    inductor = dict(counters["inductor"])
    print("inductor counters:", {k: v for k, v in inductor.items() if "cudagraph" in k})
    assert inductor.get("cudagraph_skips", 0) == 0, inductor
    assert inductor.get("cudagraph_recorded_non_static_inputs", 0) > 0, inductor  # a graph was recorded
    assert counters["stats"]["unique_graphs"] == 1
    train(eager, data)
    want = state_of(eager)
    diffs = {k: float((v.float() - want[k].float()).abs().max()) for k, v in state_of(default).items()}
    print("max |compiled - eager|:", diffs)
    for k, v in state_of(default).items():
        torch.testing.assert_close(v, want[k], rtol=1e-4, atol=1e-5, msg=k)
