"""The CPU step's table work as three C loops (`rows.c`): gather, distinct rows + per-row sums, row update.

On the CPU the eager step's table side was a chain of torch ops: ``torch.unique`` (a sort), an
``index_add_`` per part, and a gather and a scatter per tensor of the row optimiser, a large share of a bf16
step's operator time at Criteo's shapes; FBGEMM's fused CPU kernels, the field's library for this, were
slower than our step (figures: `platform/README.md`, "Measured choices"). These loops do the same arithmetic
in one pass each (same operations per element, same order of additions per row: the same numbers but
for Adagrad's square root, correctly rounded here, see `tests/test_cpu_rows.py`).

`kernels()` builds `rows.c` with the system C compiler (``$CC``, else ``cc``) the first time, into
``$MARIANA_KERNEL_CACHE`` (default ``~/.cache/mariana/kernels``; a per-user temporary folder if that
cannot be written), one file per source, flags and machine, written atomically; later processes load
it. No compiler, a failed build, or ``MARIANA_CPU_KERNELS=off``: None, and the step keeps its torch ops
(one warning line per process).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch.profiler import record_function

from ..core.errors import MarianaError

log = logging.getLogger("mariana")

SOURCE = Path(__file__).with_name("rows.c")
# -ffp-contract=off: no multiply-add the source does not write (fmaf where torch's kernels fuse)
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]
_I64, _F32 = ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_float)


def _cache_dirs() -> list[Path]:
    """Where the library may live: ``$MARIANA_KERNEL_CACHE`` or ``~/.cache/mariana/kernels``, then (a
    home that cannot be written) the temporary directory."""
    first = os.environ.get("MARIANA_KERNEL_CACHE") or Path.home() / ".cache" / "mariana" / "kernels"
    return [Path(first), Path(tempfile.gettempdir()) / f"mariana-kernels-{os.getuid()}"]


def _private(folder: Path) -> bool:
    """``folder`` is ours to load code from: made now (mode 0700) or already owned by this user and
    writable by nobody else (a shared temporary directory could hold another user's folder)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = folder.stat()
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _build(cc: str) -> Path:
    """The shared library for this source, flags, compiler and machine: built once, then reused."""
    text = SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(b"\0".join([text, " ".join(FLAGS).encode(), version.encode(), _cpu_id()]))
    name = f"rows-{key.hexdigest()[:16]}.so"
    for folder in _cache_dirs():
        try:
            if not _private(folder):
                continue
            if (folder / name).exists():
                return folder / name
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
            break
        except OSError:
            continue
    else:
        raise OSError(
            f"no writable private folder for the library among {', '.join(map(str, _cache_dirs()))}"
        )
    out = folder / name
    os.close(fd)
    try:
        subprocess.run(
            [cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True, check=True
        )
        os.replace(tmp, out)  # atomic: a process beside this one loads a whole file or builds its own
        for old in out.parent.glob("rows-*.so"):  # builds of earlier sources or flags: not loaded again
            if old != out:
                old.unlink(missing_ok=True)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _cpu_id() -> bytes:
    """The machine's CPU model and flags (``-march=native`` code runs only where they match)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))})).encode()
    except OSError:
        return platform.processor().encode()


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
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    try:
        if cc is None:
            raise OSError("no C compiler (cc/gcc) on PATH")
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("C row kernels unavailable (%s); the CPU step uses torch ops", detail.strip()[:200])
        return None
    lib.mariana_unique_sum.restype = lib.mariana_gather_split.restype = ctypes.c_int64
    return lib


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


def gather_split(
    weight: torch.Tensor, ids: torch.Tensor, scratch: Scratch
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight[ids, 0] [*ids.shape], weight[ids, 1:] [*ids.shape, K - 1])``, both contiguous, in
    ``scratch``'s buffers; IndexError for an id outside the table."""
    ids = ids.to(torch.int64).contiguous()
    K = weight.shape[1]
    w0 = scratch.buf("w0", tuple(ids.shape), weight.dtype)
    rest = scratch.buf("rest", (*ids.shape, K - 1), weight.dtype)
    with record_function("mariana::gather_split"):  # torch.profiler's breakdowns show the loops by name
        bad = kernels().mariana_gather_split(
            _p(weight, _F32), weight.shape[0], K, _p(ids, _I64), ids.numel(), _p(w0, _F32), _p(rest, _F32)
        )
    if bad >= 0:  # as F.embedding would
        raise IndexError(
            f"index {int(ids.reshape(-1)[bad])} is out of range for a table of {weight.shape[0]} rows"
        )
    return w0, rest


def unique_sum(ids: torch.Tensor, g0: torch.Tensor, grest: torch.Tensor, scratch: Scratch):
    """The distinct rows of ``ids`` [N] in order of first appearance ``rows [U]`` and their gradient sums
    ``[U, K]`` (column 0 from ``g0`` [N], the rest from ``grest`` [N, K - 1], float32), views of
    ``scratch``'s buffers (its ``slot`` sized to the table). IndexError for an id outside the table."""
    ids, g0, grest = (
        ids.reshape(-1).to(torch.int64).contiguous(),
        g0.reshape(-1).contiguous(),
        grest.contiguous(),
    )
    N, K = ids.numel(), grest.shape[-1] + 1
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
    """The row optimiser ``rule`` ("sgd" or "adagrad"; ``acc`` [R, K] its accumulator, any tensor for
    sgd) on the distinct ``rows`` [U] with ``grad`` [U, K] (``l2 * row`` added in place first when
    ``l2 > 0``); ``seen[rows] = True``. ``weight`` [R, K] float32."""
    K = weight.shape[1]
    with record_function("mariana::update_rows"):
        kernels().mariana_update_rows(
            _p(weight, _F32),
            _p(acc, _F32),
            _p(seen, ctypes.POINTER(ctypes.c_uint8)),
            K,
            _p(rows, _I64),
            rows.numel(),
            _p(grad, _F32),
            RULE_CODES[rule],
            ctypes.c_float(lr),
            ctypes.c_float(eps),
            ctypes.c_float(l2),
        )
