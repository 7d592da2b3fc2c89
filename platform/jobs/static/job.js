// The job page /jobs/{id}: header facts, live plots (loss, throughput, every eval_*/val_* field) fed
// incrementally from GET /api/jobs/{id}/metrics?after=SEQ, counters, config, log tail, exported model.

"use strict";

const JOB_ID = Number(window.location.pathname.split("/").filter(Boolean).pop());
const POLL_MS = 1500;

const state = {
  job: null,
  records: [],
  next: 0,
  history: [], // counters history records (step, time, source, val_* ...)
  historyNext: 0,
  xaxis: "step",
  finalRoundDone: false,
  stop: null,
  configShown: false,
};
const plots = {loss: null, throughput: null, val: new Map()};

function xOf(r) {
  if (state.xaxis === "step") return r.step;
  const t0 = (state.job && state.job.started) || (state.records[0] && state.records[0].time);
  return r.time - t0;
}

function xLabel() {
  return state.xaxis === "step" ? "step" : "wall time (s)";
}

function seriesOf(field) {
  const pts = [];
  for (const r of state.records) {
    const v = r[field];
    if (typeof v === "number" && typeof r.step === "number") pts.push([xOf(r), v]);
  }
  return pts;
}

// A field's series: the metrics records, else the counters history per source (see fieldPoints).
function seriesFor(field, label, colorIndex) {
  const x = (r) => (state.xaxis === "step" ? r.step : typeof r.time === "number" ? xOf(r) : NaN);
  const sources = [...fieldPoints(state.records, state.history, field, x).entries()];
  return sources.map(([src, points], i) => ({
    name: sources.length > 1 ? `${label} (${src})` : label,
    points,
    color: PLOT_COLORS[(colorIndex + i) % PLOT_COLORS.length],
  }));
}

// Exponential moving average of a series' y (weight EMA_ALPHA on the newest point), for noisy throughput.
const EMA_ALPHA = 0.2;
function ema(points) {
  let m = null;
  return points.map(([x, y]) => [x, (m = m === null ? y : m + EMA_ALPHA * (y - m))]);
}

function redrawPlots() {
  plots.loss.setXLabel(xLabel());
  plots.loss.setSeries(seriesFor("loss", "loss", 0));
  plots.throughput.setXLabel(xLabel());
  // the raw samples/s faint, its EMA drawn over it
  const raw = seriesFor("samples_per_s", "samples/s", 0);
  plots.throughput.setSeries([
    ...raw.map((s) => ({...s, name: `${s.name} raw`, faint: true})),
    ...raw.map((s) => ({...s, name: `${s.name} (EMA ${EMA_ALPHA})`, points: ema(s.points)})),
  ]);

  const charts = validationCharts();
  const box = document.getElementById("plots-val");
  document.getElementById("no-val").hidden = charts.size > 0;
  for (const [f, fields] of [...charts.entries()].sort((x, y) => x[0].localeCompare(y[0]))) {
    let plot = plots.val.get(f);
    if (!plot) {
      const div = el("div", {class: "plot-box", id: `plot-${f}`, "data-field": f});
      box.appendChild(div);
      plot = new LinePlot(div, {title: f, yLabel: f, xLabel: xLabel()});
      plots.val.set(f, plot);
    }
    plot.setXLabel(xLabel());
    plot.setSeries(validationSeries(f, fields, 2));
  }
}

// One chart per validation metric: eval_X (the job's metrics records) and val_X (the per-worker counters of
// parameter-server jobs, where worker 0's val_X repeats the job's eval_X) are the same metric X. Returns
// chart name (the records' field when they have one) -> the fields drawn in it.
function validationCharts() {
  const byMetric = new Map();
  const add = (rows, fromRecords) => {
    for (const r of rows) {
      for (const k of Object.keys(r)) {
        if (!isValidationField(k) || typeof r[k] !== "number") continue;
        const metric = k.replace(/^(eval|val)_/, "");
        const c = byMetric.get(metric) || {name: k, fromRecords, fields: new Set()};
        if (fromRecords && !c.fromRecords) Object.assign(c, {name: k, fromRecords});
        c.fields.add(k);
        byMetric.set(metric, c);
      }
    }
  };
  add(state.records, true);
  add(state.history, false);
  return new Map([...byMetric.values()].map((c) => [c.name, [...c.fields].sort()]));
}

