"""The block reader (`mariana.platform.data.textblocks`), and the Arrow parsers beside the per-line
ones: same tensors, same skips and messages."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed

import pytest
import torch
from mariana.apps.pctr.data.encoding import Batch, Encoder, ReadStats, Schema, infer_schema, iter_chunks
from mariana.platform.data.libfm import _parse_arrow, parse_block, parse_lines
from mariana.platform.data.textblocks import ordered_map, read_blocks


@pytest.fixture
def frappe(data_dir):
    return data_dir / "frappe" / "frappe.validation.libfm"


@pytest.fixture
def criteo(data_dir):
    return data_dir / "criteo" / "criteo_sample.tsv"


def _lines_of(blocks) -> list[tuple[int, bytes]]:
    out = []
    for first, block in blocks:
        for k, line in enumerate(block.split(b"\n")[: block.count(b"\n") + (not block.endswith(b"\n"))]):
            out.append((first + k, line))
    return out


@pytest.mark.parametrize("tail", [b"", b"\n"])
def test_read_blocks_yields_every_line_once_with_its_number(tmp_path, tail):
    rng = random.Random(0)
    lines = [b"x" * rng.randint(0, 30) + b"\r" * (i % 3 == 0) for i in range(500)]
    path = tmp_path / "f.txt"
    path.write_bytes(b"\n".join(lines) + tail)
    for max_lines, block_bytes in [(1, 1 << 20), (7, 64), (1000, 16), (65536, 1 << 20)]:
        got = _lines_of(read_blocks(path, max_lines=max_lines, block_bytes=block_bytes))
        assert got == list(enumerate(lines))
        part = _lines_of(read_blocks(path, 123, 321, max_lines=max_lines, block_bytes=block_bytes))
        assert part == list(enumerate(lines))[123:321]


def _out_of_order_square(done: list, events: dict):
    """x -> x * x, where every even x finishes only after x + 1 has: completion order is not input order."""

    def fn(x: int) -> int:
        if x % 2 == 0 and not events[x + 1].wait(10):
            raise AssertionError(f"{x + 1} never ran while {x} waited")
        done.append(x)
        events[x].set()
        return x * x

    return fn


def test_ordered_map_keeps_order_on_threads():
    done: list[int] = []
    events = {x: threading.Event() for x in range(41)}
    got = list(ordered_map(_out_of_order_square(done, events), range(40), threads=2, ahead=1))
    assert got == [x * x for x in range(40)]
    assert done != sorted(done)  # the threads really finished out of order
    # the same function through a completion-order map gives another order: the check above can fail
    done2: list[int] = []
    events = {x: threading.Event() for x in range(41)}
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(_out_of_order_square(done2, events), x) for x in range(40)]
        assert [f.result() for f in as_completed(futures)] != got


MALFORMED_LIBFM = [
    "1 3:1 4:0.5",
    "",
    "   ",
    "x 3:1",
    "2 3:1",
    "1 3",
    "1 3:1:2",
    "1 -3:1",
    "1 +3:1",
    "1 3:abc",
    "-1 7:1e-3 8:.5",
    "1 3:1 4:1 5:1 6:1",  # more fields than the schema's 3
    "0 3:1\t4:2",
    "1 3:1_0",
    "1.0 9:1",
    "1 é:1",
]


@pytest.mark.parametrize("has_label", [True, False])
def test_arrow_libfm_parser_equals_the_per_line_parser(has_label, frappe):
    frappe = frappe.read_bytes()
    lines = frappe.decode().split("\n")[:-1]
    cases = [frappe[:200_000].rsplit(b"\n", 1)[0] + b"\n"]
    rng = random.Random(1)
    for _ in range(40):  # valid lines with one malformed line (or none) at a random place
        pick = lines[:50]
        if rng.random() < 0.8:
            pick = pick[:]
            pick.insert(rng.randrange(len(pick)), rng.choice(MALFORMED_LIBFM))
        cases.append(("\r\n" if rng.random() < 0.5 else "\n").join(pick).encode())
    assert _parse_arrow(cases[0], 10, True) is not None  # valid lines take the Arrow path
    if not has_label:
        cases = [b"\n".join(ln.split(b" ", 1)[-1] for ln in c.split(b"\n")) for c in cases]
    for block in cases:
        for F in (None, 3, 10):
            a = parse_block(block, F, has_label)
            text = block.decode("utf-8", "replace").split("\n")[
                : block.count(b"\n") + (not block.endswith(b"\n"))
            ]
            b = parse_lines(text, F, has_label)
            assert a.good == b.good and a.errors == b.errors
            for k in ("labels", "ids", "vals", "known"):
                assert (getattr(a, k) == getattr(b, k)).all() and getattr(a, k).shape == getattr(b, k).shape


def _criteo_variants(criteo, rng: random.Random) -> list[str]:
    good = criteo.read_text().split("\n")[:60]
    bad = [
        "2\t1\t2",  # too few fields
        "\t".join(["1"] * 45),  # too many
        "x" + good[0][1:],  # label
        good[0].replace("\t", "\t1.5", 1),  # a count that is not an integer
        good[0] + "\r",
        "",
        good[0].replace("\t", "\t+7", 1),  # accepted by int(), not plain digits
        good[1].rsplit("\t", 5)[0],  # trailing empty fields stripped
        good[2].replace("\t", "\té", 20),
    ]
    out = []
    for _ in range(30):
        pick = good[:]
        for _ in range(rng.randint(0, 3)):
            pick.insert(rng.randrange(len(pick)), rng.choice(bad))
        out.append("\n".join(pick))
    return out


def test_arrow_criteo_reader_equals_the_per_line_reader(criteo):
    enc = Encoder(Schema("criteo", 39, 1000, 13))
    assert enc._criteo_arrow(criteo.read_bytes(), True) is not None  # the sample takes the Arrow path
    for text in _criteo_variants(criteo, random.Random(2)):
        block = text.encode()
        fast, fast_good, fast_err = enc.encode_block(block)
        slow, slow_good, slow_err = enc.encode(text.split("\n"))
        assert fast_good == slow_good and fast_err == slow_err
        for k in ("ids", "vals", "dense", "labels"):
            assert torch.equal(getattr(fast, k), getattr(slow, k)), k


@pytest.mark.parametrize(
    "name,fmt", [("frappe/frappe.validation.libfm", "libfm"), ("criteo/criteo_sample.tsv", "criteo")]
)
def test_threaded_chunks_equal_the_per_line_reader_on_the_samples(data_dir, name, fmt):
    path = data_dir / name
    enc = Encoder(infer_schema(path, fmt, 5000))
    ref_stats, got_stats = ReadStats(), ReadStats()
    text = path.read_text().split("\n")
    if text[-1] == "":
        text.pop()
    ref = Batch.cat(
        [enc.encode(text[i : i + 5000], True, i + 1, ref_stats)[0] for i in range(0, len(text), 5000)]
    )
    got = Batch.cat(list(iter_chunks(path, enc, chunk=777, stats=got_stats, threads=2)))
    for k in ("ids", "vals", "dense", "labels"):
        assert torch.equal(getattr(ref, k), getattr(got, k))
    assert (ref_stats.rows, ref_stats.skipped, ref_stats.errors) == (
        got_stats.rows,
        got_stats.skipped,
        got_stats.errors,
    )
