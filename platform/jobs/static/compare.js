// The compare page /compare?ids=1,2,3: the loss and every validation-metric curve of the selected runs
// overlaid, one colour per run (legend: "#id name"); runs still training keep updating.

"use strict";

const POLL_MS = 2000;
const IDS = (new URLSearchParams(window.location.search).get("ids") || "")
  .split(",")
  .map((s) => s.trim())
  .filter((s) => /^\d+$/.test(s))
  .map(Number)
  .filter((id, i, all) => all.indexOf(id) === i);

const runs = new Map(); // id -> {job, records, next, color, done}
const plotsState = {loss: null, val: new Map(), xaxis: "step"};

function label(run) {
  return `#${run.job.id}${run.job.name ? ` ${run.job.name}` : ""}`;
}

// One series per run and source (records, or each parameter-server worker's counters history).
function runSeries(run, field) {
  const t0 = run.job.started || (run.records[0] && run.records[0].time);
  const x = (r) => (plotsState.xaxis === "step" ? r.step : typeof r.time === "number" ? r.time - t0 : NaN);
  const sources = [...fieldPoints(run.records, run.history, field, x).entries()];
  return sources.map(([src, points]) => ({
    name: sources.length > 1 ? `${label(run)} ${src}` : label(run),
    color: run.color,
    points,
  }));
}

// Runs with the very same curve would hide each other: a later one is dashed and named "= #earlier".
function markTwins(series) {
  const seen = new Map();
  return series.map((s) => {
    const key = JSON.stringify(s.points);
    if (!s.points.length || !seen.has(key)) {
      seen.set(key, s.name);
      return s;
    }
    return {...s, name: `${s.name} (= ${seen.get(key)})`, dash: "6 4"};
  });
}

function redraw() {
  const xl = plotsState.xaxis === "step" ? "step" : "wall time since start (s)";
  const list = IDS.map((id) => runs.get(id)).filter((r) => r && r.job);
  plotsState.loss.setXLabel(xl);
  plotsState.loss.setSeries(markTwins(list.flatMap((r) => runSeries(r, "loss"))));
  const fields = new Set();
  for (const r of list) {
    for (const rec of [...r.records, ...r.history]) for (const k of Object.keys(rec)) if (isValidationField(k)) fields.add(k);
  }
  document.getElementById("no-val").hidden = fields.size > 0;
  const box = document.getElementById("plots-val");
  for (const f of [...fields].sort()) {
    let plot = plotsState.val.get(f);
    if (!plot) {
      const div = el("div", {class: "plot-box", id: `plot-${f}`, "data-field": f});
      box.appendChild(div);
      plot = new LinePlot(div, {title: f, yLabel: f, legend: true});
      plotsState.val.set(f, plot);
    }
    plot.setXLabel(xl);
    plot.setSeries(markTwins(list.flatMap((r) => runSeries(r, f)).filter((s) => s.points.length)));
  }
}

function renderRuns() {
  const tbody = document.querySelector("#runs tbody");
  tbody.replaceChildren();
  for (const id of IDS) {
    const run = runs.get(id);
    if (!run) continue;
    const swatch = el("span", {class: "swatch"});
    swatch.style.background = run.color;
    if (!run.job) {
      tbody.appendChild(el("tr", {"data-job-id": String(id)}, el("td", {}, swatch), el("td", {}, String(id)),
        el("td", {colspan: 5, class: "row-error"}, run.error || "loading…")));
      continue;
    }
    const j = run.job;
    tbody.appendChild(
      el("tr", {"data-job-id": String(id), "data-state": j.state},
        el("td", {}, swatch),
        el("td", {class: "num"}, el("a", {href: `/jobs/${id}`}, String(id))),
        el("td", {}, j.name || ""),
        el("td", {}, jobCommand(j)),
        el("td", {}, stateBadge(j.state)),
        el("td", {class: "num"}, formatDuration(jobDuration(j))),
        el("td", {}, formatBest(j.best_metric)),
      ),
    );
  }
}

async function refreshRun(run, id) {
  if (run.done) return false;
  try {
    run.job = await api(`/api/jobs/${id}`);
  } catch (e) {
    if (e.status === 404) {
      run.error = `job ${id} does not exist`;
      run.done = true;
      return true;
    }
    throw e;
  }
  const terminal = TERMINAL_STATES.has(run.job.state);
  let changed = false;
  for (let i = 0; i < 50; i++) {
    const body = await api(`/api/jobs/${id}/metrics?after=${run.next}`);
    const recs = body.records || [];
    if (body.next !== undefined && body.next !== null) run.next = body.next;
    run.records.push(...recs);
    if (!recs.length) break;
    changed = true;
  }
  const counters = await api(`/api/jobs/${id}/counters?after=${run.historyNext}`);
  const history = counters.history || [];
  if (counters.next !== undefined && counters.next !== null) run.historyNext = counters.next;
  else run.history = [];
  if (history.length) {
    run.history.push(...history);
    changed = true;
  }
  // A terminal job gets one last round (its final records), then is not asked again.
  if (terminal) {
    if (run.sawTerminal) run.done = true;
    run.sawTerminal = true;
  }
  return changed;
}

async function refresh() {
  let changed = false;
  for (const id of IDS) {
    if (await refreshRun(runs.get(id), id)) changed = true;
  }
  renderRuns();
  if (changed) redraw();
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("ids").value = IDS.join(",");
  plotsState.loss = new LinePlot(document.getElementById("plot-loss"), {
    title: "training loss",
    yLabel: "loss",
    legend: true,
  });
  for (const input of document.querySelectorAll("input[name=xaxis]")) {
    input.addEventListener("change", () => {
      plotsState.xaxis = input.value;
      redraw();
    });
  }
  if (!IDS.length) {
    showStatus("choose jobs on the jobs page (checkboxes, then \"compare selected\") or type their ids above", false, true);
    return;
  }
  IDS.forEach((id, i) => runs.set(id, {job: null, records: [], next: 0, history: [], historyNext: 0, color: PLOT_COLORS[i % PLOT_COLORS.length]}));
  const stop = poll(async () => {
    await refresh();
    if ([...runs.values()].every((r) => r.done)) stop();
  }, POLL_MS);
});
