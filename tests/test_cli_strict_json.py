"""Issue 30.8: nothing the platform writes holds a bare NaN (not JSON: browsers, jq and most languages
refuse it): a metric that could not be computed is ``null``; and a stream warns for every file that
yields no rows (wrong --format, an empty file), not only for files with malformed lines."""

import json

from cliwalk import run_main


def _strict(text: str):
    def refuse(const):
        raise AssertionError(f"non-JSON constant {const} written")

    return json.loads(text, parse_constant=refuse)


def test_stream_of_the_wrong_format_writes_null_and_warns_per_file(tmp_path, data_dir, capsys):
    d = tmp_path / "logs"
    d.mkdir()
    lines = (data_dir / "frappe" / "frappe.validation.libfm").read_text().splitlines()[:40]
    (d / "a.libfm").write_text("\n".join(lines) + "\n")  # libFM into a criteo stream: every line skipped
    (d / "b.libfm").write_text("")  # no lines at all: nothing skipped, still no rows
    run = tmp_path / "run"
    argv = ["pctr", "stream", "--data", d, "--out", run, "--format", "criteo", "--max-files", "2"]
    rc, out, err = run_main([*argv, "--batch-size", "16", "--poll", "0.1"], capsys)
    assert rc == 0, err
    final = _strict((run / "metrics.json").read_text())
    assert final["progressive_auc"] is None
    for line in (run / "metrics.jsonl").read_text().splitlines():
        _strict(line)
    for name in ("a.libfm", "b.libfm"):
        assert f"{d / name} yielded no valid criteo rows" in err, err


def test_train_without_validation_rows_writes_null(tmp_path, data_dir, capsys):
    data = tmp_path / "f.libfm"
    lines = (data_dir / "frappe" / "frappe.validation.libfm").read_text().splitlines()[:64]
    data.write_text("\n".join(lines) + "\n")
    run = tmp_path / "run"
    argv = ["pctr", "train", "--data", data, "--out", run, "--preset", "debug", "--split", "1,0,0"]
    rc, out, err = run_main([*argv, "--max-steps", "1", "--batch-size", "16", "--no-progress"], capsys)
    assert rc == 0, err
    final = _strict((run / "metrics.json").read_text())
    assert final["val_auc"] is None
    _strict((run / "model.json").read_text())
