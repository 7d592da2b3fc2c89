"""The CPU step's table work as three C loops (`rows.c`): gather, distinct rows + per-row sums, row update.

They replace a chain of torch ops (unique, index_add_, a gather and scatter per state tensor) with one
pass each and the same arithmetic (Adagrad's square root aside, `tests/test_cpu_rows.py`); why and the
figures: `platform/README.md`, "Measured choices". `rows.c` is built at install (setup.py's optional
extension ``mariana.platform.sparse._rows``) and loaded with ctypes. No library, one built from another
`rows.c` (`source_id`; reinstall), or ``MARIANA_CPU_KERNELS=off``: `kernels()` is None and the step keeps
its torch ops (one warning per process). Entry points check dtypes, shapes and every id: a wrong caller
gets an error, never a write outside the table.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import sysconfig
from pathlib import Path

import torch
from torch.profiler import record_function

from ..core.errors import MarianaError

log = logging.getLogger("mariana")

SOURCE = Path(__file__).with_name("rows.c")
LIBRARY = Path(__file__).with_name("_rows" + sysconfig.get_config_var("EXT_SUFFIX"))
# -ffp-contract=off: no multiply-add the source does not write (fmaf where torch's kernels fuse). No
# -march=native: one build serves every CPU of a shared home; rows.c's functions carry their own x86-64-v3
# and v4 clones, picked at load (as fast as -march=native, `platform/README.md`, "Measured choices")
FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno"]
_I64, _F32 = ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_float)
# every argument typed: an untyped Python int is passed as a C int, whose upper half is garbage where an
# int64_t argument goes on the stack (the 7th and later)
_I, _U8, _I32 = ctypes.c_int64, ctypes.POINTER(ctypes.c_uint8), ctypes.POINTER(ctypes.c_int32)
SIGNATURES = {
    "mariana_gather_split": [_F32, _I, _I, _I64, _I, _F32, _F32],
    "mariana_unique_sum": [_I64, _I, _I, _F32, _F32, _I, _I32, _I64, _F32],
    "mariana_update_rows": [_F32, _I, _F32, _U8, _I, _I64, _I, _F32, ctypes.c_int] + [ctypes.c_float] * 3,
}


def source_id(text: bytes | None = None) -> str:
    """The identity of `rows.c`'s text (16 hex digits), compiled into the library by setup.py."""
    return hashlib.sha256(SOURCE.read_bytes() if text is None else text).hexdigest()[:16]


def load(path: Path) -> ctypes.CDLL:
    """The library at ``path``, its functions typed; OSError if it is missing, unloadable, or built from
    another `rows.c` than this one."""
    lib = ctypes.CDLL(str(path))
    lib.mariana_rows_source.restype = ctypes.c_char_p
    built = lib.mariana_rows_source().decode()
    if built != source_id():
        raise OSError(f"{path.name} was built from another rows.c ({built}, now {source_id()}): reinstall")
    for name, args in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int64
    return lib


KERNEL_SWITCH = {"on": True, "1": True, "yes": True, "off": False, "0": False, "no": False}


def kernels_enabled() -> bool:
    """Env ``MARIANA_CPU_KERNELS``: unset or ``on``/``1``/``yes`` -> True, ``off``/``0``/``no`` -> False (any
    case); anything else is a MarianaError naming the variable and the accepted values, never a guess."""
    value = os.environ.get("MARIANA_CPU_KERNELS", "on")
    if value.strip().lower() not in KERNEL_SWITCH:
        raise MarianaError(
            f"MARIANA_CPU_KERNELS={value!r}: expected on or off (also 1/yes, 0/no), or leave it unset"
        )
    return KERNEL_SWITCH[value.strip().lower()]


@functools.cache
def kernels() -> ctypes.CDLL | None:
    """The loaded `rows.c`, or None (the torch ops then do the work): see the module docstring."""
    if not kernels_enabled():
        log.warning("C row kernels off (MARIANA_CPU_KERNELS=off); the CPU step uses torch ops")
        return None
    try:
        return load(LIBRARY)
    except OSError as e:
        log.warning(
            "C row kernels unavailable (%s; `pip install -e .` with a C compiler builds them); the CPU step "
            "uses torch ops",
            str(e).strip()[:200],
        )
        return None


