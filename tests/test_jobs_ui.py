"""The job service's web pages in a real browser: a real ``mariana jobs serve`` process, real training jobs
submitted with ``mariana submit``, and the system Chromium driven by Playwright's sync API.

The browser test fails (never skips) when Chromium or Playwright is missing: ``make test`` installs both
(``make browser`` installs the Debian ``chromium`` package; Playwright is pinned in requirements.txt).
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from helpers import DATA, ROOT, cli_env, free_port, last_line, run_cli
from mariana.platform.jobs.client import JobsClient
from mariana.platform.jobs.scheduler import PRUNED
from mariana.platform.jobs.ui import STATIC_DIR, mount_ui

CHROMIUM = "/usr/bin/chromium"
FRAPPE = DATA / "frappe" / "frappe.validation.libfm"


def test_pages_and_static_files_are_served():
    """mount_ui alone: the three pages and every shipped asset, with the plotting module among them."""
    app = FastAPI()
    mount_ui(app)
    client = TestClient(app)
    for path, marker in [("/", "jobs.js"), ("/jobs/7", "job.js"), ("/compare?ids=1,2", "compare.js")]:
        resp = client.get(path)
        assert resp.status_code == 200, path
        assert resp.headers["content-type"].startswith("text/html")
        assert f'src="/static/{marker}"' in resp.text
        assert "http://" not in resp.text and "https://" not in resp.text  # nothing from a CDN
    names = sorted(p.name for p in STATIC_DIR.iterdir())
    assert {"plot.js", "common.js", "style.css", "jobs.html", "job.html", "compare.html"} <= set(names)
    for name in names:
        resp = client.get(f"/static/{name}")
        assert resp.status_code == 200, name
        assert resp.headers["cache-control"] == "no-cache"
    assert client.get("/static/../ui.py").status_code == 404
    assert client.get("/jobs/not-a-number").status_code == 422
    assert "/compare" not in client.get("/openapi.json").json()["paths"]


def _get_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def _wait_for(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except OSError as e:  # service not up yet
            last = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


_TOKENS: dict[str, str] = {}  # service URL -> its token, for the clean-up's cancel requests


@contextlib.contextmanager
def _service(tmp_path: Path, *flags: str, env: dict[str, str] | None = None):
    """A real ``mariana jobs serve`` on a free port with home ``tmp_path/home`` (``env``: added to the
    environment of the service and so of its jobs); yields its URL. On exit every job still queued or
    running is cancelled and the service is stopped."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = ["jobs", "serve", "--home", str(tmp_path / "home"), "--port", str(port), *flags]
    with open(tmp_path / "service.log", "w") as log:
        service = subprocess.Popen(
            [sys.executable, "-m", "mariana.platform.cli", *argv],
            cwd=ROOT,
            env=cli_env(env),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_for(lambda: service.poll() is not None or _get_json(f"{url}/api/jobs"), 60, "the service")
            assert service.poll() is None, (tmp_path / "service.log").read_text()
            yield url
        finally:
            if service.poll() is None:
                token = _TOKENS.get(url)
                try:
                    for job in _get_json(f"{url}/api/jobs")["jobs"]:
                        if job["state"] in ("queued", "running"):
                            req = urllib.request.Request(f"{url}/api/jobs/{job['id']}/cancel", method="POST")
                            if token:
                                req.add_header("Authorization", f"Bearer {token}")
                            urllib.request.urlopen(req, timeout=10).close()
                except OSError:
                    pass
            service.terminate()
            try:
                service.wait(timeout=30)
            except subprocess.TimeoutExpired:
                service.kill()
                service.wait()


def _browser(p):
    return p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])


def _watched_page(browser, errors: list[str]):
    """A new 1300x1000 page whose JavaScript errors and console errors are appended to ``errors``."""
    page = browser.new_page(viewport={"width": 1300, "height": 1000})
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
    return page


def _require_browser():
    """Playwright's sync API; fails (never skips) when Playwright or the system Chromium is missing."""
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: run `make install` (it is pinned in requirements.txt)")
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run `make browser` (apt-get install -y chromium)")
    return expect, sync_playwright


def _submit(url: str, argv: list[str]) -> int:
    proc = run_cli(["submit", *argv], timeout=60, env={"MARIANA_JOBS_URL": url}, check=True)
    return int(last_line(proc.stdout))


