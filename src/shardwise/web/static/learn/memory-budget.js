// Widget 1: per-device training state against the ZeRO stage (numbers: /api/learn/memory-budget).
import { api, count, decades, fill, frame, gb, h, listScale, s, ticks, widget } from "/static/learn/learn-common.js";

frame("memory-budget");

const PARTS = [["weights", "var(--weights)"], ["grads", "var(--grads)"], ["optimizer", "var(--optimizer)"]];
const STAGE_COLOURS = ["#9aa3b5", "var(--grads)", "var(--accent)", "var(--optimizer)"];
const paramsScale = listScale(decades(1e8, 1e12));
// 1, 2, 3, 4, 6, 8, 12, … 768, 1024: powers of two and their 1.5× in between.
const devicesScale = listScale([1, ...[...Array(10).keys()].flatMap((k) => [2 ** (k + 1), 3 * 2 ** k])].filter((n) => n <= 1024).sort((a, b) => a - b));
document.getElementById("params").max = paramsScale.max;
document.getElementById("devices").max = devicesScale.max;

widget({
  defaults: { params: 7.5e9, devices: 64, stage: 0 },
  toControl: { params: paramsScale.toControl, devices: devicesScale.toControl },
  fromControl: { params: paramsScale.fromControl, devices: devicesScale.fromControl },
  load: (st) => api("/api/learn/memory-budget", st),
  draw,
});

function draw(d) {
  const svg = document.getElementById("chart");
  fill(svg, bar(d), curve(d));
  fill(document.getElementById("stages"),
    h("thead", {}, h("tr", {}, h("th", {}, "stage"), h("th", {}, "GB / device"))),
    h("tbody", {}, d.stages.map((row) => h("tr", { class: row.stage === d.stage ? "current" : null, "data-stage": row.stage },
      h("td", {}, `${row.stage} · ${row.sharded}`),
      h("td", {}, row.stage === d.stage ? h("strong", {}, gb(row.bytes_per_device)) : gb(row.bytes_per_device))))));
  const p = d.per_device;
  const fits = p.total <= d.budget_bytes;
  const fewest = d.fewest_devices_that_fit;
  fill(document.getElementById("caption"),
    h("strong", {}, `${count(d.params)} parameters on ${d.devices} device${d.devices > 1 ? "s" : ""}, ZeRO stage ${d.stage}: `),
    h("span", { id: "total" }, `${gb(p.total)} GB`), " per device (weights ", gb(p.weights), ", gradients ", gb(p.grads),
    ", optimizer ", gb(p.optimizer), " GB) against ", gb(d.baseline.total), ` GB unsharded — ${fits ? "fits" : "does not fit"} in ${gb(d.budget_bytes, 0)} GB. `,
    fewest === null
      ? `At stage ${d.stage} no N up to 1024 brings it under ${gb(d.budget_bytes, 0)} GB.`
      : `At stage ${d.stage} it fits from N = ${fewest} on.`,
    h("span", { class: "note" }, " GB = 10⁹ bytes."));
}

