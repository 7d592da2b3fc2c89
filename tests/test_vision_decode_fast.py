"""The fast decode-once path: the tar index walked from the headers equals tarfile's (and falls back to it
on anything unusual), and decoding in worker processes gives the same pixels, labels and skipped files
as decoding in this process."""

from __future__ import annotations

import io
import tarfile

import pytest
import torch
from helpers import DATA
from mariana.apps.vision.data import TarSource, decode_all
from mariana.apps.vision.tarindex import scan_tar
from mariana.platform.core.errors import DataError

TEST_TAR = DATA / "cifar10" / "test-dev.tar"
CORRUPT = b"\xff\xd8\xff\xe0" + b"\x00garbage, not a jpeg" * 20


def tarfile_index(path) -> list[tuple[str, int, int]]:
    with tarfile.open(path, "r:") as tf:
        return [(m.name, m.offset_data, m.size) for m in tf if m.isfile()]


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """300 images of test-dev.tar (GNU format, like the shared tars) with a corrupt JPEG in the middle."""
    path = tmp_path_factory.mktemp("fast") / "shard.tar"
    with tarfile.open(TEST_TAR) as src, tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as dst:
        k = 0
        for m in src:
            if m.isfile() and k < 300:
                dst.addfile(m, src.extractfile(m))
                k += 1
                if k == 150:
                    info = tarfile.TarInfo("test/dog/zz-broken.jpg")
                    info.size = len(CORRUPT)
                    dst.addfile(info, io.BytesIO(CORRUPT))
    return path


def test_scan_equals_tarfile_on_the_shared_tar():
    members = scan_tar(TEST_TAR)
    assert members is not None and len(members) == 5000
    assert members == tarfile_index(TEST_TAR)


def test_unusual_headers_fall_back_to_tarfile(shard, tmp_path):
    # a PAX long name (> 100 bytes): not walked, TarSource still indexes it through tarfile
    pax = tmp_path / "pax.tar"
    with tarfile.open(shard) as src, tarfile.open(pax, "w", format=tarfile.PAX_FORMAT) as dst:
        for m in src:
            dst.addfile(m, src.extractfile(m))
        info = tarfile.TarInfo("test/cat/" + "x" * 120 + ".jpg")
        info.size = len(CORRUPT)
        dst.addfile(info, io.BytesIO(CORRUPT))
    assert scan_tar(pax) is None
    assert any(len(n) > 120 for n in TarSource(pax).names) and len(TarSource(pax)) == 302
    # a header with a wrong checksum (planted in the 2nd member): the walk refuses, tarfile stops there
    bad = tmp_path / "badsum.tar"
    data = bytearray(shard.read_bytes())
    second = scan_tar(shard)[1][1] - 512
    data[second + 148 : second + 156] = b"000001\0 "
    bad.write_bytes(bytes(data))
    assert scan_tar(bad) is None
    assert TarSource(bad).names == [tarfile_index(bad)[0][0]]
    # not a tar at all: the same clear error as before
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"not a tar" * 100)
    assert scan_tar(junk) is None
    with pytest.raises(DataError, match="not an uncompressed tar"):
        TarSource(junk)


def test_worker_decode_gives_the_same_pixels(shard):
    src = TarSource(shard)
    one = decode_all(src, 32)
    pool = decode_all(src, 32, workers=2)  # 5 chunks of 64 over 2 processes: order must be kept
    assert one.images.shape == (300, 3, 32, 32) and len(one.bad) == 1
    assert torch.equal(pool.images, one.images) and torch.equal(pool.labels, one.labels)
    assert pool.bad == one.bad and pool.bad[0][0].endswith("zz-broken.jpg")
    # a subset (--limit) too
    a, b = decode_all(src, 32, limit=100), decode_all(src, 32, limit=100, workers=2)
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