// The chart's series: each field of the metrics records, then each counters source (worker) of each field,
// leaving out a source whose points repeat a series already drawn (worker 0 of a parameter-server job).
// Counters records carry no time of their own: in wall-time mode they take the time of the job's metrics
// record of the same step.
function validationSeries(chart, fields, colorIndex) {
  const stepTime = new Map(state.records.filter((r) => typeof r.time === "number").map((r) => [r.step, r.time]));
  const t = (r) => (typeof r.time === "number" ? r.time : stepTime.get(r.step));
  const x = (r) => (state.xaxis === "step" ? r.step : xOf({time: t(r)}));
  const out = [];
  const drawn = new Set();
  const push = (name, rows, field) => {
    const points = lastAttempt(rows).map((r) => [x(r), r[field]]);
    const key = JSON.stringify(lastAttempt(rows).map((r) => [r.step, r[field]]));
    if (!points.length || drawn.has(key)) return;
    drawn.add(key);
    out.push({name, points, color: PLOT_COLORS[(colorIndex + out.length) % PLOT_COLORS.length]});
  };
  const has = (f) => (r) => typeof r[f] === "number" && typeof r.step === "number";
  for (const f of fields) push(f, state.records.filter(has(f)), f);
  for (const f of fields) {
    const bySource = new Map();
    for (const h of state.history.filter(has(f))) {
      const src = h.source || "counters";
      bySource.set(src, [...(bySource.get(src) || []), h]);
    }
    for (const [src, rows] of [...bySource.entries()].sort((a, b) => a[0].localeCompare(b[0]))) {
      push(`${f} (${src})`, rows, f);
    }
  }
  if (out.length === 1) out[0].name = chart;
  return out;
}

// The job's command line; argv lists starting with the app are `mariana` subcommands.
function argvText(job) {
  const argv = job.argv || [];
  return (argv.length && argv[0] === job.app ? ["mariana", ...argv] : argv).join(" ");
}

function fact(dl, label, value, cls) {
  const dd = el("dd", {class: cls || null});
  if (value instanceof Node) dd.appendChild(value);
  else dd.textContent = value === null || value === undefined || value === "" ? "–" : String(value);
  dl.append(el("dt", {}, label), dd);
}

// The run's MLflow run page, from RUN/tracking.json (platform/core/tracking.py), which /api/jobs/ID carries.
let trackingUrl = null;
function fetchTracking(job) {
  trackingUrl = (job.tracking && job.tracking.mlflow && job.tracking.mlflow.url) || "";
}

function renderHeader(job) {
  document.title = `Job ${job.id} ${job.name || ""} · Mariana`;
  setText(document.getElementById("title"), `Job ${job.id}${job.name ? ` · ${job.name}` : ""}`);
  const stateEl = document.getElementById("state");
  stateEl.setAttribute("data-state", job.state);
  if (stateEl.textContent !== shownState(job)) stateEl.replaceChildren(stateBadge(shownState(job)));
  const cmd = document.getElementById("cmdline");
  cmd.replaceChildren(
    el("div", {}, el("span", {class: "muted"}, "command "), el("code", {id: "argv"}, argvText(job))),
    el("div", {}, el("span", {class: "muted"}, "run dir "), el("code", {}, job.run_dir || "–")),
  );
  fetchTracking(job);
  if (trackingUrl) {
    cmd.append(el("div", {}, el("span", {class: "muted"}, "tracking "),
                  el("a", {id: "mlflow-link", href: trackingUrl, target: "_blank", rel: "noopener"}, "MLflow run")));
  }
  const dl = document.getElementById("header");
  dl.replaceChildren();
  fact(dl, "app / command", jobCommand(job));
  fact(dl, "created", formatTime(job.created));
  fact(dl, "started", formatTime(job.started));
  fact(dl, "ended", formatTime(job.ended));
  fact(dl, "duration", formatDuration(jobDuration(job)));
  fact(dl, "priority / slots", `${job.priority ?? "–"} / ${job.slots ?? "–"}`);
  fact(dl, "pid", job.pid);
  // the scheduler's own id of the job (the executor's ext): what squeue, scancel and sacct take
  if (job.external_id) fact(dl, job.executor === "slurm" ? "Slurm job id" : "external id", job.external_id);
  fact(dl, "exit code", job.exit_code);
  fact(dl, "last step", job.last_step);
  fact(dl, "best metric", formatBest(job.best_metric));
  const errEl = document.getElementById("error");
  errEl.hidden = !job.error;
  setText(errEl, job.error || "");
  document.getElementById("cancel").hidden = !(job.state === "queued" || job.state === "running");
  document.getElementById("retry").hidden = !canRetry(job);
  renderModel(job);
  renderServed(job.served);
}

