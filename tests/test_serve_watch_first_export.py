"""Issue 30.12 (serve): the README's order, `pctr stream` then `serve --pctr RUN --watch`, works before
the stream's first export: serve waits for it (one line) and then serves, instead of failing; without
--watch the error names no flag serve does not have (it said --model, serve's flag is --pctr)."""

import shutil

from cliwalk import run_main
from helpers import start_cli, wait_for_line


def test_watch_waits_for_the_first_export(tmp_path, data_dir, capsys):
    live = tmp_path / "live"
    live.mkdir()
    rc, out, err = run_main(["serve", "--pctr", live, "--port", "0"], capsys)
    assert rc == 2 and "no exported model" in err and "--model" not in err, err
    log = tmp_path / "serve.log"
    srv = start_cli(["serve", "--pctr", live, "--port", "0", "--watch", "--watch-interval", "0.2"], log)
    try:
        assert "waiting for the first exported model" in wait_for_line(srv, log, "waiting")[0]
        data = tmp_path / "f.libfm"
        data.write_text(
            "\n".join((data_dir / "frappe" / "frappe.validation.libfm").read_text().splitlines()[:200])
        )
        run = tmp_path / "run"
        argv = ["pctr", "train", "--data", data, "--out", run, "--preset", "debug", "--max-steps", "1"]
        rc, out, err = run_main([*argv, "--batch-size", "32", "--no-progress"], capsys)
        assert rc == 0, err
        shutil.copyfile(run / "model.json", live / "model.json")
        shutil.copyfile(run / "model.safetensors", live / "model.safetensors")
        line = wait_for_line(srv, log, "serving")[-1]
        assert line.startswith("serving pctr on http://"), line
    finally:
        srv.terminate()
        srv.wait(timeout=30)