def _points(page, selector: str) -> int:
    return int(page.eval_on_selector(selector, "svg => svg.getAttribute('data-points')") or 0)


def _assert_plots_fill_and_labels_fit(page) -> None:
    """Every plot on the page spans >= 90 % of its container's width and no text of it (tick labels, axis
    labels, legend) reaches past its SVG's edges (a clipped last x tick read "3,00C")."""
    # plus a probe plot of the page's own plot module whose x axis ends at 3,000 (a 5-character last tick)
    page.evaluate(
        """() => {
            const box = document.createElement('div');
            box.className = 'plot-box';
            box.id = 'probe';
            document.querySelector('.plots').appendChild(box);
            new LinePlot(box, {title: 'probe', yLabel: 'y'}).setSeries([{name: 'p', points: [[0, 1], [3000, 2]]}]);
        }"""
    )
    report = page.evaluate(
        """() => [...document.querySelectorAll('.plot-box')].map((box) => {
            const svg = box.querySelector('svg');
            const W = svg.getBoundingClientRect().width;
            const out = [...svg.querySelectorAll('text')].filter((t) => {
                const b = t.getBBox();
                const m = t.getCTM ? t.transform.baseVal.consolidate() : null;
                if (m) return false;  // the rotated y label: placed by its transform
                return b.x < 0 || b.x + b.width > W + 0.5;
            }).map((t) => t.textContent);
            return {id: box.id, ratio: W / box.parentElement.clientWidth, clipped: out};
        })"""
    )
    page.evaluate("() => document.getElementById('probe').remove()")
    assert len(report) >= 2, report
    for r in report:
        assert r["ratio"] >= 0.9, r
        assert not r["clipped"], r


