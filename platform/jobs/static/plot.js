// A small SVG line-plot module: several series against a numeric x (step or wall-time seconds),
// axes with "nice" ticks, a legend and a hover readout. No dependencies, no build step.
//
// Usage:
//   const plot = new LinePlot(containerElement, {title: "loss", xLabel: "step", yLabel: "loss"});
//   (option integerX: x ticks at whole numbers only, e.g. trial numbers)
//   plot.setSeries([{name: "loss", points: [[x, y], ...]}, ...]);   // re-renders
//
// The <svg> carries data-points (all drawn points) and data-series-points (JSON: series name -> points),
// and each series' <path> carries data-series and data-points, so tests can count what was drawn.

"use strict";

const PLOT_COLORS = [
  "#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed",
  "#0891b2", "#db2777", "#65a30d", "#475569", "#ea580c",
];
const SVG_NS = "http://www.w3.org/2000/svg";

function svgEl(tag, attrs, parent) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  if (parent) parent.appendChild(el);
  return el;
}

// Tick values covering [lo, hi] with about `count` ticks at 1, 2 or 5 times a power of ten (whole
// numbers only with `integer`, e.g. trial numbers).
function niceTicks(lo, hi, count, integer) {
  if (!(hi > lo)) {
    const pad = Math.abs(lo) * 0.05 || 1;
    lo -= pad;
    hi += pad;
  }
  const raw = (hi - lo) / Math.max(1, count);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const norm = raw / mag;
  let step = (norm <= 1 ? 1 : norm <= 2 ? 2 : norm <= 5 ? 5 : 10) * mag;
  if (integer) step = Math.max(1, step);
  const start = Math.floor(lo / step) * step;
  const end = Math.ceil(hi / step) * step;
  const ticks = [];
  for (let v = start; v <= end + step * 1e-9; v += step) ticks.push(Number(v.toPrecision(12)));
  return {ticks, lo: start, hi: end, step};
}

function formatTick(v, step) {
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 1e6 || a < 1e-4) return v.toExponential(1);
  const decimals = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
  if (a >= 1000 && decimals === 0) return v.toLocaleString("en-US");
  return v.toFixed(Math.min(decimals, 6));
}

function formatValue(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e6 || a < 1e-3)) return v.toExponential(3);
  if (Number.isInteger(v)) return String(v);
  return v.toPrecision(5);
}

class LinePlot {
  constructor(container, opts) {
    this.container = container;
    this.opts = Object.assign({title: "", xLabel: "step", yLabel: "", height: 260}, opts || {});
    this.series = [];
    this.container.classList.add("plot");
    this.svg = svgEl("svg", {class: "plot-svg", role: "img"}, container);
    this.tip = document.createElement("div");
    this.tip.className = "plot-tip";
    this.tip.hidden = true;
    container.appendChild(this.tip);
    this.svg.addEventListener("mousemove", (e) => this._hover(e));
    this.svg.addEventListener("mouseleave", () => this._unhover());
    this._onResize = () => this.render();
    window.addEventListener("resize", this._onResize);
    this.render();
  }

  setXLabel(label) {
    this.opts.xLabel = label;
  }

  // series: [{name, color?, points: [[x, y], ...]}]; points are sorted by x here.
  setSeries(series) {
    this.series = series.map((s, i) => ({
      name: s.name,
      faint: Boolean(s.faint),
      dash: s.dash || null,
      color: s.color || PLOT_COLORS[i % PLOT_COLORS.length],
      points: s.points
        .filter((p) => Number.isFinite(p[0]) && Number.isFinite(p[1]))
        .sort((a, b) => a[0] - b[0]),
    }));
    this.render();
  }

