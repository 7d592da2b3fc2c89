// The jobs page: a table of every job (newest first) polled from GET /api/jobs, updated in place so
// checkboxes and buttons keep working while it refreshes; "compare selected" opens /compare?ids=...

"use strict";

const POLL_MS = 1500;
const selected = new Set();
const rows = new Map(); // job id -> {tr, cells}
let lastJobs = [];

function buildRow(job) {
  const id = job.id;
  const check = el("input", {type: "checkbox", class: "pick", "aria-label": `select job ${id}`});
  check.checked = selected.has(id);
  check.addEventListener("change", () => {
    if (check.checked) selected.add(id);
    else selected.delete(id);
    updateCompareButton();
  });
  const cells = {
    id: el("td", {class: "num"}, el("a", {href: `/jobs/${id}`}, String(id))),
    name: el("td", {class: "name"}),
    command: el("td", {class: "command"}),
    state: el("td", {class: "state-cell"}),
    started: el("td", {class: "time"}),
    duration: el("td", {class: "num"}),
    best: el("td", {class: "best"}),
    slots: el("td", {class: "num"}),
    actions: el("td", {class: "actions"}),
  };
  const cancel = el("button", {type: "button", class: "cancel small"}, "cancel");
  cancel.addEventListener("click", () => act(id, "cancel", cancel));
  const retry = el("button", {type: "button", class: "retry small"}, "retry");
  retry.addEventListener("click", () => act(id, "retry", retry));
  cells.actions.append(cancel, retry);
  const tr = el("tr", {"data-job-id": String(id)}, el("td", {class: "sel"}, check), ...Object.values(cells));
  return {tr, cells, cancel, retry, check};
}

function updateRow(row, job) {
  const {tr, cells} = row;
  tr.setAttribute("data-state", job.state);
  const nameLink = cells.name.querySelector("a") || cells.name.appendChild(el("a", {href: `/jobs/${job.id}`}));
  setText(nameLink, job.name || `job ${job.id}`);
  let err = cells.name.querySelector(".row-error");
  if (job.error) {
    if (!err) err = cells.name.appendChild(el("div", {class: "row-error"}));
    setText(err, job.error);
    err.title = job.error;
  } else if (err) {
    err.remove();
  }
  setText(cells.command, jobCommand(job));
  cells.command.title = (job.argv || []).join(" ");
  const badge = cells.state.firstChild;
  if (!badge || badge.textContent !== shownState(job)) cells.state.replaceChildren(stateBadge(shownState(job)));
  setText(cells.started, formatTime(job.started));
  setText(cells.duration, formatDuration(jobDuration(job)));
  setText(cells.best, formatBest(job.best_metric));
  setText(cells.slots, job.slots === null || job.slots === undefined ? "–" : String(job.slots));
  row.cancel.hidden = !(job.state === "queued" || job.state === "running");
  row.retry.hidden = !canRetry(job);
}

function render(jobs) {
  const tbody = document.querySelector("#jobs tbody");
  const seen = new Set();
  jobs.forEach((job, i) => {
    seen.add(job.id);
    let row = rows.get(job.id);
    if (!row) {
      row = buildRow(job);
      rows.set(job.id, row);
    }
    updateRow(row, job);
    if (tbody.children[i] !== row.tr) tbody.insertBefore(row.tr, tbody.children[i] || null);
  });
  for (const [id, row] of rows) {
    if (!seen.has(id)) {
      row.tr.remove();
      rows.delete(id);
      selected.delete(id);
    }
  }
  document.getElementById("empty").hidden = jobs.length > 0;
  const counts = {};
  for (const j of jobs) counts[j.state] = (counts[j.state] || 0) + 1;
  const order = ["running", "queued", "succeeded", "failed", "cancelled"];
  const parts = order.filter((s) => counts[s]).map((s) => `${counts[s]} ${s}`);
  setText(document.getElementById("summary"), parts.join(" · "));
  updateCompareButton();
}

function updateCompareButton() {
  const btn = document.getElementById("compare-selected");
  btn.disabled = selected.size < 1;
  btn.textContent = selected.size ? `Compare selected (${selected.size})` : "Compare selected";
}

async function act(id, action, button) {
  button.disabled = true;
  try {
    await apiPost(`/api/jobs/${id}/${action}`);
    showStatus(`job ${id}: ${action} requested`);
    await refresh();
  } catch (e) {
    showStatus(`job ${id}: ${action} failed: ${e.message}`, true);
  } finally {
    button.disabled = false;
  }
}

async function refresh() {
  const body = await api("/api/jobs");
  lastJobs = body.jobs || [];
  render(lastJobs);
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("compare-selected").addEventListener("click", () => {
    const ids = lastJobs.map((j) => j.id).filter((id) => selected.has(id));
    window.location.href = `/compare?ids=${ids.reverse().join(",")}`;
  });
  document.getElementById("select-all").addEventListener("change", (e) => {
    for (const [id, row] of rows) {
      row.check.checked = e.target.checked;
      if (e.target.checked) selected.add(id);
      else selected.delete(id);
    }
    updateCompareButton();
  });
  poll(refresh, POLL_MS);
});