// The exported model's files, linked through GET /api/jobs/{id}/files/{path} (paths relative to run dir).
function renderModel(job) {
  const links = document.getElementById("model-links");
  const serve = document.getElementById("serve");
  if (!job.export) {
    setText(links, TERMINAL_STATES.has(job.state) ? "no exported model" : "no exported model yet");
    serve.hidden = true;
    return;
  }
  if (links.getAttribute("data-export") === job.export) return;
  let rel = job.export;
  if (job.run_dir && rel.startsWith(job.run_dir)) rel = rel.slice(job.run_dir.length).replace(/^\/+/, "");
  if (!rel.endsWith(".safetensors") && !rel.endsWith(".json")) rel = `${rel.replace(/\/+$/, "")}/model.safetensors`;
  const base = rel.replace(/[^/]*$/, "");
  const href = (p) => `/api/jobs/${job.id}/files/${p.split("/").map(encodeURIComponent).join("/")}`;
  links.className = "";
  links.setAttribute("data-export", job.export);
  links.replaceChildren(
    "exported model: ",
    el("a", {href: href(rel), id: "model-link"}, rel),
    " · ",
    el("a", {href: href(`${base}model.json`)}, `${base}model.json`),
  );
  serve.hidden = false;
}

// "serving at URL" + Stop while the service runs a model server for this job (job.served), else nothing.
function renderServed(url) {
  const span = document.getElementById("serve-url");
  const stop = document.getElementById("serve-stop");
  if ((span.getAttribute("data-url") || "") === (url || "")) return;
  span.setAttribute("data-url", url || "");
  if (url) span.replaceChildren("serving at ", el("a", {href: url, id: "served-url"}, url));
  else if (span.getAttribute("data-stopped")) span.replaceChildren("server stopped");
  else span.replaceChildren();
  stop.hidden = !url;
}

function renderTable(container, rowsData, headers) {
  if (!rowsData.length) return;
  const thead = el("thead", {}, el("tr", {}, ...headers.map((h) => el("th", {}, h))));
  const tbody = el("tbody", {});
  for (const cells of rowsData) {
    tbody.appendChild(el("tr", {}, ...cells.map((c, i) => el("td", {class: i ? "num" : "key"}, formatCell(c)))));
  }
  container.replaceChildren(el("table", {class: "grid kv"}, thead, tbody));
}

const isDict = (v) => v !== null && typeof v === "object" && !Array.isArray(v);

// The entities of a counters dict: a dict whose values are all dicts groups entities (workers: {worker-0:
// {...}, worker-1: {...}}, servers: {...}); any other dict is one entity (its counters, flattened).
function counterEntities(obj, name, out) {
  const values = Object.values(obj);
  if (values.length && values.every(isDict)) {
    for (const [k, v] of Object.entries(obj)) counterEntities(v, k, out);
  } else {
    out.push([name, Object.fromEntries(flatten(obj))]);
  }
  return out;
}

// Counters: one entity -> name/value rows; several (per worker / server) -> one column each.
function renderCounters(counters) {
  if (!isDict(counters) || !Object.keys(counters).length) return;
  const entities = counterEntities(counters, "value", []);
  const names = [...new Set(entities.flatMap(([, c]) => Object.keys(c)))].sort();
  renderTable(
    document.getElementById("counters"),
    names.map((n) => [n, ...entities.map(([, c]) => c[n])]),
    ["counter", ...entities.map(([e]) => e)],
  );
}

