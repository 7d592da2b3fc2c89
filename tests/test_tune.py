"""`mariana tune`: real tuners running real `mariana pctr train` trials (local processes, or jobs of a real
`mariana jobs serve`) on a 6000-line slice of the Frappe sample, Optuna studies in SQLite files.

A tuner that runs trials is a process of its own, forked from the test zygote (`helpers.run_cli`,
`helpers.start_cli`): its trials' fork server is then a fork of it, where a tuner in this process (threads:
not safe to fork) would start a fresh interpreter for it. Refused command lines and retraining run in this
process (`jobs_helpers.run_in_process`, with a CLI process's environment).

The space makes pruning deterministic: half of the configurations train the embedding table at a learning
rate of 1e-6 (AUC stays near its initial value), the others at 0.1, with an eval record every 3 steps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from unittest import mock

import pytest
from helpers import DATA, ROOT, assert_cli_error, cli_env, last_line, run_cli, start_cli
from jobs_helpers import run_in_process
from mariana.platform.core.config import read_config_values

FRAPPE = DATA / "frappe" / "frappe.validation.libfm"

SPACE = """
[params.sparse_lr]
type = "categorical"
choices = [0.1, 1e-6]

[params.lr]
type = "float"
low = 1e-3
high = 1e-2
log = true

[params.dropout]
type = "float"
low = 0.0
high = 0.3

