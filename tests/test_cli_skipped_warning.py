"""Issue 30, point 17: every app that leaves out bad input says so in one line of the same shape
(`mariana.platform.cli.console.warn_skipped`): pCTR and mlp training over a libFM file with a malformed line,
vision training over a tar with a corrupt JPEG, ASR preparation over recordings with an unreadable WAV, each
through the CLI run in this process (`cliwalk.cli`; one-process runs, debug presets)."""

from __future__ import annotations

import io
import re
import shutil
import tarfile

from cliwalk import cli

# mariana: warning: skipped N <unit>s in <data> (first: <where>: <why>)
SHAPE = re.compile(
    r"^mariana: warning: skipped (\d+) (malformed line|corrupt image|unreadable recording)s? in (\S+) "
    r"\(first: (.+?): (.+)\)$",
    re.M,
)


def _warnings(stderr: str) -> list[tuple[str, ...]]:
    found = SHAPE.findall(stderr)
    # no other wording of the same event anywhere on the console
    others = [ln for ln in stderr.splitlines() if "skipped" in ln.lower() and not SHAPE.match(ln)]
    assert not others, others
    return found


def test_every_app_words_skipped_input_the_same(data_dir, tmp_path, capfd):
    lines = (data_dir / "frappe" / "frappe.validation.libfm").read_text().splitlines()[:400]
    lines[6] = "x 1:1"  # line 7: not a label
    libfm = tmp_path / "bad.libfm"
    libfm.write_text("\n".join(lines) + "\n")
    common = ["--data", libfm, "--preset", "debug", "--max-steps", "2", "--no-progress"]
    seen = {}
    for app in ("pctr", "mlp"):
        p = cli([app, "train", *common, "--out", tmp_path / app], capfd, check=True)
        seen[app] = _warnings(p.stderr)
    for app in ("pctr", "mlp"):
        ((n, unit, data, where, why),) = seen[app]
        assert (n, unit, data, where) == ("1", "malformed line", str(libfm), "line 7"), seen[app]
        assert why  # the parser's reason

    shard = tmp_path / "small.tar"
    with tarfile.open(data_dir / "cifar10" / "test-dev.tar") as src, tarfile.open(shard, "w") as dst:
        members = [m for m in src if m.isfile()][:40]
        for m in members:
            dst.addfile(m, src.extractfile(m))
        junk = b"\xff\xd8\xff\xe0" + b"\x00not a jpeg" * 20
        info = tarfile.TarInfo("test/cat/broken.jpg")
        info.size = len(junk)
        dst.addfile(info, io.BytesIO(junk))
    p = cli(
        ["vision", "train", "--data", shard, "--out", tmp_path / "vision", "--preset", "debug",
         "--max-steps", "1", "--no-progress"],
        capfd,
        check=True,
    )  # fmt: skip
    ((n, unit, data, where, why),) = _warnings(p.stderr)
    assert (n, unit, data) == ("1", "corrupt image", str(shard)) and where.endswith("test/cat/broken.jpg")

    rec = tmp_path / "rec"
    rec.mkdir()
    for f in sorted((data_dir / "fsdd" / "recordings").glob("[0-9]_*_[01].wav")):
        shutil.copy(f, rec)
    bad = rec / "5_george_9.wav"
    bad.write_bytes(b"RIFF\x00\x00\x00\x00WAVEfmt garbage")
    p = cli(
        ["asr", "prepare", "--data", rec, "--out", tmp_path / "asr", "--test-speakers", "lucas",
         "--utterances", "4"],
        capfd,
        check=True,
    )  # fmt: skip
    ((n, unit, data, where, why),) = _warnings(p.stderr)
    assert (n, unit, data, where) == ("1", "unreadable recording", str(rec), str(bad)), (data, where)