def usable(weight: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """The loops apply: a float32 contiguous table on the CPU (and its companions) and the library built."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and all(t.is_contiguous() for t in (weight, *tensors))
        and kernels() is not None
    )


def _p(t: torch.Tensor, kind):
    return ctypes.cast(t.data_ptr(), kind)


class Scratch:
    """What the loops reuse from step to step for a table of ``num_rows`` rows: ``slot`` [R] int32 (-1
    between calls) and output buffers by name, made anew only when a shape changes: a fresh buffer of
    a few MB each step costs its page faults (one per 4 KiB page; what reusing them saves:
    `platform/README.md`, "Measured choices"). A buffer's contents live until the next step asks for the
    same name."""

    def __init__(self, num_rows: int):
        self.slot = torch.full((num_rows,), -1, dtype=torch.int32)
        self.bufs: dict[str, torch.Tensor] = {}

    def buf(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = self.bufs.get(name)
        if t is None or t.shape != shape or t.dtype != dtype:
            t = self.bufs[name] = torch.empty(shape, dtype=dtype)
        return t


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """ValueError naming the argument unless ``t`` is a contiguous CPU tensor of ``dtype`` and ``shape``: the
    loops read and write raw memory, so a wrong dtype or size would be read as garbage or written past the
    end rather than raise."""
    if t.device.type != "cpu" or t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
        where = "" if t.is_contiguous() else " non-contiguous"
        raise ValueError(
            f"{name}: {t.dtype}{where} {list(t.shape)} on {t.device}, expected {dtype} {list(shape)} on the CPU"
        )


def _check_table(weight: torch.Tensor) -> tuple[int, int]:
    """(R, K) of a float32 contiguous CPU table ``weight`` [R, K]; ValueError otherwise."""
    if weight.dim() != 2:
        raise ValueError(f"table: {list(weight.shape)}, expected [rows, width]")
    _check("table", weight, torch.float32, tuple(weight.shape))
    return weight.shape[0], weight.shape[1]


def gather_split(
    weight: torch.Tensor, ids: torch.Tensor, scratch: Scratch
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight[ids, 0] [*ids.shape], weight[ids, 1:] [*ids.shape, K - 1])``, both contiguous, in
    ``scratch``'s buffers; IndexError for an id outside the table, ValueError for a table that is not
    float32 [R, K] contiguous on the CPU."""
    R, K = _check_table(weight)
    ids = ids.to(torch.int64).contiguous()
    w0 = scratch.buf("w0", tuple(ids.shape), weight.dtype)
    rest = scratch.buf("rest", (*ids.shape, K - 1), weight.dtype)
    with record_function("mariana::gather_split"):  # torch.profiler's breakdowns show the loops by name
        bad = kernels().mariana_gather_split(
            _p(weight, _F32), R, K, _p(ids, _I64), ids.numel(), _p(w0, _F32), _p(rest, _F32)
        )
    if bad >= 0:  # as F.embedding would
        raise IndexError(f"index {int(ids.reshape(-1)[bad])} is out of range for a table of {R} rows")
    return w0, rest


def unique_sum(ids: torch.Tensor, g0: torch.Tensor, grest: torch.Tensor, scratch: Scratch):
    """The distinct rows of ``ids`` [N] in order of first appearance ``rows [U]`` and their gradient sums
    ``[U, K]`` (column 0 from ``g0`` [N], the rest from ``grest`` [N, K - 1], float32), views of
    ``scratch``'s buffers (its ``slot`` sized to the table). IndexError for an id outside the table,
    ValueError for gradients of another dtype or size."""
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    N, K = ids.numel(), grest.shape[-1] + 1
    g0, grest = g0.reshape(-1).contiguous(), grest.reshape(N, K - 1).contiguous()
    _check("g0", g0, torch.float32, (N,))
    _check("grest", grest, torch.float32, (N, K - 1))
    rows = scratch.buf("rows", (N,), torch.int64)
    sums = scratch.buf("sums", (N, K), torch.float32)
    slot = scratch.slot
    with record_function("mariana::unique_sum"):
        U = kernels().mariana_unique_sum(
            _p(ids, _I64),
            N,
            slot.numel(),
            _p(g0, _F32),
            _p(grest, _F32),
            K,
            _p(slot, ctypes.POINTER(ctypes.c_int32)),
            _p(rows, _I64),
            _p(sums, _F32),
        )
    if U < 0:
        raise IndexError(f"index {int(ids[-1 - U])} is out of range for a table of {slot.numel()} rows")
    return rows[:U], sums[:U]


RULE_CODES = {"sgd": 0, "adagrad": 1}


def update_rows(weight, acc, seen, rows, grad, rule: str, lr: float, eps: float, l2: float = 0.0) -> None:
    """The row optimiser ``rule`` ("sgd" or "adagrad"; ``acc`` [R, K] its accumulator, None for sgd) on the
    distinct ``rows`` [U] with ``grad`` [U, K] float32 (``l2 * row`` added in place first when ``l2 > 0``);
    ``seen`` [R] bool: ``seen[rows] = True``. ``weight`` [R, K] float32. Every argument is checked first:
    ValueError for a dtype or shape the loop cannot take, IndexError for a row outside the table (nothing
    written)."""
    R, K = _check_table(weight)
    rows = rows.to(torch.int64).contiguous()
    U = rows.numel()
    _check("grad", grad, torch.float32, (U, K))
    _check("seen", seen, torch.bool, (R,))
    if rule == "adagrad":
        _check("acc", acc, torch.float32, (R, K))
    with record_function("mariana::update_rows"):
        bad = kernels().mariana_update_rows(
            _p(weight, _F32),
            R,
            _p(acc if rule == "adagrad" else weight, _F32),  # sgd reads no accumulator
            _p(seen, ctypes.POINTER(ctypes.c_uint8)),
            K,
            _p(rows, _I64),
            U,
            _p(grad, _F32),
            RULE_CODES[rule],
            ctypes.c_float(lr),
            ctypes.c_float(eps),
            ctypes.c_float(l2),
        )
    if bad >= 0:
        raise IndexError(f"row {int(rows[bad])} is out of range for a table of {R} rows (nothing updated)")
