"""Bad input gets one clear line and exit code 2, never a traceback: a table of cases of the platform layer
(config files, choices, --out, --resume, numeric flags, mlp eval), plus the console of multi-worker jobs
(Ctrl-C, a crashing worker, a quiet successful run) and ``--version``.

Most cases fail before any training starts. The table runs the CLI in this process (`cliwalk.cli`); what
only a real process shows (the exit code the shell sees, ``--version`` through ``python -m``, signals, a
crashing worker) runs as one. Paths in the table: ``{data}`` a 600-row libFM file, ``{tmp}``
a folder holding the config files below, ``{run}`` a trained mlp run (2 steps, debug preset, batch 32),
``{pctr}`` an exported model whose model.json names another app.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from cliwalk import cli
from helpers import ROOT, assert_cli_error, cli_env, run_cli

FRAPPE_ROWS = 600


@pytest.fixture(scope="module")
def env(tmp_path_factory, data_dir):
    tmp = tmp_path_factory.mktemp("cli-errors")
    lines = (data_dir / "frappe" / "frappe.validation.libfm").read_text().splitlines()[:FRAPPE_ROWS]
    data = tmp / "tiny.libfm"
    data.write_text("\n".join(lines) + "\n")
    for name, text in {
        "rmsprop.toml": 'optimizer = "rmsprop"\n',
        "fp8.toml": 'amp = "fp8"\n',
        "schedule.toml": 'schedule = "foo"\n',
        "gradcomm.toml": 'grad_comm = "fp8"\n',
        "epochs.toml": 'batch_size = 32\nepochs = "two"\n',
        "preset.toml": 'preset = "huge"\n',
        "bad.toml": "epochs = \n",
    }.items():
        (tmp / name).write_text(text)
    (tmp / "x.bin").write_bytes(bytes(range(256)) * 4)
    (tmp / "a-file").write_text("not a directory\n")
    run = tmp / "run"
    cli(
        ["mlp", "train", "--data", data, "--out", run, "--preset", "debug", "--max-steps", "2"]
        + ["--no-progress"],
        check=True,
    )
    from mariana.platform.core.export import export_model

    pctr = tmp / "pctr-run"
    export_model(pctr, {"w": torch.zeros(2)}, app="pctr", arch="deepfm", config={"model": "deepfm"})
    return {"data": data, "tmp": tmp, "run": run, "pctr": pctr}


TRAIN = ["mlp", "train", "--data", "{data}", "--out", "{tmp}/new", "--preset", "debug", "--no-progress"]
RESUME = ["mlp", "train", "--data", "{data}", "--out", "{run}", "--preset", "debug", "--no-progress"]
EVAL = ["mlp", "eval", "--model", "{run}", "--data", "{data}"]

# (id, argv, expected exit code, fragment of stderr)
CASES = [
    ("unknown-flag", [*TRAIN, "--no-such-flag", "1"], 2, "unrecognized arguments: --no-such-flag"),
    (
        "eval-every-word",
        [*TRAIN, "--eval-every", "often"],
        2,
        "argument --eval-every: expected int, got 'often'",
    ),
    (
        "eval-every-neg",
        [*TRAIN, "--eval-every", "-5"],
        2,
        "--eval-every must be a number of steps >= 0 or 'epoch'",
    ),
    ("monitor", [*TRAIN, "--monitor", "banana"], 2, "--monitor 'banana': unknown metric"),
    (
        "monitor-absent",
        [*TRAIN, "--monitor", "wer"],
        2,
        "--monitor wer: the evaluation reports no such metric",
    ),
    ("early-stop", [*TRAIN, "--early-stop", "-1"], 2, "--early-stop must be >= 0"),
    ("init-from", [*TRAIN, "--init-from", "{tmp}/nowhere"], 2, "--init-from"),
    ("init-other-app", [*TRAIN, "--init-from", "{pctr}"], 2, "a pctr model, expected a mlp model"),
    ("momentum-adam", [*TRAIN, "--momentum", "0.5"], 2, "--momentum applies to --optimizer sgd only"),
    ("flag-type", [*TRAIN, "--lr", "fast"], 2, "argument --lr: expected float, got 'fast'"),
    ("flag-choice", [*TRAIN, "--grad-comm", "fp8"], 2, "argument --grad-comm: invalid choice: 'fp8'"),
    ("unknown-preset", [*TRAIN, "--preset", "huge"], 2, "unknown preset 'huge'; choose from: debug, small"),
    ("missing-data", [*TRAIN[:3], "{tmp}/nowhere.libfm", *TRAIN[4:]], 2, "nowhere.libfm: no such file"),
    (
        "toml-optimizer",
        [*TRAIN, "--config", "{tmp}/rmsprop.toml"],
        2,
        "rmsprop.toml: field 'optimizer': expected one of sgd, adam, adamw, got 'rmsprop'",
    ),
    ("toml-amp", [*TRAIN, "--config", "{tmp}/fp8.toml"], 2, "field 'amp': expected one of auto, bf16, off"),
    ("toml-schedule", [*TRAIN, "--config", "{tmp}/schedule.toml"], 2, "field 'schedule': expected one of"),
    ("toml-grad-comm", [*TRAIN, "--config", "{tmp}/gradcomm.toml"], 2, "field 'grad_comm': expected one of"),
    (
        "toml-type",
        [*TRAIN, "--config", "{tmp}/epochs.toml"],
        2,
        "field 'epochs': expected int, got str 'two'",
    ),
    ("toml-preset", [*TRAIN[:-3], "--config", "{tmp}/preset.toml"], 2, "unknown preset 'huge'"),
    ("toml-syntax", [*TRAIN, "--config", "{tmp}/bad.toml"], 2, "bad.toml: not valid TOML"),
    ("config-binary", [*TRAIN, "--config", "{tmp}/x.bin"], 2, "x.bin: not a UTF-8 TOML file"),
    ("config-dir", [*TRAIN, "--config", "{tmp}"], 2, "is a directory, expected a TOML file"),
    ("config-missing", [*TRAIN, "--config", "{tmp}/no.toml"], 2, "no.toml does not exist"),
    ("out-is-file", [*TRAIN[:5], "{tmp}/a-file", *TRAIN[6:]], 2, "a-file: is an existing file"),
    ("out-unwritable", [*TRAIN[:5], "/proc/x", *TRAIN[6:]], 2, "--out /proc/x: cannot create the run"),
    ("lr-negative", [*TRAIN, "--lr", "-1"], 2, "--lr must be a finite number >= 0, got -1.0"),
    ("lr-nan", [*TRAIN, "--lr", "nan"], 2, "--lr must be a finite number >= 0, got nan"),
    ("weight-decay", [*TRAIN, "--weight-decay", "-1"], 2, "--weight-decay must be a finite number >= 0"),
    ("clip-grad", [*TRAIN, "--clip-grad", "-1"], 2, "--clip-grad must be a finite number >= 0"),
    ("batch-size-0", [*TRAIN, "--batch-size", "0"], 2, "--batch-size must be >= 1, got 0"),
    ("val-test-fractions", [*TRAIN, "--test-fraction", "0.95"], 2, "--test-fraction must be in [0, 1)"),
    ("workers-bad-lr", [*TRAIN, "--workers", "2", "--lr", "inf"], 2, "--lr must be a finite number >= 0"),
    (
        "resume-nothing",
        ["mlp", "train", "--data", "{data}", "--out", "{tmp}/new", "--no-progress", "--resume"],
        2,
        "--resume: no checkpoint in",
    ),
    ("retrain-over-run", RESUME, 2, "already holds a trained run; pass --resume"),
    (
        "resume-changed",
        [*RESUME, "--resume", "--batch-size", "16", "--hidden", "8"],
        2,
        "differ from the run's",
    ),
    ("resume-changed-pairs", [*RESUME, "--resume", "--batch-size", "16"], 2, "batch_size: 32 -> 16"),
    ("resume-other-data", [*RESUME[:3], "{tmp}/a-file", *RESUME[4:], "--resume"], 2, "data: '"),
    (
        "batch-larger-than-data",
        [*TRAIN, "--batch-size", "5000"],
        2,
        "one epoch has 0 batches: 480 training samples is less than one global batch",
    ),
    ("eval-other-app", [*EVAL[:3], "{pctr}", *EVAL[4:]], 2, "describes a 'pctr' model, not one of"),
    ("eval-no-model", [*EVAL[:3], "{tmp}", *EVAL[4:]], 2, "no exported model at"),
    ("eval-split-choice", [*EVAL, "--split", "dev"], 2, "argument --split: invalid choice: 'dev'"),
]


def _fill(argv, env):
    return [str(a).format(**env) for a in argv]


@pytest.mark.parametrize("argv,code,fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line(env, argv, code, fragment, capfd):
    p = cli(_fill(argv, env), capfd)
    assert_cli_error(p, fragment, code=code)
    assert "launching" not in p.stderr  # caught before any worker started
    assert "app=None" not in p.stderr
    errors = [ln for ln in p.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1, p.stderr


def test_resume_allows_listed_changes_and_keeps_config(env, tmp_path, monkeypatch, capfd):
    """A run started with relative --data/--out records absolute paths; resuming it with absolute paths and
    a changed --max-steps/--log-every (changes that are allowed) continues it, and config.toml then holds
    the new values of only those fields."""
    run = tmp_path / "run"
    rel = os.path.relpath(env["data"], tmp_path)
    monkeypatch.chdir(tmp_path)  # the command's working directory, as `cd TMP; mariana ...`
    first = cli(
        [*TRAIN[:3], rel, "--out", "run", "--max-steps", "2", "--preset", "debug", "--no-progress"], capfd
    )
    assert first.returncode == 0, first.stderr
    saved = (run / "config.toml").read_text()
    assert f'data = "{env["data"]}"' in saved and f'out = "{run}"' in saved
    base = ["mlp", "train", "--data", env["data"], "--out", run, "--preset", "debug", "--no-progress"]
    p = cli([*base, "--max-steps", "4", "--log-every", "2", "--resume"], capfd, check=True)
    assert p.stdout.strip().splitlines()[-1].startswith("validation AUC")
    assert json.loads((run / "metrics.json").read_text())["steps"] == 4
    saved = (run / "config.toml").read_text()
    assert "max_steps = 4\n" in saved and "log_every = 2\n" in saved and "batch_size = 32\n" in saved


def test_mlp_eval_split_names_what_it_scores(env, capfd):
    """--split test scores the held-out last rows; the line says which rows, the JSON is per data/split."""
    p = cli([*_fill(EVAL, env), "--split", "test"], capfd, check=True)
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("AUC ") and last.endswith("on tiny.libfm (test, 60 rows)"), last
    result = json.loads((env["run"] / "eval" / "tiny-test.json").read_text())
    assert result["rows"] == 60 and result["split"] == "test" and 0 <= result["auc"] <= 1


def test_an_in_process_run_leaves_no_state_behind(env, tmp_path, capfd):
    """What the in-process table relies on (`cliwalk.process_state`): a training run's loggers (``mariana``
    no longer propagating, its console and RUN/logs handlers), environment, working directory, thread count
    and random state are as before it, as they would be after a subprocess."""
    import logging
    import random

    lg = logging.getLogger("mariana")
    before = (lg.handlers[:], lg.propagate, lg.level, dict(os.environ), os.getcwd(), torch.get_num_threads())
    rng = (torch.random.get_rng_state(), random.getstate())
    p = cli(
        [*_fill(TRAIN[:5], env), tmp_path / "r", "--preset", "debug", "--max-steps", "1", "--no-progress"],
        capfd,
    )
    assert p.returncode == 0 and (tmp_path / "r" / "logs" / "rank-0.log").is_file(), p.stderr
    assert (
        lg.handlers,
        lg.propagate,
        lg.level,
        dict(os.environ),
        os.getcwd(),
        torch.get_num_threads(),
    ) == before
    assert torch.equal(torch.random.get_rng_state(), rng[0]) and random.getstate() == rng[1]


def test_refusal_exit_code_as_the_shell_sees_it(env):
    """One table case as a real process (``python -m mariana.platform.cli``): the MarianaError's exit code
    is the process's, and its line is all of stderr."""
    p = run_cli(_fill([*TRAIN, "--lr", "nan"], env), timeout=120)
    assert_cli_error(p, "--lr must be a finite number >= 0, got nan", code=2)
    assert p.stderr.strip().splitlines() == ["mariana: error: --lr must be a finite number >= 0, got nan"]