  render() {
    const svg = this.svg;
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const W = Math.max(320, this.container.clientWidth || 600);
    const H = this.opts.height;
    svg.setAttribute("width", W);
    svg.setAttribute("height", H);
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    // right: room for half the last x tick's label, centred on the frame's right edge ("3,000")
    const m = {left: 62, right: 32, top: this.opts.title ? 26 : 10, bottom: 40};
    const pw = W - m.left - m.right;
    const ph = H - m.top - m.bottom;
    this.geom = null;

    const counts = {};
    let total = 0;
    for (const s of this.series) {
      counts[s.name] = s.points.length;
      total += s.points.length;
    }
    svg.setAttribute("data-points", String(total));
    svg.setAttribute("data-series-points", JSON.stringify(counts));

    if (this.opts.title) {
      svgEl("text", {x: m.left, y: 16, class: "plot-title"}, svg).textContent = this.opts.title;
    }
    const all = this.series.flatMap((s) => s.points);
    if (all.length === 0) {
      svgEl("rect", {x: m.left, y: m.top, width: pw, height: ph, class: "plot-frame"}, svg);
      svgEl("text", {x: m.left + pw / 2, y: m.top + ph / 2, class: "plot-empty"}, svg).textContent =
        "no data yet";
      return;
    }
    let [xmin, xmax, ymin, ymax] = [Infinity, -Infinity, Infinity, -Infinity];
    for (const [x, y] of all) {
      xmin = Math.min(xmin, x);
      xmax = Math.max(xmax, x);
      ymin = Math.min(ymin, y);
      ymax = Math.max(ymax, y);
    }
    const xt = niceTicks(xmin, xmax, Math.max(2, Math.floor(pw / 90)), this.opts.integerX);
    const yt = niceTicks(ymin, ymax, Math.max(2, Math.floor(ph / 45)));
    const sx = (x) => m.left + ((x - xt.lo) / (xt.hi - xt.lo)) * pw;
    const sy = (y) => m.top + ph - ((y - yt.lo) / (yt.hi - yt.lo)) * ph;
    this.geom = {m, pw, ph, sx, sy, xt, yt, W, H};

    const grid = svgEl("g", {class: "plot-grid"}, svg);
    for (const v of yt.ticks) {
      const y = sy(v);
      svgEl("line", {x1: m.left, x2: m.left + pw, y1: y, y2: y}, grid);
      svgEl("text", {x: m.left - 6, y: y + 4, class: "plot-ytick"}, svg).textContent = formatTick(v, yt.step);
    }
    for (const v of xt.ticks) {
      const x = sx(v);
      svgEl("line", {x1: x, x2: x, y1: m.top, y2: m.top + ph}, grid);
      svgEl("text", {x, y: m.top + ph + 16, class: "plot-xtick"}, svg).textContent = formatTick(v, xt.step);
    }
    svgEl("rect", {x: m.left, y: m.top, width: pw, height: ph, class: "plot-frame"}, svg);
    svgEl("text", {x: m.left + pw / 2, y: H - 4, class: "plot-xlabel"}, svg).textContent = this.opts.xLabel;
    if (this.opts.yLabel) {
      svgEl(
        "text",
        {x: 0, y: 0, class: "plot-ylabel", transform: `translate(14 ${m.top + ph / 2}) rotate(-90)`},
        svg,
      ).textContent = this.opts.yLabel;
    }

    const lines = svgEl("g", {class: "plot-lines"}, svg);
    for (const s of this.series) {
      if (s.points.length === 0) continue;
      const d = s.points.map((p, i) => `${i ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`);
      svgEl(
        "path",
        {d: d.join(""), stroke: s.color, class: s.faint ? "plot-line faint" : "plot-line", "data-series": s.name,
         "data-points": String(s.points.length)},
        lines,
      );
      if (s.dash) lines.lastChild.setAttribute("stroke-dasharray", s.dash);
      if (s.points.length <= 40) {
        for (const p of s.points) {
          svgEl("circle", {cx: sx(p[0]), cy: sy(p[1]), r: 2.5, fill: s.color, class: "plot-dot"}, lines);
        }
      }
    }

    // Legend, top-right inside the frame, one row per series.
    if (this.series.length > 1 || this.opts.legend) {
      const lg = svgEl("g", {class: "plot-legend"}, svg);
      const rowH = 16;
      const width = Math.min(pw - 10, 12 + 7 * Math.max(...this.series.map((s) => s.name.length)) + 24);
      const height = rowH * this.series.length + 6;
      const x0 = m.left + pw - width - 6;
      // Top-right unless more points fall there than in the bottom-right corner.
      const inBox = (y0) =>
        all.filter(([x, y]) => sx(x) >= x0 && sy(y) >= y0 && sy(y) <= y0 + height).length;
      const top = inBox(m.top + 6) <= inBox(m.top + ph - height - 6) ? m.top + 6 : m.top + ph - height - 6;
      svgEl("rect", {x: x0, y: top, width, height, class: "plot-legend-bg"}, lg);
      this.series.forEach((s, i) => {
        const y = top + rowH * (i + 1) - 3;
        svgEl("line", {x1: x0 + 6, x2: x0 + 22, y1: y - 4, y2: y - 4, stroke: s.color, class: "plot-legend-swatch"}, lg);
        svgEl("text", {x: x0 + 28, y, class: "plot-legend-text"}, lg).textContent = s.name;
      });
    }
    this.cursor = svgEl("line", {class: "plot-cursor", y1: m.top, y2: m.top + ph, x1: -10, x2: -10}, svg);
  }

  _hover(e) {
    const g = this.geom;
    if (!g) return;
    const rect = this.svg.getBoundingClientRect();
    const px = e.clientX - rect.left;
    if (px < g.m.left || px > g.m.left + g.pw) return this._unhover();
    const x = g.xt.lo + ((px - g.m.left) / g.pw) * (g.xt.hi - g.xt.lo);
    const rows = [];
    let nearestX = null;
    for (const s of this.series) {
      if (!s.points.length) continue;
      let best = s.points[0];
      for (const p of s.points) if (Math.abs(p[0] - x) < Math.abs(best[0] - x)) best = p;
      if (nearestX === null || Math.abs(best[0] - x) < Math.abs(nearestX - x)) nearestX = best[0];
      rows.push({s, p: best});
    }
    if (nearestX === null) return this._unhover();
    const cx = g.sx(nearestX);
    this.cursor.setAttribute("x1", cx);
    this.cursor.setAttribute("x2", cx);
    this.tip.innerHTML = "";
    const head = document.createElement("div");
    head.className = "plot-tip-head";
    head.textContent = `${this.opts.xLabel} ${formatValue(nearestX)}`;
    this.tip.appendChild(head);
    for (const {s, p} of rows) {
      const row = document.createElement("div");
      const sw = document.createElement("span");
      sw.className = "swatch";
      sw.style.background = s.color;
      row.appendChild(sw);
      row.appendChild(document.createTextNode(`${s.name}: ${formatValue(p[1])}`));
      if (p[0] !== nearestX) row.appendChild(document.createTextNode(` (at ${formatValue(p[0])})`));
      this.tip.appendChild(row);
    }
    this.tip.hidden = false;
    const left = cx + 12 + 180 > g.W ? cx - 12 - 180 : cx + 12;
    this.tip.style.left = `${Math.max(0, left)}px`;
    this.tip.style.top = `${g.m.top + 4}px`;
  }

  _unhover() {
    this.tip.hidden = true;
    if (this.cursor) {
      this.cursor.setAttribute("x1", -10);
      this.cursor.setAttribute("x2", -10);
    }
  }
}

window.LinePlot = LinePlot;
window.PLOT_COLORS = PLOT_COLORS;