/** Left panel: the stacked bar, the 16Ψ ghost behind it, the budget line. */
function bar(d) {
  const x0 = 70, w = 150, top = 30, bottom = 330;
  const ghost = d.baseline.total;
  const need = Math.max(d.per_device.total, d.budget_bytes);
  const domain = Math.min(ghost, 4 * need) * 1.08;
  const y = (bytes) => bottom - (Math.min(bytes, domain) / domain) * (bottom - top);
  const g = s("g", { "aria-label": "stacked bar" });
  for (const t of ticks(domain / 1e9, 5)) {
    g.append(s("line", { x1: x0 - 6, x2: x0 + w + 40, y1: y(t * 1e9), y2: y(t * 1e9), class: "axis" }),
      s("text", { x: x0 - 10, y: y(t * 1e9) + 4, "text-anchor": "end", class: "muted" }, `${t}`));
  }
  g.append(s("text", { x: 16, y: 180, transform: "rotate(-90 16 180)", "text-anchor": "middle", class: "muted" }, "GB per device"));
  const clipped = ghost > domain;
  g.append(s("rect", { x: x0, y: y(ghost), width: w, height: bottom - y(ghost), fill: "var(--muted)", opacity: 0.13, rx: 4 }));
  g.append(s("text", { x: x0 + w / 2, y: y(ghost) + 16, "text-anchor": "middle", class: "muted" },
    `16Ψ = ${gb(ghost, ghost >= 1e12 ? 0 : 2)} GB${clipped ? " (cut)" : ""}`));
  if (clipped) g.append(s("path", { d: `M${x0 - 4} ${y(ghost) + 26} l${w / 4 + 4} -8 l${w / 4} 8 l${w / 4} -8 l${w / 4 + 4} 8`, stroke: "var(--bg)", "stroke-width": 5, fill: "none" }));
  let base = 0;
  for (const [key, colour] of PARTS) {
    const value = d.per_device[key];
    const yTop = y(base + value), yBase = y(base);
    g.append(s("rect", { x: x0 + 18, y: yTop, width: w - 36, height: Math.max(0, yBase - yTop), fill: colour, "data-part": key },
      s("title", {}, `${key}: ${gb(value)} GB${d.per_device.partitioned[key] ? " (partitioned)" : " (replicated)"}`)));
    base += value;
  }
  g.append(s("text", { x: x0 + w / 2, y: y(d.per_device.total) - 8, "text-anchor": "middle", "font-weight": 700 }, `${gb(d.per_device.total)} GB`));
  const yb = y(d.budget_bytes);
  g.append(s("line", { x1: x0 - 6, x2: x0 + w + 40, y1: yb, y2: yb, stroke: "var(--error)", "stroke-dasharray": "6 4", "stroke-width": 2 }),
    s("text", { x: x0 + w + 40, y: yb - 6, "text-anchor": "end", fill: "var(--error)", style: "fill:var(--error)" }, `${gb(d.budget_bytes, 0)} GB device`));
  g.append(s("line", { x1: x0 - 6, x2: x0 + w + 40, y1: bottom, y2: bottom, stroke: "var(--muted)" }));
  return g;
}

/** Right panel: per-device GB against N (log–log) for the four stages, current N marked. */
function curve(d) {
  const left = 380, right = 740, top = 30, bottom = 330;
  const all = d.curve.flatMap((pt) => pt.bytes_per_device).concat([d.budget_bytes]);
  const lo = Math.log10(Math.min(...all)) - 0.1, hi = Math.log10(Math.max(...all)) + 0.1;
  const x = (n) => left + (Math.log2(n) / 10) * (right - left);
  const y = (bytes) => bottom - ((Math.log10(bytes) - lo) / (hi - lo)) * (bottom - top);
  const g = s("g", { "aria-label": "per-device memory against devices" });
  g.append(s("text", { x: left, y: 16, "font-weight": 600 }, "GB per device vs N (log–log)"));
  for (let e = Math.ceil(lo); e <= Math.floor(hi); e++) {
    g.append(s("line", { x1: left, x2: right, y1: y(10 ** e), y2: y(10 ** e), class: "axis" }),
      s("text", { x: left - 6, y: y(10 ** e) + 4, "text-anchor": "end", class: "muted" }, gb(10 ** e, e >= 9 ? 0 : 9 - e)));
  }
  for (const pt of d.curve) {
    g.append(s("text", { x: x(pt.devices), y: bottom + 16, "text-anchor": "middle", class: "muted" }, pt.devices));
  }
  g.append(s("text", { x: (left + right) / 2, y: bottom + 34, "text-anchor": "middle", class: "muted" }, "devices N"));
  const yb = y(d.budget_bytes);
  g.append(s("line", { x1: left, x2: right, y1: yb, y2: yb, stroke: "var(--error)", "stroke-dasharray": "6 4" }));
  for (let stage = 0; stage < 4; stage++) {
    const points = d.curve.map((pt) => `${x(pt.devices).toFixed(1)},${y(pt.bytes_per_device[stage]).toFixed(1)}`).join(" ");
    const last = d.curve[d.curve.length - 1];
    g.append(s("polyline", { points, fill: "none", stroke: STAGE_COLOURS[stage], "stroke-width": stage === d.stage ? 3.5 : 1.8, opacity: stage === d.stage ? 1 : 0.75 }),
      s("text", { x: right + 4, y: y(last.bytes_per_device[stage]) + 4, style: `fill:${STAGE_COLOURS[stage]}`, "font-size": 11 }, `z${stage}`));
  }
  const cx = x(d.devices), cy = y(d.per_device.total);
  g.append(s("line", { x1: cx, x2: cx, y1: top, y2: bottom, stroke: "var(--muted)", "stroke-dasharray": "2 3" }),
    s("circle", { cx, cy, r: 6, fill: STAGE_COLOURS[d.stage], stroke: "#fff", "stroke-width": 2 }));
  return g;
}
