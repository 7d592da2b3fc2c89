// Shared by every page: the REST client (with the optional bearer token from localStorage), the
// header's token field, and formatting of times, durations and metrics.

"use strict";

const TOKEN_KEY = "mariana.token";
const TERMINAL_STATES = new Set(["succeeded", "failed", "cancelled"]);

function getToken() {
  return window.localStorage.getItem(TOKEN_KEY) || "";
}

// fetch JSON from the service; throws an Error whose message is the service's detail on a non-2xx reply.
async function api(path, options) {
  const opts = Object.assign({method: "GET", headers: {}}, options || {});
  const token = getToken();
  if (token) opts.headers["Authorization"] = `Bearer ${token}`;
  const resp = await fetch(path, opts);
  let body = null;
  const text = await resp.text();
  try {
    body = text ? JSON.parse(text) : null;
  } catch (e) {
    body = {detail: text};
  }
  if (!resp.ok) {
    let detail = body && body.detail !== undefined ? body.detail : resp.statusText;
    if (typeof detail !== "string") detail = JSON.stringify(detail);
    const hint = resp.status === 401 || resp.status === 403 ? " (set the service token in the header)" : "";
    const err = new Error(`${resp.status} ${detail}${hint}`);
    err.status = resp.status;
    throw err;
  }
  return body;
}

function apiPost(path) {
  return api(path, {method: "POST"});
}

// Runs fn now and then every `ms` milliseconds, never two at once; returns a stop function.
function poll(fn, ms) {
  let stopped = false;
  let timer = null;
  let failing = false;
  const tick = async () => {
    if (stopped) return;
    try {
      await fn();
      if (failing) clearStatus();
      failing = false;
    } catch (e) {
      failing = true;
      showStatus(`cannot reach the service: ${e.message}`, true);
    }
    if (!stopped) timer = setTimeout(tick, ms);
  };
  tick();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}

let statusTimer = null;

// One line under the toolbar; errors stay until cleared, notices fade after a few seconds.
function showStatus(message, isError, sticky) {
  const el = document.getElementById("status");
  if (!el) return;
  el.textContent = message || "";
  el.classList.toggle("error", Boolean(isError));
  el.hidden = !message;
  clearTimeout(statusTimer);
  if (message && !isError && !sticky) statusTimer = setTimeout(() => (el.hidden = true), 4000);
}

function clearStatus() {
  showStatus("");
}

function formatTime(unix) {
  if (unix === null || unix === undefined) return "–";
  const d = new Date(unix * 1000);
  const pad = (n) => String(n).padStart(2, "0");
  const today = new Date();
  const hms = `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  if (d.toDateString() === today.toDateString()) return hms;
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${hms}`;
}

function formatDuration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "–";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${String(s % 60).padStart(2, "0")}s`;
  return `${Math.floor(s / 3600)}h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
}

// A job's duration: the service's duration_s, or now - started while it runs.
function jobDuration(job) {
  if (job.state === "running" && job.started) return Date.now() / 1000 - job.started;
  if (job.duration_s !== null && job.duration_s !== undefined) return job.duration_s;
  if (job.started && job.ended) return job.ended - job.started;
  return null;
}

function formatNumber(v) {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v)) return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e6 || a < 1e-3)) return v.toExponential(3);
  return String(Number(v.toPrecision(4)));
}

function formatBest(best) {
  if (!best) return "–";
  const step = best.step !== null && best.step !== undefined ? ` @${best.step}` : "";
  const v = best.value;
  const value = typeof v === "number" && !Number.isInteger(v) && Math.abs(v) >= 1e-3 && Math.abs(v) < 1e6
    ? v.toPrecision(4)
    : formatNumber(v);
  return `${best.name} ${value}${step}`;
}

function jobCommand(job) {
  if (job.app && job.command) return `${job.app} ${job.command}`;
  return job.app || job.command || "";
}

// A job's state as shown: "pruned" for a tuning trial its pruner stopped (state cancelled, job.pruned).
function shownState(job) {
  return job.pruned ? "pruned" : job.state;
}

function stateBadge(state) {
  const span = document.createElement("span");
  span.className = `state state-${state}`;
  span.textContent = state;
  return span;
}

// Retry (--resume) makes sense for a failed or cancelled job, not for a trial the tuner pruned on purpose.
function canRetry(job) {
  return (job.state === "failed" || job.state === "cancelled") && !job.pruned;
}

// Creates an element: el("td", {class: "x", "data-a": 1}, child | "text", ...).
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "onclick") node.addEventListener("click", v);
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.appendChild(typeof c === "string" || typeof c === "number" ? document.createTextNode(String(c)) : c);
  }
  return node;
}

// Sets an element's text only when it changed (so live updates do not disturb selection or focus).
function setText(node, text) {
  if (node.textContent !== text) node.textContent = text;
}

// Flattens nested dicts into [["a.b", value], ...], sorted by key.
function flatten(obj, prefix) {
  const out = [];
  for (const [k, v] of Object.entries(obj || {})) {
    const key = prefix ? `${prefix}.${k}` : k;
    if (v !== null && typeof v === "object" && !Array.isArray(v)) out.push(...flatten(v, key));
    else out.push([key, v]);
  }
  return out.sort((a, b) => a[0].localeCompare(b[0]));
}

function formatCell(v) {
  if (v === null || v === undefined) return "–";
  if (v === "") return '""';
  if (Array.isArray(v)) return v.map(formatCell).join(", ");
  if (typeof v === "number") return Number.isInteger(v) ? String(v) : String(Number(v.toPrecision(6)));
  return String(v);
}

// Points [[x, value], ...] of `field` by source: from the metrics records when any of them carries the
// field (one source, ""), else from the counters history, one source per reporter (parameter-server
// workers report loss and per-epoch val_* there). xOf(row) gives a row's x (NaN drops the point).
// A record whose step is not after the previous one's starts a resumed attempt (from its checkpoint): the
// earlier records of those steps are superseded, so curves never double back.
function lastAttempt(rows) {
  const out = [];
  for (const r of rows) {
    while (out.length && out[out.length - 1].step >= r.step) out.pop();
    out.push(r);
  }
  return out;
}

function fieldPoints(records, history, field, xOf) {
  const has = (r) => typeof r[field] === "number" && typeof r.step === "number";
  if (records.some(has)) return new Map([["", lastAttempt(records.filter(has)).map((r) => [xOf(r), r[field]])]]);
  const bySource = new Map();
  for (const h of history) {
    if (!has(h)) continue;
    const src = h.source || "counters";
    if (!bySource.has(src)) bySource.set(src, []);
    bySource.get(src).push(h);
  }
  const points = (rows) => lastAttempt(rows).map((h) => [xOf(h), h[field]]);
  return new Map([...bySource.entries()].sort((a, b) => a[0].localeCompare(b[0])).map(([k, v]) => [k, points(v)]));
}

// Is this metrics-record field a validation metric (eval_auc, val_logloss, ...)?
function isValidationField(name) {
  return /^(eval|val)_/.test(name);
}

// The header's token field: stored in localStorage, sent as a bearer token on every request.
function setupHeader() {
  const input = document.getElementById("token");
  if (input) {
    input.value = getToken();
    input.addEventListener("change", () => {
      const v = input.value.trim();
      if (v) window.localStorage.setItem(TOKEN_KEY, v);
      else window.localStorage.removeItem(TOKEN_KEY);
      showStatus(v ? "token saved" : "token cleared");
    });
  }
}

document.addEventListener("DOMContentLoaded", setupHeader);