[fixed]
max_steps = 30
eval_every = 3
"""


@pytest.fixture()
def frappe_slice(tmp_path: Path) -> Path:
    path = tmp_path / "frappe.libfm"
    with open(FRAPPE) as src, open(path, "w") as dst:
        for i, line in enumerate(src):
            if i == 6000:
                break
            dst.write(line)
    return path


def _space(tmp_path: Path, text: str = SPACE) -> Path:
    path = tmp_path / "space.toml"
    path.write_text(text)
    return path


def _tune_args(space: Path, out: Path, data: Path, trials: int, *extra: str) -> list[str]:
    return ["tune", "pctr", "--space", space, "--trials", str(trials), "--parallel", "2", "--out", out,
            *extra, "--preset", "debug", "--data", data]  # fmt: skip


def _study(out: Path):
    import optuna

    meta = json.loads((out / "study.json").read_text())
    return optuna.load_study(study_name=meta["name"], storage=meta["storage"])


@pytest.mark.slow
def test_study_prunes_and_best_toml_reproduces(tmp_path: Path, frappe_slice: Path, capsys):
    from optuna.trial import TrialState

    out = tmp_path / "tune"
    proc = run_cli(_tune_args(_space(tmp_path), out, frappe_slice, 8, "--local"), check=True)
    head = last_line(proc.stdout)
    assert head.startswith("best trial ") and "pruned" in head, proc.stdout

    trials = _study(out).get_trials()
    states = [t.state for t in trials]
    assert len(trials) == 8
    assert states.count(TrialState.PRUNED) >= 1, proc.stdout
    assert states.count(TrialState.COMPLETE) >= 2, proc.stdout
    for t in trials:
        if t.state == TrialState.PRUNED:  # only the bad learning rate is pruned
            assert t.params["sparse_lr"] == 1e-6, t
    best = max((t for t in trials if t.state == TrialState.COMPLETE), key=lambda t: t.value)
    assert best.params["sparse_lr"] == 0.1
    assert f"best trial {best.number}: auc {best.value:.4f}" in head
    for line in proc.stdout.splitlines():  # the table lists every trial with its state
        if line.strip().startswith(tuple(f"{t.number} " for t in trials)):
            assert any(s in line for s in ("complete", "pruned", "fail")), line

    results = json.loads((out / "results.json").read_text())
    assert results["best"]["number"] == best.number and len(results["trials"]) == 8

    # best.toml: every tuned and fixed field, nothing naming the run or the data.
    cfg = read_config_values(out / "best.toml")  # by sections
    assert "[optim]" in (out / "best.toml").read_text()
    assert cfg["sparse_lr"] == best.params["sparse_lr"] and cfg["lr"] == best.params["lr"]
    assert cfg["max_steps"] == 30 and cfg["eval_every"] == 3 and cfg["dim"] == 4  # fixed + preset values
    assert not {"data", "out", "config", "preset", "resume"} & set(cfg)
    assert (out / "best" / "model.safetensors").is_file() and (out / "best" / "model.json").is_file()
    assert not (out / "best" / "checkpoints").exists()

    # Retraining from best.toml (same seed) reproduces the best trial's metric.
    rerun = tmp_path / "rerun"
    again = run_in_process(["pctr", "train", "--config", out / "best.toml", "--data", frappe_slice, "--out",
                            rerun], capsys, check=True)  # fmt: skip
    assert "validation AUC" in last_line(again.stdout)
    value = json.loads((rerun / "metrics.json").read_text())["val_auc"]
    assert abs(value - best.value) < 2e-3, (value, best.value)

    # TUNE_DIR/best is a run directory the eval command takes.
    ev = run_in_process(["pctr", "eval", "--model", out / "best", "--data", frappe_slice, "--split", "val"],
                        capsys, check=True)  # fmt: skip
    assert abs(float(last_line(ev.stdout).split()[1]) - best.value) < 2e-3, ev.stdout


@pytest.mark.slow
def test_killed_tuner_resumes_without_losing_or_repeating_trials(tmp_path: Path, frappe_slice: Path):
    from optuna.trial import TrialState

    out = tmp_path / "tune"
    # Longer trials than the other tests', so that the kill surely finds some in flight.
    space = _space(tmp_path, SPACE.replace("max_steps = 30", "max_steps = 150"))
    args = _tune_args(space, out, frappe_slice, 4, "--local", "--pruner", "none")
    log = tmp_path / "tuner1.log"
    log.write_text("")
    tuner = start_cli(args, log)
    try:
        # Kill it once two trials finished and the third is training (its metrics are being written).
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            done = [ln for ln in log.read_text().splitlines() if ln.startswith("trial ") and ": auc" in ln]
            if len(done) >= 2 and (out / "trials" / "trial-0002" / "metrics.jsonl").is_file():
                break
            assert tuner.poll() is None, log.read_text()
            time.sleep(0.2)
        else:
            raise AssertionError(f"no trial in flight in time:\n{log.read_text()}")
    finally:
        tuner.send_signal(signal.SIGKILL)
        tuner.wait()
    before = {t.number: t for t in _study(out).get_trials()}
    complete_before = {n: t.value for n, t in before.items() if t.state == TrialState.COMPLETE}
    running = [t for t in before.values() if t.state == TrialState.RUNNING]
    assert len(complete_before) >= 2 and running, before
    orphans = [t.user_attrs["handle"]["pid"] for t in running if "handle" in t.user_attrs]

    proc = run_cli(args, check=True)  # the second tuner
    assert "re-queued" in proc.stdout.splitlines()[0], proc.stdout
    for pid in orphans:  # what the killed tuner left running was stopped, not left to compete for the CPU
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]

    after = _study(out).get_trials()
    counted = [t for t in after if t.state == TrialState.COMPLETE]
    interrupted = [t for t in after if t.state == TrialState.FAIL and t.user_attrs.get("interrupted")]
    assert len(counted) == 4 and len(after) == 4 + len(interrupted), [(t.number, t.state) for t in after]
    assert {t.number for t in interrupted} == {t.number for t in running}
    for n, v in complete_before.items():  # completed trials are kept as they were
        assert after[n].state == TrialState.COMPLETE and after[n].value == v
    for t in interrupted:  # each interrupted configuration is run again exactly once (where one was drawn)
        again = [u for u in counted if u.user_attrs.get("requeued_from") == t.number]
        assert len(again) == ("params" in t.user_attrs), t  # killed mid-draw: see the next test
        assert all(u.params == t.params for u in again)
    params = [tuple(sorted(t.params.items())) for t in counted]
    assert len(set(params)) == len(params)  # no configuration evaluated twice
    best = max(t.value for t in counted)
    assert json.loads((out / "results.json").read_text())["best"]["value"] == best
    assert f"auc {best:.4f}" in last_line(proc.stdout)


def test_a_trial_killed_while_its_parameters_were_drawn_is_not_requeued_half_drawn(tmp_path: Path):
    """The tuner draws a trial's parameters one by one into the study; a kill between two draws leaves a
    RUNNING trial with part of them and no run. Re-queueing that part would hand the next trial a fresh
    draw of the rest: it is failed as interrupted (not counted) and not re-queued; a drawn one is."""
    import optuna
    from mariana.platform.tune.study import requeue_interrupted

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}", direction="maximize")
    half, whole = study.ask(), study.ask()
    half.suggest_float("lr", 1e-3, 1e-2, log=True)  # killed before dropout was drawn
    whole.suggest_float("lr", 1e-3, 1e-2, log=True), whole.suggest_float("dropout", 0.0, 0.3)
    whole.set_user_attr("params", whole.params)  # what the tuner records once all are drawn (`_launch`)
    assert requeue_interrupted(study, runner=None) == 1
    trials = study.get_trials()
    assert [t.user_attrs.get("interrupted") for t in trials[:2]] == [True, True]
    assert "not re-queued" in trials[0].user_attrs["error"] and "; re-queued" in trials[1].user_attrs["error"]
    assert len(trials) == 3 and trials[2].user_attrs["requeued_from"] == whole.number
    again = study.ask()  # the re-queued trial: the whole draw, nothing new
    assert {"lr": again.suggest_float("lr", 1e-3, 1e-2, log=True),
            "dropout": again.suggest_float("dropout", 0.0, 0.3)} == whole.params  # fmt: skip


def test_bad_space_files_are_one_line_errors(tmp_path: Path, frappe_slice: Path, capsys):
    out = tmp_path / "tune"
    cases = [
        (SPACE.replace("[params.dropout]", "[params.bogus_rate]"), "params.bogus_rate", "--bogus-rate"),
        (SPACE.replace("low = 1e-3\nhigh = 1e-2", "low = 0.1\nhigh = 0.01"), "params.lr", "low (0.1)"),
        (SPACE.replace("eval_every = 3", "evaluate_every = 3"), "fixed.evaluate_every", "unknown"),
        (SPACE.replace('type = "categorical"', 'type = "choice"'), "params.sparse_lr", "'type'"),
        (
            SPACE.replace("low = 0.0\nhigh = 0.3", "low = 0.0\nhigh = 0.3\nlog = true"),
            "params.dropout",
            "low > 0",
        ),
    ]
    for i, (text, key, what) in enumerate(cases):
        space = tmp_path / f"space{i}.toml"
        space.write_text(text)
        proc = run_in_process(_tune_args(space, out, frappe_slice, 2, "--local"), capsys)
        assert_cli_error(proc, f"{space}: {key}", what)
    # a real process: the exit code and the one line as a shell sees them
    proc = run_cli(_tune_args(_space(tmp_path), out, frappe_slice, 2, "--local", "--no-such-flag", "1"))
    assert_cli_error(proc, "--no-such-flag")
    assert not out.exists()  # nothing was started


@pytest.mark.slow
@pytest.mark.browser
def test_study_page_in_a_real_browser(tmp_path: Path, frappe_slice: Path, capsys):
    """Trials as jobs of a real service; the study page in Chromium: trials sortable by the metric, the
    metric per trial over steps, parameter importances, the nav link."""
    from optuna.trial import TrialState
    from test_jobs_ui import _browser, _require_browser, _service, _watched_page

    expect, sync_playwright = _require_browser()
    with _service(tmp_path, "--slots", "2") as url:
        out = tmp_path / "tune"
        proc = run_in_process(
            _tune_args(_space(tmp_path), out, frappe_slice, 4, "--url", url), capsys, check=True
        )
        assert f"as jobs of {url}" in proc.stdout
        study = _study(out)
        jobs = json.loads(subprocess.check_output(["curl", "-s", f"{url}/api/jobs"]))["jobs"]
        assert {j["name"] for j in jobs} == {f"tune trial {n}" for n in range(4)}
        # The study lives in the service's own database.
        assert (
            json.loads((out / "study.json").read_text())["storage"]
            == f"sqlite:///{tmp_path / 'home' / 'jobs.db'}"
        )
        complete = sorted((t.value, t.number) for t in study.get_trials() if t.value is not None)

        errors: list[str] = []
        with sync_playwright() as p:
            browser = _browser(p)
            page = _watched_page(browser, errors)
            page.goto(f"{url}/")
            page.click("#nav a[href='/studies']")
            row = page.locator('tr[data-study="tune"]')
            expect(row).to_be_visible(timeout=15_000)
            row.locator("a").click()
            page.wait_for_url(f"{url}/studies/tune")
            expect(page.locator("#trials tbody tr")).to_have_count(4, timeout=15_000)
            # Sort by the metric: the best trial first, then the order reverses.
            page.click('#trials th[data-sort="value"]')
            first = page.locator("#trials tbody tr").first
            expect(first).to_have_attribute("data-trial", str(complete[-1][1]))
            page.click('#trials th[data-sort="value"]')
            expect(page.locator("#trials tbody tr").first).to_have_attribute(
                "data-trial", str(complete[0][1])
            )
            # Trials link to their jobs; the curves plot has every reported point.
            assert page.locator("#trials tbody tr a[href^='/jobs/']").count() == 4
            n_points = sum(len(t.intermediate_values) for t in study.get_trials())
            page.wait_for_function(
                f"Number(document.querySelector('#plot-curves svg').getAttribute('data-points')) === {n_points}",
                timeout=15_000,
            )
            expect(page.locator("#importance tr[data-param]")).to_have_count(3, timeout=15_000)
            # the by-trial chart: whole trial numbers on its x axis, pruned trials at their last value
            xticks = page.eval_on_selector_all(
                "#plot-history .plot-xtick", "ts => ts.map((t) => t.textContent)"
            )
            assert xticks and all(t.isdigit() for t in xticks), xticks
            counts = json.loads(page.locator("#plot-history svg").get_attribute("data-series-points"))
            pruned = [t for t in study.get_trials() if t.state == TrialState.PRUNED and t.intermediate_values]
            assert counts["pruned (last value)"] == len(pruned), (counts, len(pruned))
            assert counts["trial value"] == sum(t.state == TrialState.COMPLETE for t in study.get_trials())
            page.screenshot(path=tmp_path / "study.png", full_page=True)
            browser.close()
        assert not errors, errors


@pytest.mark.slow
def test_crashing_trials_are_failed_with_their_error_and_the_study_goes_on(
    tmp_path: Path, frappe_slice: Path
):
    """hidden = "0" makes `pctr train` refuse its flags (exit 2); with seed 0 trials 0 and 2 draw it."""
    space = _space(
        tmp_path, '[params.hidden]\ntype = "categorical"\nchoices = ["16", "0"]\n[fixed]\nmax_steps = 5\n'
    )
    out = tmp_path / "tune"
    proc = run_cli(_tune_args(space, out, frappe_slice, 3, "--local", "--seed", "0"), check=True)
    rows = {r["number"]: r for r in json.loads((out / "results.json").read_text())["trials"]}
    assert [rows[n]["state"] for n in range(3)] == ["fail", "complete", "fail"], proc.stdout
    for n in (0, 2):
        assert rows[n]["error"].startswith("--hidden") and "'0'" in rows[n]["error"], rows[n]  # its own line
        assert f"trial {n}: failed: --hidden" in proc.stdout
    assert last_line(proc.stdout).startswith("best trial 1: auc ") and "2 failed" in last_line(proc.stdout)


def test_local_trials_are_children_of_the_tuners_fork_server(tmp_path: Path, frappe_slice: Path):
    """A local trial is forked from the server the tuner starts (torch and the app imported once for all
    trials), leads a session of its own, writes its log, reports its exit, and a cancel stops it."""
    from multiprocessing import forkserver

    from mariana.platform.runtime.launch import fork_server, proc_stat
    from mariana.platform.tune.runners import LocalRunner

    runner = LocalRunner(threads=1)
    train = ["mlp", "train", "--data", str(frappe_slice), *"--preset debug --max-steps 10000000".split()]
    with (
        mock.patch.dict(os.environ, cli_env()),
        fork_server(tmp_path / "server.log", ("mariana.apps.mlp.train",)),
    ):
        version = runner.start(["--version"], tmp_path / "version", "trial 0")
        deadline = time.monotonic() + 60
        while (status := runner.poll(version)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status == (True, "")
        assert (tmp_path / "version" / "trial.log").read_text().startswith("mariana ")
        long = runner.start([*train, "--out", str(tmp_path / "long")], tmp_path / "long", "trial 1")
        try:
            server = forkserver._forkserver._forkserver_pid
            assert proc_stat(long["pid"])[1] == server  # its parent: the server
            while os.getpgid(long["pid"]) != long["pid"] and time.monotonic() < deadline:
                time.sleep(0.05)  # the child calls setsid first thing
            assert os.getpgid(long["pid"]) == long["pid"]  # a cancel reaches its whole group
            assert runner.poll(long) is None
        finally:  # the server waits for its children before it ends
            runner.cancel(long)
            runner.wait_cancelled(long)
    assert not Path(f"/proc/{long['pid']}").exists()


@pytest.mark.parametrize("space", sorted((ROOT / "apps").glob("*/spaces/*.toml")), ids=lambda p: p.stem)
def test_shipped_spaces_name_only_flags_their_app_has(space: Path):
    """Each shipped space loads against its app's train config, and its fixed values plus a random sample
    of every parameter, turned into train flags as a trial gets them, parse and validate."""
    import argparse

    import optuna
    from mariana.platform.core.config import add_config_args, applicable_values, resolve_config
    from mariana.platform.tune.apps import app_info
    from mariana.platform.tune.space import flag_args, load_space

    info = app_info(space.parent.parent.name)
    cls = info.config_cls()
    loaded = load_space(space, cls)
    parser = argparse.ArgumentParser()
    add_config_args(parser, cls)
    for seed in range(3):
        trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed)).ask()
        values = {**loaded.fixed, **{n: p.suggest(trial) for n, p in loaded.params.items()}}
        values = applicable_values(cls, values)  # what a trial is given (e.g. no --hidden with --model fm)
        cfg = resolve_config(cls, parser.parse_args(flag_args(values)), info.presets())
        assert flag_args({n: getattr(cfg, n) for n in values}) == flag_args(values)  # every value arrived
