// Widget 10: a run's timeline (/api/learn/run-timeline): one simulated run's events and each
// checkpoint policy's goodput. Every number comes from the API (estimate.goodput_sim); this
// file only scales and draws them.
import { api, fill, frame, h, int, listScale, pct, s, ticks, widget } from "/static/learn/learn-common.js";

frame("run-timeline");

const GPUS = Array.from({ length: 8 }, (_, k) => 1024 * 2 ** k);  // 1,024 … 131,072
const scale = listScale(GPUS);
document.getElementById("gpus").min = 0;
document.getElementById("gpus").max = scale.max;

const time = (sec) => (sec < 120 ? `${+sec.toPrecision(3)} s` : sec < 7200 ? `${+(sec / 60).toPrecision(3)} min` : `${+(sec / 3600).toPrecision(3)} h`);

const view = widget({
  defaults: { policy: "synchronous", gpus: 16384, days: 2, straggler: 1.05, host_mtbf_hours: 0, seed: 0 },
  toControl: { gpus: scale.toControl },
  fromControl: { gpus: scale.fromControl },
  load: (st) => api("/api/learn/run-timeline", st),
  draw,
});
document.getElementById("another").addEventListener("click", () => view.update({ seed: view.state.seed + 1 }));

function draw(d, st) {
  document.getElementById("gpus-out").textContent = int(st.gpus);
  document.getElementById("seed").textContent = String(d.seed + 1);
  const left = 110, right = 740, hours = d.wall_s / 3600;
  const x = (sec) => left + (sec / d.wall_s) * (right - left);
  const lanes = { training: 20, checkpoints: 62, failures: 98, restarts: 134, redone: 170 };
  const g = s("g", {});
  for (const [name, y] of Object.entries(lanes)) {
    g.append(s("text", { x: left - 8, y: y + 16, "text-anchor": "end", class: "muted" }, name));
  }
  for (const t of ticks(hours, 6)) {
    g.append(s("line", { x1: x(t * 3600), x2: x(t * 3600), y1: 14, y2: 200, class: "axis" }),
      s("text", { x: x(t * 3600), y: 218, "text-anchor": "middle", class: "muted" }, `${t} h`));
  }
  g.append(s("text", { x: (left + right) / 2, y: 240, "text-anchor": "middle", class: "muted" }, "wall-clock time since the start"));
  const band = (a, b, y, colour, cls, height = 24) => s("rect", { x: x(a), y, width: Math.max(x(b) - x(a), 0.8), height, fill: colour, class: cls });
  for (const [a, b] of d.work) {
    g.append(band(a, b, lanes.training, "var(--accent)", "work"));
    // the straggler's share of the window, drawn at its end
    g.append(band(b - d.straggler_share * (b - a), b, lanes.training + 16, "var(--logits)", "straggler", 8));
  }
  for (const t of d.checkpoints) {
    g.append(s("line", { x1: x(t), x2: x(t), y1: lanes.checkpoints, y2: lanes.checkpoints + 24, stroke: "var(--optimizer)", "stroke-width": 1, class: "checkpoint" }));
  }
  for (const f of d.failures) {
    const cx = x(f.t), y = lanes.failures;
    g.append(s("path", { d: `M${cx - 6},${y + 22}L${cx + 6},${y + 22}L${cx},${y + 4}Z`, fill: "var(--error)", class: "failure" },
      s("title", {}, `${f.cls} failure at ${time(f.t)}: recovered from ${f.recovery}, ${time(f.lost_s)} of work redone, ${time(f.restart_s)} to restart`)));
  }
  for (const [a, b] of d.restarts) g.append(band(a, b, lanes.restarts, "var(--muted)", "restart"));
  for (const [a, b] of d.lost) g.append(band(a, b, lanes.redone, "var(--grads)", "redone"));
  fill(document.getElementById("chart"), g);

  const p = s("g", {});
  const bx = (v) => 150 + v * (right - 150);
  for (const t of [0, 0.25, 0.5, 0.75, 1]) {
    p.append(s("line", { x1: bx(t), x2: bx(t), y1: 6, y2: 140, class: "axis" }),
      s("text", { x: bx(t), y: 158, "text-anchor": "middle", class: "muted" }, pct(t, 0)));
  }
  d.policies.forEach((row, i) => {
    const y = 12 + i * 32, chosen = row.name === d.policy;
    p.append(s("text", { x: 142, y: y + 15, "text-anchor": "end", "font-weight": chosen ? 700 : 400 }, row.name),
      s("rect", { x: bx(0), y, width: bx(row.mean) - bx(0), height: 20, fill: chosen ? "var(--accent)" : "var(--accent-soft)", class: "policy" },
        s("title", {}, `${row.name}: mean ${pct(row.mean)}, p10–p90 ${pct(row.p10)}–${pct(row.p90)}, checkpoint every ${time(row.interval_s)}`)),
      s("line", { x1: bx(row.p10), x2: bx(row.p90), y1: y + 10, y2: y + 10, stroke: "var(--fg)", "stroke-width": 2 }),
      s("text", { x: Math.min(bx(row.p90) + 8, right - 40), y: y + 15, class: "muted" }, pct(row.mean)));
  });
  fill(document.getElementById("policies"), p);

  const mine = d.policies.find((row) => row.name === d.policy);
  fill(document.getElementById("stats"),
    h("div", {}, h("span", {}, "this run's goodput"), h("b", { id: "goodput" }, pct(d.goodput))),
    h("div", {}, h("span", {}, "failures"), h("b", { id: "failures" }, String(d.interruptions))),
    h("div", {}, h("span", {}, "work redone"), h("b", { id: "lost" }, time(d.lost_s))),
    h("div", {}, h("span", {}, "checkpoint every"), h("b", { id: "interval" }, time(d.interval_s))),
    h("div", {}, h("span", {}, `${d.policy}, 200 runs`), h("b", { id: "mean" }, pct(mine.mean))));
  fill(document.getElementById("caption"),
    `${int(d.gpus)} GPUs fail every ${time(d.job_mtbf_s)} on average. This run trained ${time(d.work_s)} of useful work in ${time(d.wall_s)} of wall time `,
    `with ${d.interruptions} failures and ${time(d.lost_s)} redone; checkpoints (${time(d.stall_s)} stall) every ${time(d.interval_s)}. `,
    `Over 200 runs ${d.policy} leaves ${pct(mine.mean)} goodput (p10–p90 ${pct(mine.p10)}–${pct(mine.p90)}); the best policy here is ${d.best}.`);
}
