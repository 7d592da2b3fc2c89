"""Issue 41 point 6: compressed click logs (``.gz``, ``.bz2``) are read, streamed, by every reader: pCTR's
line counter and encoder (Criteo and libFM, a file and a folder of partitions), a `pctr stream` unit, the
MLP's libFM reader; each gives the rows of the uncompressed file. ``.zst`` (no zstandard here) and a
truncated stream are refused in one line naming the file."""

from __future__ import annotations

import bz2
import gzip
from pathlib import Path

import numpy as np
import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
SOURCES = {
    "criteo": SHARED / "criteo" / "criteo_sample.tsv",
    "libfm": SHARED / "frappe" / "frappe.validation.libfm",
}
PACK = {".gz": gzip.compress, ".bz2": bz2.compress}


def _pair(tmp: Path, fmt: str, suffix: str, lines: int = 700) -> tuple[Path, Path]:
    text = b"".join(SOURCES[fmt].read_bytes().splitlines(keepends=True)[:lines])
    plain = tmp / f"plain.{fmt}"
    plain.write_bytes(text)
    packed = tmp / f"day-01.{SOURCES[fmt].suffix[1:]}{suffix}"  # day-01.tsv.gz: a default --files name
    packed.write_bytes(PACK[suffix](text))
    return plain, packed


def _rows(data, fmt: str):
    from mariana.apps.pctr.data.encoding import Encoder, count_lines, infer_schema, load_split

    encoder = Encoder(infer_schema(data, fmt, 1000))
    return count_lines(data), load_split(data, encoder, 0, None)


def _same(a, b) -> None:
    for name in ("ids", "vals", "dense", "labels"):
        assert np.array_equal(getattr(a, name).numpy(), getattr(b, name).numpy()), name


READERS = ["pctr file", "pctr folder", "pctr stream unit", "mlp libfm"]


CASES = [  # every reader with every format it reads (the MLP reads libFM only) and every compression
    (r, f, x)
    for r in READERS
    for f in sorted(SOURCES)
    for x in sorted(PACK)
    if (r, f) != ("mlp libfm", "criteo")
]


@pytest.mark.parametrize("reader,fmt,suffix", CASES, ids=["-".join(c) for c in CASES])
def test_a_compressed_log_reads_as_the_plain_one(tmp_path: Path, reader, fmt, suffix):
    plain, packed = _pair(tmp_path, fmt, suffix)
    if reader == "mlp libfm":
        from mariana.apps.mlp.data import read_libfm

        for x, y in zip(read_libfm(plain), read_libfm(packed), strict=True):
            assert np.array_equal(np.asarray(x), np.asarray(y))
        return
    lines, want = _rows(plain, fmt)
    if reader == "pctr folder":
        (tmp_path / "days").mkdir()
        packed = packed.rename(tmp_path / "days" / packed.name)
        got_lines, got = _rows(tmp_path / "days", fmt)
    elif reader == "pctr stream unit":
        from mariana.apps.pctr.data.encoding import Encoder, infer_schema
        from mariana.apps.pctr.streams.folder import read_unit, scan

        (unit,) = [f for f in scan(tmp_path) if f.name == packed.name]  # matched by the default --files
        got, skipped, _ = read_unit(unit, Encoder(infer_schema(plain, fmt, 1000)), tmp_path)
        got_lines = len(got) + skipped
    else:
        got_lines, got = _rows(packed, fmt)
    assert got_lines == lines == 700 and len(got) == len(want) > 0
    _same(got, want)


@pytest.mark.parametrize("broken", ["a .zst file", "a truncated .gz"])
def test_an_unreadable_compressed_file_is_named(tmp_path: Path, broken):
    from mariana.apps.pctr.data.encoding import count_lines
    from mariana.platform.core.errors import DataError

    _, packed = _pair(tmp_path, "criteo", ".gz")
    if broken == "a .zst file":
        packed = packed.rename(packed.with_suffix(".zst"))
        says = "zstd-compressed"
    else:
        packed.write_bytes(packed.read_bytes()[:-200])
        says = "cannot be read"
    with pytest.raises(DataError, match=says) as e:
        count_lines(packed)
    assert str(packed) in str(e.value)
