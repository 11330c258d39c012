// Widget 6: a pipeline schedule on a device × time grid (/api/learn/pipeline).
import { api, fill, frame, h, pct, player, s, widget } from "/static/learn/learn-common.js";

frame("pipeline-grid");

const COLOUR = { F: "var(--forward)", B: "var(--backward)", W: "var(--wgrad)" };
const slider = document.getElementById("time");
let now = Infinity;

const w = widget({
  defaults: { schedule: "1f1b", p: 4, m: 8, v: 2, slowback: false },
  load: (st) => api("/api/learn/pipeline", { schedule: st.schedule, p: st.p, m: st.m, v: st.v, backward: st.slowback ? 2 : 1 }),
  onInput: () => { now = Infinity; },
  draw,
});

slider.addEventListener("input", () => { now = Number(slider.value); w.redraw(); });
player(document.getElementById("play"), (first) => {
  const d = w.data;
  if (!d) return false;
  if (first && now >= d.makespan) now = 0;
  now = Math.min(d.makespan, (Number.isFinite(now) ? now : 0) + Math.max(0.5, d.makespan / 60));
  w.redraw();
  return now < d.makespan;
}, 120);

function draw(d) {
  slider.max = d.makespan;
  const t = Math.min(now, d.makespan);
  slider.value = t;
  document.getElementById("time-out").textContent = `${t} / ${d.makespan}`;
  const left = 64, right = 748, top = 8, rowH = Math.max(20, Math.min(34, 220 / d.p));
  const width = right - left, height = top + rowH * d.p + 30;
  const x = (time) => left + (time / d.makespan) * width;
  const svg = document.getElementById("grid");
  svg.setAttribute("viewBox", `0 0 760 ${height}`);
  const g = s("g", {});
  g.append(s("defs", {}, s("pattern", { id: "idle", width: 6, height: 6, patternUnits: "userSpaceOnUse", patternTransform: "rotate(45)" },
    s("rect", { width: 6, height: 6, fill: "#fff" }), s("rect", { width: 3, height: 6, fill: "#e4e7ee" }))));
  for (let stage = 0; stage < d.p; stage++) {
    const y = top + stage * rowH;
    g.append(s("rect", { x: left, y: y + 1, width: x(t) - left, height: rowH - 2, fill: "url(#idle)" }),
      s("text", { x: left - 8, y: y + rowH / 2 + 4, "text-anchor": "end", class: "muted" }, `stage ${stage}`));
  }
  const label = d.makespan / (d.p * d.m) > 0.35 || d.makespan < 90;
  for (const e of d.events) {
    if (e.start >= t) continue;
    const y = top + e.stage * rowH, x0 = x(e.start), x1 = x(Math.min(e.end, t));
    const wd = Math.max(0.5, x1 - x0 - 1);
    g.append(s("rect", { x: x0 + 0.5, y: y + 1, width: wd, height: rowH - 2, rx: 2, fill: COLOUR[e.kind], opacity: e.chunk % 2 ? 0.7 : 1, "data-kind": e.kind,
      ...(e.pair ? { stroke: "var(--fg)", "stroke-width": 1.5, "data-pair": "" } : {}) },
      s("title", {}, `stage ${e.stage}: ${e.kind} of micro-batch ${e.micro_batch}${d.v > 1 ? `, chunk ${e.chunk}` : ""}${e.pair ? " (overlapped F&B pair)" : ""}, t = ${e.start}–${e.end}`)));
    if (label && wd > 11) g.append(s("text", { x: x0 + wd / 2 + 0.5, y: y + rowH / 2 + 4, "text-anchor": "middle", "font-size": 10, style: "fill:#fff", "pointer-events": "none" }, e.micro_batch));
  }
  const bottom = top + rowH * d.p;
  const step = d.makespan > 60 ? 10 : d.makespan > 24 ? 5 : 2;
  for (let tick = 0; tick <= d.makespan; tick += step) {
    g.append(s("text", { x: x(tick), y: bottom + 16, "text-anchor": "middle", "font-size": 10, class: "muted" }, tick));
  }
  if (t < d.makespan) g.append(s("line", { x1: x(t), x2: x(t), y1: top, y2: bottom, stroke: "var(--error)", "stroke-width": 2 }));
  g.append(s("text", { x: right, y: bottom + 28, "text-anchor": "end", "font-size": 10, class: "muted" }, "time (forward of one micro-batch on one stage = 1)"));
  fill(svg, g);

  const closed = d.closed_form_bubble;
  const num = (x) => Number(x.toPrecision(6));
  fill(document.getElementById("stats"),
    h("div", {}, h("span", {}, "bubble (simulated)"), h("b", { id: "bubble" }, pct(d.bubble_fraction))),
    h("div", {}, h("span", {}, "bubble (closed form)"), h("b", { id: "closed" }, closed === null ? "–" : pct(closed))),
    h("div", {}, h("span", {}, "makespan"), h("b", { id: "makespan" }, `${num(d.makespan)}`)),
    h("div", {}, h("span", {}, "peak in flight per stage"), h("b", { id: "peak" }, d.peak_in_flight.map(num).join(" · "))));
  const chunks = d.v > 1 ? `, v = ${d.v}${d.placement === "v" ? " in a V" : ""} (a chunk's box takes 1/${d.v} of the stage's time)` : "";
  fill(document.getElementById("caption"),
    `${d.schedule} with P = ${d.p}, M = ${d.m}${chunks}; per stage forward ${d.t_f}, backward ${d.t_b}${d.t_w === null ? "" : ` split into B ${num(d.t_b - d.t_w)} and W ${d.t_w}`}. `,
    closed === null ? "This schedule has no closed form for so few micro-batches. "
      : Math.abs(d.bubble_fraction - closed) < 1e-9 ? "The simulated bubble equals the schedule's closed form. "
      : `The simulated bubble ${d.bubble_fraction.toFixed(4)} differs from the closed form ${closed.toFixed(4)}. `,
    `Stage 0 holds at most ${num(d.peak_in_flight[0])} micro-batches' activations at once${d.v > 1 ? " (a chunk counts 1/v)" : ""}.`);
}