@pytest.mark.slow
@pytest.mark.browser
def test_jobs_pages_in_a_real_browser(tmp_path: Path):
    expect, sync_playwright = _require_browser()
    shots = tmp_path / "screenshots"
    shots.mkdir()
    with _service(tmp_path, "--slots", "5", env=PS_FAULT) as url:
        common = ["--data", FRAPPE, "--preset", "debug", "--log-every", "5"]
        ps_job = _submit(url, PS_JOB)  # 3 slots, runs beside the others; its page is checked at the end
        # A short run that finishes, and a long one watched while it trains (cancelled at the end).
        short = _submit(url, ["pctr", "train", *common, "--max-steps", "60", "--eval-every", "20"])
        slow = _submit(url, ["pctr", "train", *common, "--max-steps", "20000", "--eval-every", "20"])
        twin = _submit(url, ["pctr", "train", *common, "--max-steps", "60", "--eval-every", "20"])  # = short

        errors: list[str] = []
        with sync_playwright() as p:
            browser = _browser(p)
            page = _watched_page(browser, errors)

            # Jobs page: both rows with their state; the long job turns "running" live, without a reload.
            page.goto(f"{url}/")
            for job_id in (short, slow):
                expect(page.locator(f'tr[data-job-id="{job_id}"]')).to_be_visible(timeout=15_000)
            row = page.locator(f'tr[data-job-id="{slow}"]')
            expect(row).to_have_attribute("data-state", "running", timeout=90_000)
            expect(row.locator(".state")).to_have_text("running")
            expect(row.locator("a", has_text=str(slow)).first).to_have_attribute("href", f"/jobs/{slow}")
            expect(row.locator("button.cancel")).to_be_visible()
            page.screenshot(path=shots / "jobs.png", full_page=True)

            # Job page while it trains: the loss plot has drawn points, and a new point arrives.
            page.goto(f"{url}/jobs/{slow}")
            expect(page.locator("#state .state")).to_have_text("running", timeout=15_000)
            page.wait_for_function(
                "Number(document.querySelector('#plot-loss svg').getAttribute('data-points')) > 0",
                timeout=90_000,
            )
            before = _points(page, "#plot-loss svg")
            page.wait_for_function(
                f"Number(document.querySelector('#plot-loss svg').getAttribute('data-points')) > {before}",
                timeout=60_000,
            )
            after = _points(page, "#plot-loss svg")
            assert after > before > 0
            assert _points(page, "#plot-throughput svg") > 0
            # throughput: the raw samples/s faint, its EMA over it (as many points)
            thr = page.locator("#plot-throughput svg")
            expect(thr.locator('path.faint[data-series="samples/s raw"]')).to_have_count(1)
            ema = thr.locator('path[data-series="samples/s (EMA 0.2)"]')
            assert ema.get_attribute("data-points") == thr.locator("path.faint").get_attribute("data-points")
            # a running job's best model so far (exported at an evaluation) is shown, not "no model yet"
            expect(page.locator("#model-link")).to_be_visible(timeout=60_000)
            _assert_plots_fill_and_labels_fit(page)
            expect(page.locator("#argv")).to_contain_text("--max-steps 20000")
            expect(page.locator("#log")).not_to_be_empty(timeout=30_000)
            page.screenshot(path=shots / "job.png", full_page=True)
            # The same records against wall time: every point is kept, the axis is relabelled.
            page.check("input[name=xaxis][value=time]")
            expect(page.locator("#plot-loss .plot-xlabel")).to_have_text("wall time (s)")
            assert _points(page, "#plot-loss svg") >= after

            # Compare page: once the short job finished, both runs' loss curves overlaid with a legend.
            _wait_for(
                lambda: _get_json(f"{url}/api/jobs/{short}")["state"] in ("succeeded", "failed"),
                120,
                "the short job to end",
            )
            assert _get_json(f"{url}/api/jobs/{short}")["state"] == "succeeded"
            _wait_for(
                lambda: _get_json(f"{url}/api/jobs/{twin}")["state"] == "succeeded", 120, "the twin job"
            )
            page.goto(f"{url}/")
            for job_id in (short, slow, twin):
                page.locator(f'tr[data-job-id="{job_id}"] input.pick').check()
            page.click("#compare-selected")
            page.wait_for_url(re.compile(r"/compare\?ids=\d+,\d+,\d+$"))
            order = [int(x) for x in page.url.split("ids=")[1].split(",")]
            assert sorted(order) == sorted((short, slow, twin)), page.url
            first, later = sorted((short, twin), key=order.index)
            loss = page.locator("#plot-loss svg")
            for job_id in (short, slow, twin):
                expect(loss.locator(f'path[data-series^="#{job_id}"]')).to_have_count(1, timeout=30_000)
                legend = re.compile(rf"^#{job_id}\b")
                expect(loss.locator(".plot-legend-text", has_text=legend)).to_have_count(1)
            counts = json.loads(loss.get_attribute("data-series-points"))
            assert len(counts) == 3 and all(n > 0 for n in counts.values()), counts
            # identical runs do not hide each other: the later one is dashed and named after its twin
            same = loss.locator(f'path[data-series="#{later} (= #{first})"]')
            expect(same).to_have_attribute("stroke-dasharray", "6 4")
            page.screenshot(path=shots / "compare.png", full_page=True)
            _assert_plots_fill_and_labels_fit(page)

            # The finished job's page: its validation curve, the exported model and "serve this model".
            page.goto(f"{url}/jobs/{short}")
            expect(page.locator("#state .state")).to_have_text("succeeded", timeout=15_000)
            page.wait_for_function(
                "Number(document.querySelector('#plot-eval_auc svg')?.getAttribute('data-points')) >= 2",
                timeout=30_000,
            )
            expect(page.locator("#model-link")).to_have_attribute(
                "href", f"/api/jobs/{short}/files/model.safetensors"
            )
            page.click("#serve")
            expect(page.locator("#served-url")).to_contain_text("http://127.0.0.1:", timeout=30_000)
            served = page.locator("#served-url").get_attribute("href")
            _wait_for(lambda: _get_json(f"{served}/healthz")["status"] == "ok", 60, "the model server")
            page.screenshot(path=shots / "job-finished.png", full_page=True)
            # ... and its stop control: the server is gone (no zombie left behind), the page says so
            page.click("#serve-stop")
            expect(page.locator("#serve-url")).to_have_text("server stopped", timeout=30_000)
            expect(page.locator("#serve-stop")).to_be_hidden()
            assert _get_json(f"{url}/api/jobs/{short}")["served"] is None
            with pytest.raises(OSError):
                _get_json(f"{served}/healthz", timeout=2)

            # A tuning trial stopped by the tuner's pruner (its very call) is "pruned" with no Retry.
            trial = _submit(url, ["pctr", "train", *common, "--max-steps", "20000"])
            JobsClient(url).cancel(trial, reason=f"{PRUNED} at step 20")
            # Cancel the long job from the jobs page.
            page.goto(f"{url}/")
            row = page.locator(f'tr[data-job-id="{slow}"]')
            row.locator("button.cancel").click()
            expect(row).to_have_attribute("data-state", "cancelled", timeout=60_000)
            expect(row.locator(".state")).to_have_text("cancelled")
            expect(row.locator("button.retry")).to_be_visible()
            pruned = page.locator(f'tr[data-job-id="{trial}"]')
            expect(pruned).to_have_attribute("data-state", "cancelled", timeout=60_000)
            expect(pruned.locator(".state")).to_have_text("pruned")
            expect(pruned.locator("button.retry")).to_be_hidden()
            page.screenshot(path=shots / "jobs-after-cancel.png", full_page=True)

            _check_ps_job_page(page, expect, url, ps_job)

            # A job that does not exist: one clear message, no empty cards (its 404 is expected: own page)
            missing = browser.new_page(viewport={"width": 1300, "height": 1000})
            missing.goto(f"{url}/jobs/999")
            expect(missing.locator("#status")).to_contain_text("job 999 does not exist", timeout=15_000)
            expect(missing.locator("#job-body")).to_be_hidden()
            expect(missing.locator("#title")).to_have_text("Job 999 not found")
            browser.close()
        assert not errors, errors
        for name in ("jobs.png", "job.png", "compare.png"):
            assert (shots / name).stat().st_size > 10_000, name


