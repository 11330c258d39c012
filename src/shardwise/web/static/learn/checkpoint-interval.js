// Widget 9: how often to checkpoint (/api/learn/checkpoint-interval): time lost against the interval.
import { api, count, decades, fill, frame, h, int, listScale, pct, s, ticks, widget } from "/static/learn/learn-common.js";

frame("checkpoint-interval");

const GPUS = Array.from({ length: 15 }, (_, k) => 8 * 2 ** k);  // 8 … 131,072
const MTBF = decades(1000, 1e6, [1, 2, 3, 5, 7]).concat([50677]).sort((a, b) => a - b);
const STALL = decades(1, 1000, [1, 2, 3, 5, 7]);
const scales = { gpus: listScale(GPUS), mtbf_gpu_hours: listScale(MTBF), stall_s: listScale(STALL) };
for (const [id, key] of [["gpus", "gpus"], ["mtbf", "mtbf_gpu_hours"], ["stall", "stall_s"]]) {
  const input = document.getElementById(id);
  input.min = 0;
  input.max = scales[key].max;
}

// seconds as the page reads them: 45 s, 12.5 min, 3.1 h
const time = (sec) => (sec < 120 ? `${+sec.toPrecision(3)} s` : sec < 7200 ? `${+(sec / 60).toPrecision(3)} min` : `${+(sec / 3600).toPrecision(3)} h`);

widget({
  defaults: { gpus: 16384, mtbf_gpu_hours: 50677, stall_s: 30, restart_min: 10 },
  toControl: Object.fromEntries(Object.entries(scales).map(([k, v]) => [k, v.toControl])),
  fromControl: Object.fromEntries(Object.entries(scales).map(([k, v]) => [k, v.fromControl])),
  load: (st) => api("/api/learn/checkpoint-interval", st),
  draw,
});

function draw(d, st) {
  document.getElementById("gpus-out").textContent = int(st.gpus);
  document.getElementById("mtbf-out").textContent = count(st.mtbf_gpu_hours);
  document.getElementById("stall-out").textContent = time(d.stall_s);
  const left = 64, right = 740, top = 16, bottom = 300;
  const lo = Math.log(d.interval_s[0]), hi = Math.log(d.interval_s[d.interval_s.length - 1]);
  const x = (tau) => left + ((Math.log(tau) - lo) / (hi - lo)) * (right - left);
  const ymax = Math.max(3 * d.daly_total, 0.02);
  const y = (v) => bottom - (Math.min(v, ymax * 1.05) / ymax) * (bottom - top);
  const g = s("g", {});
  for (const t of ticks(ymax, 5)) {
    g.append(s("line", { x1: left, x2: right, y1: y(t), y2: y(t), class: "axis" }),
      s("text", { x: left - 8, y: y(t) + 4, "text-anchor": "end", class: "muted" }, pct(t, t < 0.1 ? 1 : 0)));
  }
  for (const tau of [1, 10, 60, 600, 3600, 36000, 360000]) {
    if (tau < d.interval_s[0] || tau > d.interval_s[d.interval_s.length - 1]) continue;
    g.append(s("text", { x: x(tau), y: bottom + 18, "text-anchor": "middle", class: "muted" }, time(tau)));
  }
  g.append(s("text", { x: (left + right) / 2, y: bottom + 40, "text-anchor": "middle", class: "muted" }, "interval between checkpoints τ (log scale)"),
    s("text", { x: 14, y: (top + bottom) / 2, transform: `rotate(-90 14 ${(top + bottom) / 2})`, "text-anchor": "middle", class: "muted" }, "wall time lost per useful time"));
  const path = (values) => values.map((v, i) => `${i ? "L" : "M"}${x(d.interval_s[i]).toFixed(1)},${y(v).toFixed(1)}`).join("");
  g.append(s("path", { d: path(d.checkpoint), fill: "none", stroke: "var(--optimizer)", "stroke-width": 2.5, "stroke-dasharray": "7 4" }),
    s("path", { d: path(d.lost), fill: "none", stroke: "var(--grads)", "stroke-width": 2.5, "stroke-dasharray": "7 4" }),
    s("path", { d: path(d.restart), fill: "none", stroke: "var(--activations)", "stroke-width": 2.5, "stroke-dasharray": "2 4" }),
    s("path", { d: path(d.total), fill: "none", stroke: "var(--accent)", "stroke-width": 3.5 }));
  const yx = x(d.young_interval_s);
  g.append(s("line", { x1: yx, x2: yx, y1: top, y2: bottom, stroke: "var(--muted)", "stroke-dasharray": "3 3" }),
    s("text", { x: yx + 5, y: top + 12, class: "muted" }, "Young √(2δM)"));
  const dx = x(d.daly_interval_s), dy = y(d.daly_total);
  g.append(s("line", { x1: dx, x2: dx, y1: dy, y2: bottom, stroke: "var(--fg)", "stroke-dasharray": "2 3" }),
    s("circle", { cx: dx, cy: dy, r: 8, fill: "var(--accent)", stroke: "#fff", "stroke-width": 3 },
      s("title", {}, `Daly's interval ${time(d.daly_interval_s)}: ${pct(d.daly_total, 2)} lost`)),
    s("text", { x: Math.min(dx + 12, right - 150), y: dy - 12, "font-weight": 700 }, `Daly: ${time(d.daly_interval_s)}`));
  fill(document.getElementById("chart"), g);
  fill(document.getElementById("stats"),
    h("div", {}, h("span", {}, "a failure every"), h("b", { id: "mtbf" }, time(d.job_mtbf_s))),
    h("div", {}, h("span", {}, "interruptions a day"), h("b", { id: "per-day" }, d.interruptions_per_day.toFixed(1))),
    h("div", {}, h("span", {}, "checkpoint every (Daly)"), h("b", { id: "interval" }, time(d.daly_interval_s))),
    h("div", {}, h("span", {}, "Young's √(2δM)"), h("b", { id: "young" }, time(d.young_interval_s))),
    h("div", {}, h("span", {}, "goodput"), h("b", { id: "goodput" }, pct(d.goodput))));
  fill(document.getElementById("caption"),
    `${int(d.gpus)} GPUs at ${int(d.mtbf_gpu_hours)} GPU-hours each fail every ${time(d.job_mtbf_s)}. `,
    `A ${time(d.stall_s)} checkpoint every ${time(d.daly_interval_s)} (Daly; Young says ${time(d.young_interval_s)}) `,
    `loses ${pct(d.daly_total, 1)} of the useful time, the minimum of the curve (${pct(d.best_total, 1)} at the best grid point, ${time(d.best_interval_s)}), `,
    `so ${pct(d.goodput)} of the wall time trains. The restart (${time(d.restart_s)}) lifts the whole curve without moving its minimum.`);
}