def test_version():
    """Through the real entry point: argparse's version action exits the process with 0."""
    p = run_cli(["--version"])
    assert p.returncode == 0
    from importlib.metadata import version

    assert p.stdout.strip() == f"mariana {version('mariana')} (torch {version('torch')})"


# --- the console of multi-worker jobs ---------------------------------------------------------------------
NOISE = ("Traceback", "OMP_NUM_THREADS", "[Gloo]", "checkpoint at step", "Warning", "SignalException")


def test_crashing_worker_prints_one_line_cause(env, tmp_path):
    """A worker that raises (a bug, not bad input): its traceback goes to RUN/logs/rank-1.log, the console
    gets one line naming the rank, the exception and the log, and none of torchrun's, gloo's or the
    checkpoints' lines (what the console used to show on every multi-worker run)."""
    run = tmp_path / "run"
    argv = [*_fill(TRAIN[:5], env), run, "--preset", "debug", "--workers", "2", "--max-steps", "6"]
    environ = cli_env({"MARIANA_FAULT": "raise:rank=1:step=3"})
    del environ["OMP_NUM_THREADS"]  # as in a user's shell: torchrun would print its banner about it
    p = subprocess.run(
        [sys.executable, "-m", "mariana.platform.cli", *map(str, argv), "--ckpt-every", "1", "--no-progress"],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert_cli_error(
        p,
        "mariana: error: worker rank 1 failed: ValueError: injected fault before step 3 "
        f"(see {run}/logs/rank-1.log)",
        code=1,
    )
    for noise in NOISE:
        assert noise not in p.stderr, p.stderr
    rank1 = (run / "logs" / "rank-1.log").read_text()
    assert "Traceback" in rank1 and "[Gloo]" in rank1  # what the console no longer shows
    assert "checkpoint at step 2" in (run / "logs" / "rank-0.log").read_text()


def test_ctrl_c_with_workers_is_one_line(env, tmp_path):
    """SIGINT to the launcher's process group (what a terminal's Ctrl-C does) once the workers train."""
    run = tmp_path / "run"
    argv = [*_fill(TRAIN[:5], env), run, "--preset", "debug", "--workers", "2", "--max-steps", "100000"]
    p = subprocess.Popen(
        [sys.executable, "-m", "mariana.platform.cli", *map(str, argv), "--no-progress"],
        cwd=ROOT,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").is_file() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert p.poll() is None, p.communicate()
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130, err
    assert err.strip().splitlines()[-1] == "mariana: interrupted", err
    for noise in NOISE:
        assert noise not in out + err, err


KEEP_ALIVE_PROBE = """
import os, signal, sys, time
from pathlib import Path
from types import SimpleNamespace
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
from mariana.platform.runtime import launch

data, run = sys.argv[1:3]
sent = []
def keep_alive(self):  # Ctrl-C once the worker trains, while this thread holds the agent's rendezvous handler
    if (Path(run) / "metrics.jsonl").exists() and not sent:
        sent.append(1)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(2)
dr.DynamicRendezvousHandler._keep_alive = keep_alive
config = launch.launch_config(1, SimpleNamespace(max_restarts=0))
config.rdzv_configs["keep_alive_interval"] = 1
argv = ["mlp", "train", "--data", data, "--out", run, "--preset", "debug", "--no-progress", "--max-steps", "100000"]
try:
    launch.run_torchrun(config, argv, run)
except KeyboardInterrupt:
    print("interrupted", flush=True)
time.sleep(3)  # the keep-alive call ends meanwhile
"""


def test_ctrl_c_during_the_agents_keep_alive_prints_nothing_more(env, tmp_path):
    """Ctrl-C while torchrun's keep-alive thread holds the rendezvous handler (as when a lost host's store call
    hangs there): the stopped launch stays referenced, so the handler is never freed in that thread, where
    torch's timer finalizer would join the thread from itself ("cannot join current thread" on the console)."""
    argv = [sys.executable, "-c", KEEP_ALIVE_PROBE, str(env["data"]), str(tmp_path / "run")]
    p = subprocess.run(argv, capture_output=True, text=True, env=cli_env(), cwd=ROOT, timeout=120)
    assert p.returncode == 0 and p.stdout.splitlines()[-1] == "interrupted", p.stdout + p.stderr
    assert "cannot join" not in p.stderr and "Traceback" not in p.stderr, p.stderr
