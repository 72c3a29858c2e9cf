/* Loss-curve chart in plain SVG: every job's train (solid) and validation (dashed) curve on
   shared axes, early exits marked with a cross at the step the job stopped, non-finite losses
   (null) as a gap in the line and a red tick at the top. No dependencies. */
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";

function svgEl(tag, attrs) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  return el;
}

/* Round tick values: about n of them between lo and hi. */
function niceTicks(lo, hi, n) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / Math.max(1, n);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
  return out;
}

function fmtTick(v) {
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 10000 || a < 0.01) return v.toExponential(1);
  return String(+v.toPrecision(3));
}

/* curves: [{key, job, split, color, points: [[step, loss|null]], exit: {reason, step} | null,
   dim: bool, bold: bool}]. opts: {logY}. Draws into the <svg> element `svg`. */
function drawLossChart(svg, curves, opts) {
  const W = 900, H = 380, L = 56, R = 12, T = 14, B = 34;
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("preserveAspectRatio", "none");
  const logY = !!(opts && opts.logY);
  let xMax = 1, yLo = Infinity, yHi = -Infinity, total = 0;
  for (const c of curves) {
    for (const [s, y] of c.points) {
      if (s > xMax) xMax = s;
      if (y === null || !isFinite(y) || (logY && y <= 0)) continue;
      if (y < yLo) yLo = y;
      if (y > yHi) yHi = y;
    }
    total += c.points.length;
  }
  svg.dataset.points = String(total);
  // A few spikes (or the first steps) must not flatten every other curve: above a margin over
  // the 99th percentile the chart clips, draws those points on its top edge and says so.
  const vals = [];
  for (const c of curves) for (const [, y] of c.points) if (y !== null && isFinite(y) && !(logY && y <= 0)) vals.push(y);
  let clipped = false;
  if (!logY && vals.length > 50) {
    vals.sort((a, b) => a - b);
    const q = vals[Math.floor(0.99 * (vals.length - 1))];
    const cap = q + (q - vals[0]) * 0.25;
    if (yHi > cap && cap > yLo) { yHi = cap; clipped = true; }
  }
  svg.dataset.clipped = String(clipped);
  if (!isFinite(yLo)) { yLo = 0; yHi = 1; }
  if (yHi - yLo < 1e-9) { yHi += 0.5; yLo = Math.max(logY ? yLo / 2 : yLo - 0.5, logY ? 1e-9 : -Infinity); }
  const fy = logY ? Math.log10 : (v) => v;
  const y0 = fy(yLo), y1 = fy(yHi), pad = (y1 - y0) * 0.05;
  const sx = (s) => L + (s / xMax) * (W - L - R);
  const top = yHi + pad * 0.999; // clipped points sit on the top edge (linear scale only)
  const sy = (v) => T + (1 - (fy(logY ? v : Math.min(v, top)) - (y0 - pad)) / (y1 - y0 + 2 * pad)) * (H - T - B);

  const grid = svgEl("g", { class: "grid" });
  for (const t of niceTicks(0, xMax, 8)) {
    grid.appendChild(svgEl("line", { x1: sx(t), x2: sx(t), y1: T, y2: H - B }));
    const lab = svgEl("text", { x: sx(t), y: H - B + 16, "text-anchor": "middle" });
    lab.textContent = fmtTick(t);
    grid.appendChild(lab);
  }
  const yTicks = logY
    ? niceTicks(y0 - pad, y1 + pad, 5).map((e) => Math.pow(10, e))
    : niceTicks(yLo - (yHi - yLo) * 0.05, yHi + (yHi - yLo) * 0.05, 6);
  for (const t of yTicks) {
    if (logY && t <= 0) continue;
    const y = sy(t);
    if (y < T - 1 || y > H - B + 1) continue;
    grid.appendChild(svgEl("line", { x1: L, x2: W - R, y1: y, y2: y }));
    const lab = svgEl("text", { x: L - 6, y: y + 4, "text-anchor": "end" });
    lab.textContent = fmtTick(t);
    grid.appendChild(lab);
  }
  const xl = svgEl("text", { x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle", class: "axis-label" });
  xl.textContent = "step";
  grid.appendChild(xl);
  const yl = svgEl("text", { x: 12, y: (T + H - B) / 2, "text-anchor": "middle", class: "axis-label",
                             transform: `rotate(-90 12 ${(T + H - B) / 2})` });
  yl.textContent = logY ? "loss (log)" : "loss";
  grid.appendChild(yl);
  if (clipped) {
    const note = svgEl("text", { x: W - R - 6, y: T + 14, "text-anchor": "end", class: "clip-note" });
    note.textContent = `clipped above ${fmtTick(yHi)}: log scale shows all`;
    grid.appendChild(note);
  }
  svg.appendChild(grid);
  svg.appendChild(svgEl("rect", { x: L, y: T, width: W - L - R, height: H - T - B, class: "frame" }));

  const lines = svgEl("g", { class: "curves" });
  const marks = svgEl("g", { class: "marks" });
  const ordered = curves.slice().sort((a, b) => (a.bold ? 1 : 0) - (b.bold ? 1 : 0));
  for (const c of ordered) {
    let d = "", pen = false;
    for (const [s, y] of c.points) {
      if (y === null || !isFinite(y) || (logY && y <= 0)) {
        pen = false;
        const tick = svgEl("line", { x1: sx(s), x2: sx(s), y1: T, y2: T + 8, class: "nonfinite" });
        marks.appendChild(tick);
        continue;
      }
      d += (pen ? "L" : "M") + sx(s).toFixed(1) + "," + sy(y).toFixed(1);
      pen = true;
    }
    const path = svgEl("path", {
      d: d || "M0,0", stroke: c.color, class: `curve ${c.split}${c.dim ? " dim" : ""}${c.bold ? " bold" : ""}`,
      "data-job": c.job, "data-split": c.split, "data-points": c.points.length,
    });
    const title = svgEl("title");
    title.textContent = `${c.label} ${c.split}`;
    path.appendChild(title);
    lines.appendChild(path);
    if (c.exit && c.split === "train") {
      const last = c.points.filter((p) => p[1] !== null && isFinite(p[1])).pop();
      const step = c.exit.step != null ? c.exit.step : (last ? last[0] : 0);
      const yv = last ? last[1] : yHi;
      const x = sx(step), y = sy(yv), r = 6;
      const g = svgEl("g", { class: "exit-marker", "data-job": c.job, "data-reason": c.exit.reason });
      g.appendChild(svgEl("path", { d: `M${x - r},${y - r}L${x + r},${y + r}M${x - r},${y + r}L${x + r},${y - r}`,
                                    stroke: c.color }));
      const t = svgEl("title");
      t.textContent = `${c.label}: early exit (${c.exit.reason}) at step ${step}`;
      g.appendChild(t);
      marks.appendChild(g);
    }
  }
  svg.appendChild(lines);
  svg.appendChild(marks);
}

/* One colour per job, spread around the hue circle (golden angle) so 60 stay apart. */
function jobColor(index) {
  return `hsl(${(index * 137.508) % 360}, 65%, 45%)`;
}

/* A timeline of placements: one row per GPU, a bar per placement from planned start to end. */
function drawTimeline(svg, rows, opts) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const rowH = 26, L = 150, R = 12, T = 22, W = 900;
  const H = T + Math.max(1, rows.length) * rowH + 8;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const now = opts.now;
  let t0 = now, t1 = now + 60e3;
  for (const r of rows) for (const p of r.bars) { t0 = Math.min(t0, p.start); t1 = Math.max(t1, p.end); }
  t1 += (t1 - t0) * 0.03;
  const sx = (t) => L + ((t - t0) / (t1 - t0)) * (W - L - R);
  const axis = svgEl("g", { class: "grid" });
  for (const t of niceTicks(0, (t1 - t0) / 60e3, 6)) {
    const x = sx(t0 + t * 60e3);
    axis.appendChild(svgEl("line", { x1: x, x2: x, y1: T - 4, y2: H - 8 }));
    const lab = svgEl("text", { x, y: T - 8, "text-anchor": "middle" });
    lab.textContent = `+${fmtTick(t)} min`;
    axis.appendChild(lab);
  }
  svg.appendChild(axis);
  rows.forEach((r, i) => {
    const y = T + i * rowH;
    const lab = svgEl("text", { x: 6, y: y + rowH / 2 + 4, class: "row-label" });
    lab.textContent = r.label;
    svg.appendChild(lab);
    svg.appendChild(svgEl("line", { x1: L, x2: W - R, y1: y + rowH, y2: y + rowH, class: "row-sep" }));
    for (const p of r.bars) {
      const x = sx(p.start), w = Math.max(3, sx(p.end) - x);
      const g = svgEl("g", { class: `bar ${p.state}`, "data-task": p.task });
      g.appendChild(svgEl("rect", { x, y: y + 3, width: w, height: rowH - 6, rx: 3, fill: p.color }));
      const t = svgEl("text", { x: x + 4, y: y + rowH / 2 + 4, class: "bar-label" });
      t.textContent = p.label;
      g.appendChild(t);
      const title = svgEl("title");
      title.textContent = p.title;
      g.appendChild(title);
      svg.appendChild(g);
    }
  });
  const xn = sx(now);
  svg.appendChild(svgEl("line", { x1: xn, x2: xn, y1: T - 4, y2: H - 4, class: "now" }));
}

window.LoraplexChart = { drawLossChart, drawTimeline, jobColor };