@pytest.mark.slow
@pytest.mark.browser
def test_token_field_authorizes_cancel(tmp_path: Path):
    """With --token-file, the jobs page's cancel is refused (401, shown) until the header's token is set."""
    expect, sync_playwright = _require_browser()
    token = "s3cret-ui-token"
    (tmp_path / "token").write_text(token + "\n")
    with _service(tmp_path, "--slots", "1", "--token-file", str(tmp_path / "token")) as url:
        _TOKENS[url] = token
        proc = run_cli(
            ["submit", "pctr", "train", "--data", FRAPPE, "--preset", "debug", "--max-steps", "20000"],
            timeout=60,
            env={"MARIANA_JOBS_URL": url, "MARIANA_JOBS_TOKEN": token},
            check=True,
        )
        job_id = int(last_line(proc.stdout))
        with sync_playwright() as p:
            browser = _browser(p)
            page = browser.new_page(viewport={"width": 1300, "height": 700})
            page.goto(f"{url}/")
            row = page.locator(f'tr[data-job-id="{job_id}"]')
            expect(row.locator("button.cancel")).to_be_visible(timeout=15_000)
            row.locator("button.cancel").click()
            expect(page.locator("#status")).to_contain_text("401", timeout=10_000)
            assert _get_json(f"{url}/api/jobs/{job_id}")["state"] in ("queued", "running")
            page.fill("#token", token)
            page.locator("#token").dispatch_event("change")
            assert page.evaluate("localStorage.getItem('mariana.token')") == token
            row.locator("button.cancel").click()
            expect(row).to_have_attribute("data-state", "cancelled", timeout=60_000)
            page.screenshot(path=tmp_path / "jobs-token.png")
            browser.close()


def _path_xs(page, selector: str) -> list[float]:
    """The x pixel of every vertex of the SVG path ``selector`` (its ``d``: ``Mx,yLx,y...``)."""
    d = page.get_attribute(selector, "d")
    return [float(v.split(",")[0]) for v in re.split("[ML]", d) if v]


# A parameter-server job (1 server, 2 workers) whose worker 0 is killed before step 16 (first attempt only)
# and restarted by torchrun from the step-10 checkpoint. The fault names a PS worker: other jobs never match.
PS_JOB = ["pctr", "train", "--data", FRAPPE, "--preset", "debug", "--servers", "1", "--workers", "2",
          "--max-steps", "30", "--eval-every", "10", "--log-every", "2", "--ckpt-every", "10"]  # fmt: skip
PS_FAULT = {"MARIANA_FAULT": "kill:worker=0:step=16"}