function renderConfig(config) {
  if (!config || state.configShown) return;
  renderTable(document.getElementById("config"), flatten(config), ["field", "value"]);
  state.configShown = true;
}

async function fetchMetrics() {
  let added = 0;
  for (let i = 0; i < 50; i++) {
    const body = await api(`/api/jobs/${JOB_ID}/metrics?after=${state.next}`);
    const recs = body.records || [];
    if (body.next !== undefined && body.next !== null) state.next = body.next;
    state.records.push(...recs);
    added += recs.length;
    if (!recs.length) break;
  }
  if (added) redrawPlots();
}

async function fetchLog() {
  const body = await api(`/api/jobs/${JOB_ID}/logs?tail=200`);
  const pre = document.getElementById("log");
  const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
  const text = body.text || "";
  if (pre.textContent !== text) {
    pre.textContent = text;
    if (atBottom) pre.scrollTop = pre.scrollHeight;
  }
}

async function refresh() {
  let job;
  try {
    job = await api(`/api/jobs/${JOB_ID}`);
  } catch (e) {
    if (e.status === 404) {
      document.title = `Job ${JOB_ID} not found · Mariana`;
      setText(document.getElementById("title"), `Job ${JOB_ID} not found`);
      document.getElementById("job-body").hidden = true; // no empty cards under the message
      showStatus(`job ${JOB_ID} does not exist: see the jobs list`, true, true);
      state.stop();
      return;
    }
    throw e;
  }
  const wasTerminal = state.job && TERMINAL_STATES.has(state.job.state);
  state.job = job;
  renderHeader(job);
  renderConfig(job.config);
  if (job.counters) renderCounters(job.counters);
  await fetchMetrics();
  const counters = await api(`/api/jobs/${JOB_ID}/counters?after=${state.historyNext}`);
  renderCounters(counters.counters);
  const history = counters.history || [];
  if (counters.next !== undefined && counters.next !== null) state.historyNext = counters.next;
  else state.history = [];
  if (history.length) {
    state.history.push(...history);
    redrawPlots();
  }
  await fetchLog();
  // Once the job has ended, one more full round picks up its last records, then polling stops.
  if (TERMINAL_STATES.has(job.state) && wasTerminal) {
    state.finalRoundDone = true;
    state.stop();
  }
}

async function action(name, button) {
  button.disabled = true;
  try {
    const body = await apiPost(`/api/jobs/${JOB_ID}/${name}`);
    if (name === "serve") {
      renderServed(body.url);
    } else if (name === "serve/stop") {
      document.getElementById("serve-url").setAttribute("data-stopped", "1");
      renderServed(null);
    } else if (name === "retry" && body && body.id !== undefined && Number(body.id) !== JOB_ID) {
      window.location.href = `/jobs/${body.id}`; // the retry is a new job
    } else {
      showStatus(`${name} requested`);
      if (state.finalRoundDone) {
        state.finalRoundDone = false;
        state.stop = poll(refresh, POLL_MS);
      }
    }
  } catch (e) {
    showStatus(`${name} failed: ${e.message}`, true);
  } finally {
    button.disabled = false;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  plots.loss = new LinePlot(document.getElementById("plot-loss"), {title: "training loss", yLabel: "loss"});
  plots.throughput = new LinePlot(document.getElementById("plot-throughput"), {
    title: "throughput",
    yLabel: "samples/s",
  });
  for (const input of document.querySelectorAll("input[name=xaxis]")) {
    input.addEventListener("change", () => {
      state.xaxis = input.value;
      redrawPlots();
    });
  }
  for (const [name, id] of [["cancel", "cancel"], ["retry", "retry"], ["serve", "serve"], ["serve/stop", "serve-stop"]]) {
    const button = document.getElementById(id);
    button.addEventListener("click", () => action(name, button));
  }
  if (!Number.isInteger(JOB_ID)) {
    showStatus("no job id in the address", true);
    return;
  }
  state.stop = poll(refresh, POLL_MS);
});
