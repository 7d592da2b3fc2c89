"""``mariana runs show RUN`` and ``mariana runs ls DIR`` (issue 44.4) on real runs (`trained_runs`' Frappe
DeepFM, 60 steps, its best evaluation exported): what they say is what the run's files and the real
``--resume`` say; a folder is a run only by the marker or as a proven older run (`outputs`' rule); ``--json``
parses; both import no torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from helpers import ROOT, cli_env
from trained_runs import FRAPPE_DEEPFM, cli_in_process, fresh_copy, run_ok


def _show(run) -> dict:
    return json.loads(run_ok(["runs", "show", run, "--json"])[0])


def test_show_says_what_the_run_holds_and_what_resume_does(frappe_deepfm, tmp_path):
    run = fresh_copy(frappe_deepfm, tmp_path / "run")
    d = _show(run)
    final, model = (json.loads((run / n).read_text()) for n in ("metrics.json", "model.json"))
    assert d["app"] == "pctr" and d["command"] == "pctr train" and d["run"] == str(run)
    assert d["config"]["net"]["model"] == "deepfm" and d["config"]["loop"]["max_steps"] == 60
    assert d["best"] == {
        "best_eval_auc": final["best_eval_auc"],
        "best_step": final["best_step"],
        "monitor": "auc",
    }
    assert d["last"]["step"] == 60 and d["last"]["eval_auc"] == final["eval_auc"] and "loss" in d["last"]
    assert d["checkpoints"] == [60] and d["latest_checkpoint"] == 60
    assert d["model"]["version"] == model["version"] and d["onnx"] is None
    assert d["resume"] == {"can": False, "from_step": 60, "why": "did its --max-steps 60; pass a larger one"}
    text = run_ok(["runs", "show", run])[0]
    assert f"\nmodel        arch=deepfm version={model['version']} created=" in text
    assert (
        text.splitlines()[-1]
        == "resume       --resume cannot continue it (did its --max-steps 60; pass a larger one)"
    )
    # what it said, the real --resume does: refused at 60 steps, continued with a larger --max-steps
    argv = [*FRAPPE_DEEPFM, "--out", run, "--resume"]
    rc, _, err = cli_in_process(argv)
    assert rc == 2 and "already done 60 steps" in err, err
    run_ok([*argv, "--max-steps", "80"])
    d = _show(run)
    assert d["latest_checkpoint"] == 80 and d["last"]["step"] == 80 and d["config"]["loop"]["max_steps"] == 80
    assert d["resume"]["from_step"] == 80 and not d["resume"]["can"]
    (run / "config.toml").write_text(
        (run / "config.toml").read_text().replace("max_steps = 80", "max_steps = 100")
    )
    assert _show(run)["resume"] == {"can": True, "from_step": 80, "to_step": 100}


def test_ls_lists_runs_only(frappe_deepfm, frappe_fm, tmp_path):
    top = tmp_path / "runs"
    fresh_copy(frappe_deepfm, top / "a" / "deepfm")
    fresh_copy(frappe_fm, top / "fm")
    legacy = fresh_copy(frappe_fm, top / "old")
    (legacy / ".mariana-output").unlink()  # a run from before the marker: its config + metrics.jsonl prove it
    user = top / "mine"  # a user's folder with files of the same names proves nothing
    user.mkdir()
    shutil.copy(frappe_fm.path / "metrics.json", user)
    (user / "config.toml").write_text('[net]\nmodel = "fm"\n')
    stdout = run_ok(["runs", "ls", top])[0].splitlines()
    assert [line.split()[0] for line in stdout[:-1]] == [
        str(top / "a" / "deepfm"),
        str(top / "fm"),
        str(top / "old"),
    ]
    assert stdout[-1] == f"3 runs under {top}" and all("pctr train" in line for line in stdout[:-1])
    runs = json.loads(run_ok(["runs", "ls", top, "--json"])[0])
    assert [r["config"]["net"]["model"] for r in runs] == ["deepfm", "fm", "fm"]
    assert (
        runs[0]["best"]["best_eval_auc"]
        == json.loads((frappe_deepfm.path / "metrics.json").read_text())["best_eval_auc"]
    )
    assert json.loads(run_ok(["runs", "ls", user, "--json"])[0]) == []
    for argv, what in (
        (["runs", "show", user], f"mariana: error: {user}: not a run directory"),
        (["runs", "show", top / "nope"], f"mariana: error: {top / 'nope'}: no such run directory"),
        (["runs", "ls", top / "nope"], f"mariana: error: {top / 'nope'}: no such folder"),
    ):
        rc, _, err = cli_in_process(argv)
        assert rc == 2 and err.strip().startswith(what) and len(err.strip().splitlines()) == 1, err


def test_runs_commands_import_no_torch(frappe_deepfm):
    code = (
        "import sys; from mariana.platform.cli.main import main; "
        f"rc = main(['runs', 'show', {str(frappe_deepfm.path)!r}]) + main(['runs', 'ls', {str(frappe_deepfm.path)!r}]); "
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules), rc)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=cli_env(), capture_output=True, text=True
    )
    assert out.stdout.splitlines()[-1] == "[] 0", out.stdout + out.stderr