def _last_attempt(rows: list[dict], field: str) -> list[tuple]:
    """(step, value) of the rows with a numeric `field`, keeping a restarted attempt's points over the
    earlier attempt's from the step it went back to (what the page draws: common.js lastAttempt)."""
    out: list[tuple] = []
    for r in rows:
        if isinstance(r.get(field), float) and isinstance(r.get("step"), int):
            while out and out[-1][0] >= r["step"]:
                out.pop()
            out.append((r["step"], r[field]))
    return out


def _drawn_validation_series(records, history, field: str, worker_field: str) -> dict[str, int]:
    """Series name -> point count of one validation chart, by the page's stated rule: the records' field,
    then each worker's counters field in source order, leaving out a series whose (step, value) points
    repeat one already drawn (worker 0 of a PS job repeats eval_X; worker 1 does when both scored the
    same server-held model)."""
    candidates = [(field, _last_attempt(records, field))]
    for src in sorted({h["source"] for h in history if isinstance(h.get(worker_field), float)}):
        rows = [h for h in history if h["source"] == src]
        candidates.append((f"{worker_field} ({src})", _last_attempt(rows, worker_field)))
    drawn: dict[str, int] = {}
    seen: list[list[tuple]] = []
    for name, points in candidates:
        if points and points not in seen:
            seen.append(points)
            drawn[name] = len(points)
    return drawn


def _check_ps_job_page(page, expect, url: str, job: int) -> None:
    """The PS_JOB's page once it ended (one page load): each validation metric has one chart (the job's
    eval_auc, and worker 1's own val_auc in it; not a second chart of the workers' val_auc, nor worker 0's
    val_auc repeating eval_auc), drawn in step and in wall-time mode (counters records carry no time of
    their own); every curve has each step once, left to right (no doubling back after the restart)."""
    _wait_for(
        lambda: _get_json(f"{url}/api/jobs/{job}")["state"] in ("succeeded", "failed"), 240, "the PS job"
    )
    assert _get_json(f"{url}/api/jobs/{job}")["state"] == "succeeded"
    history = _get_json(f"{url}/api/jobs/{job}/counters")["history"]
    assert any(h.get("attempt") == 1 for h in history)  # the workers were restarted
    page.goto(f"{url}/jobs/{job}")
    expect(page.locator("#state .state")).to_have_text("succeeded", timeout=15_000)
    page.wait_for_function(
        "Number(document.querySelector('#plot-eval_auc svg')?.getAttribute('data-points')) >= 3",
        timeout=30_000,
    )
    # the metrics records are drawn before the same round's counters arrive: wait for the round after the
    # job ended (the page's last), else the workers' curves may not be there yet
    page.wait_for_function("state.finalRoundDone === true", timeout=30_000)
    charts = page.eval_on_selector_all("#plots-val .plot-box", "bs => bs.map(b => b.dataset.field)")
    assert sorted(charts) == ["eval_auc", "eval_logloss"], charts
    # what each curve must show: every step of its records once (the service keeps both attempts' records;
    # which ones a killed process wrote before dying varies from run to run)
    records = _get_json(f"{url}/api/jobs/{job}/metrics")["records"]

    def steps(rows, field):
        return len({r["step"] for r in rows if isinstance(r.get(field), float)})

    w1 = [h for h in history if h["source"] == "worker-1"]
    want = {
        "loss": {"loss": steps(records, "loss")},
        "eval_auc": _drawn_validation_series(records, history, "eval_auc", "val_auc"),
    }
    assert want["loss"]["loss"] >= 14 and want["eval_auc"]["eval_auc"] == 3, records
    assert "val_auc (worker-0)" not in want["eval_auc"], history  # worker 0 scores what eval_auc records
    assert steps(w1, "val_auc") >= 2, w1  # the restarted attempt evaluates at 20, 30
    for mode in ("step", "time"):
        page.check(f"input[name=xaxis][value={mode}]")
        for chart, series in want.items():
            svg = f"#plot-{chart} svg"
            names = page.eval_on_selector_all(f"{svg} path.plot-line", "ps => ps.map(p => p.dataset.series)")
            assert sorted(names) == sorted(series), (mode, chart, names)
            for name, n in series.items():
                xs = _path_xs(page, f'{svg} path[data-series="{name}"]')
                assert len(xs) == n and all(a < b for a, b in zip(xs, xs[1:])), (mode, name, xs, n)
