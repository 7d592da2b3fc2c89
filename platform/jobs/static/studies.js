// The studies pages: /studies lists the Optuna studies of `mariana tune` in the service's database;
// /studies/{name} shows one: its trials (click a header to sort, e.g. by the metric), the metric of
// every trial against its training step, the best value by trial, and Optuna's parameter importances.

"use strict";

const studyName = (() => {
  const m = window.location.pathname.match(/^\/studies\/(.+)$/);
  return m ? decodeURIComponent(m[1]) : null;
})();

let sortKey = "number";
let sortDesc = false;
let lastStudy = null;
let historyPlot = null;
let curvesPlot = null;

async function refreshList() {
  const data = await api("/api/studies");
  const body = document.querySelector("#studies tbody");
  body.replaceChildren(
    ...data.studies.map((s) =>
      el("tr", {"data-study": s.name},
        el("td", {}, el("a", {href: `/studies/${encodeURIComponent(s.name)}`}, s.name)),
        el("td", {}, s.app || "–"),
        el("td", {}, `${s.monitor || "value"} (${s.direction})`),
        el("td", {}, s.n_trials),
        el("td", {class: "best"}, formatNumber(s.best_value)),
        el("td", {}, formatTime(s.started)))),
  );
  document.getElementById("no-studies").hidden = data.studies.length > 0;
}

function cellValue(t, key) {
  if (key === "number" || key === "state" || key === "value") return t[key];
  if (key === "duration") return t.started && t.ended ? t.ended - t.started : null;
  return t.params[key];
}

function sortedTrials(trials) {
  const out = trials.slice();
  out.sort((a, b) => {
    const x = cellValue(a, sortKey);
    const y = cellValue(b, sortKey);
    // Trials without a value (running, failed) go last whatever the direction.
    if (x === null || x === undefined) return y === null || y === undefined ? a.number - b.number : 1;
    if (y === null || y === undefined) return -1;
    const c = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y));
    return sortDesc ? -c : c;
  });
  return out;
}

function renderTrials(study) {
  const monitor = (study.user_attrs && study.user_attrs.monitor) || "value";
  const params = [...new Set(study.trials.flatMap((t) => Object.keys(t.params)))];
  const cols = [["number", "trial"], ["state", "state"], ["value", monitor], ["duration", "duration"],
    ...params.map((p) => [p, p])];
  const head = document.querySelector("#trials thead tr");
  head.replaceChildren(...cols.map(([key, label]) => {
    const arrow = key === sortKey ? (sortDesc ? " ▼" : " ▲") : "";
    return el("th", {class: "sortable", "data-sort": key, "aria-sort": key === sortKey ? (sortDesc ? "descending" : "ascending") : null,
      onclick: () => {
        if (sortKey === key) sortDesc = !sortDesc;
        else {
          sortKey = key;
          // The metric sorts best-first at the first click.
          sortDesc = key === "value" ? study.direction === "maximize" : false;
        }
        renderTrials(lastStudy);
      }}, label + arrow);
  }));
  const body = document.querySelector("#trials tbody");
  body.replaceChildren(...sortedTrials(study.trials).map((t) => {
    const num = t.job_id ? el("a", {href: `/jobs/${t.job_id}`, title: `job ${t.job_id}`}, String(t.number)) : String(t.number);
    const state = el("td", {}, stateBadge(t.state));
    if (t.error) state.appendChild(el("div", {class: "row-error", title: t.error}, t.error));
    return el("tr", {"data-trial": t.number, "data-state": t.state, class: t.number === study.best_trial ? "best-row" : null},
      el("td", {}, num),
      state,
      el("td", {class: "value"}, formatNumber(t.value)),
      el("td", {}, formatDuration(cellValue(t, "duration"))),
      ...params.map((p) => el("td", {}, formatCell(t.params[p]))));
  }));
}

function renderPlots(study) {
  const monitor = (study.user_attrs && study.user_attrs.monitor) || "value";
  if (!historyPlot) {
    historyPlot = new LinePlot(document.getElementById("plot-history"),
      {title: `${monitor} by trial`, xLabel: "trial", yLabel: monitor, integerX: true});
    curvesPlot = new LinePlot(document.getElementById("plot-curves"),
      {title: `${monitor} during training (each trial)`, xLabel: "step", yLabel: monitor});
  }
  const done = study.trials.filter((t) => t.state === "complete" && typeof t.value === "number");
  const better = study.direction === "maximize" ? Math.max : Math.min;
  let best = null;
  const bestSoFar = done.slice().sort((a, b) => a.number - b.number).map((t) => {
    best = best === null ? t.value : better(best, t.value);
    return [t.number, best];
  });
  // a pruned trial at the last value it reported (where the pruner stopped it)
  const pruned = study.trials.filter((t) => t.state === "pruned" && t.intermediate.length > 0);
  historyPlot.setSeries([
    {name: "trial value", points: done.map((t) => [t.number, t.value])},
    {name: "best so far", points: bestSoFar},
    {name: "pruned (last value)", points: pruned.map((t) => [t.number, t.intermediate[t.intermediate.length - 1][1]])},
  ]);
  curvesPlot.setSeries(study.trials.filter((t) => t.intermediate.length > 0)
    .map((t) => ({name: `trial ${t.number} (${t.state})`, points: t.intermediate})));
}

function renderImportance(study) {
  const body = document.querySelector("#importance tbody");
  const rows = Object.entries(study.importance || {}).sort((a, b) => b[1] - a[1]);
  body.replaceChildren(...rows.map(([name, v]) => el("tr", {"data-param": name},
    el("td", {}, name),
    el("td", {class: "importance"}, el("span", {class: "bar", style: `display:inline-block;height:10px;background:#2563eb;width:${Math.round(200 * v)}px`}), ` ${v.toFixed(3)}`))));
  setText(document.getElementById("importance-note"), rows.length ? "" : (study.importance_note || ""));
}

async function refreshStudy() {
  const study = await api(`/api/studies/${encodeURIComponent(studyName)}`);
  lastStudy = study;
  setText(document.getElementById("study-name"), `Study ${study.name}`);
  const counts = {};
  for (const t of study.trials) counts[t.state] = (counts[t.state] || 0) + 1;
  const a = study.user_attrs || {};
  setText(document.getElementById("study-facts"),
    `${a.app || ""} · ${study.direction} ${a.monitor || "value"} · ` +
    Object.entries(counts).map(([s, n]) => `${n} ${s}`).join(", "));
  renderTrials(study);
  renderPlots(study);
  renderImportance(study);
}

document.addEventListener("DOMContentLoaded", () => {
  if (studyName) {
    document.getElementById("study-view").hidden = false;
    document.title = `${studyName} · Studies · Mariana`;
    poll(refreshStudy, 3000);
  } else {
    document.getElementById("list-view").hidden = false;
    poll(refreshList, 3000);
  }
});
