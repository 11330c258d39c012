// Widget 7: ring attention's block schedule, causal work and layouts (/api/learn/ring-attention).
import { api, arrowKeys, fill, frame, h, int, player, s, widget } from "/static/learn/learn-common.js";

frame("ring-attention");

const PALETTE = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#eeca3b", "#9d755d",
  "#2f6fdf", "#ff9da6", "#79706e", "#bab0ac", "#d67195", "#439894", "#a0cbe8", "#8cd17d"];
const colour = (i) => PALETTE[i % PALETTE.length];
const slider = document.getElementById("step");

const w = widget({
  defaults: { devices: 8, tokens: 16, causal: true, layout: "contiguous", step: 8 },
  load: (st) => api("/api/learn/ring-attention", { devices: st.devices, tokens: st.tokens, causal: st.causal, layout: st.layout }),
  onInput: (key, st) => { if (key === "devices") st.step = st.devices; },
  draw,
});
const go = (step) => {
  if (!w.data) return false;
  const next = Math.max(0, Math.min(w.data.devices, step));
  if (next === w.state.step) return false;
  w.state.step = next;
  w.redraw();
  return true;
};
slider.addEventListener("input", () => go(Number(slider.value)));
document.getElementById("back").addEventListener("click", () => go(w.state.step - 1));
document.getElementById("next").addEventListener("click", () => go(w.state.step + 1));
player(document.getElementById("play"), (first) => {
  if (first && w.state.step >= w.data.devices) go(0);
  return go(w.state.step + 1) && w.state.step < w.data.devices;
}, 700);
arrowKeys(() => go(w.state.step - 1), () => go(w.state.step + 1));

function draw(d, st) {
  const P = d.devices;
  st.step = Math.max(0, Math.min(P, st.step));
  slider.max = P;
  slider.value = st.step;
  document.getElementById("step-out").textContent = `${st.step} / ${P}`;
  document.getElementById("back").disabled = st.step === 0;
  document.getElementById("next").disabled = st.step === P;
  const full = d.tokens_per_device * d.tokens_per_device;
  const g = s("g", {});

  // The ring: device p keeps Q_p; at step t it holds the K/V block d.steps[t].holds[p].
  const cx = 190, cy = 190, R = P > 10 ? 140 : 125, r = P > 10 ? 20 : 27;
  const at = (i) => [cx + R * Math.sin((2 * Math.PI * i) / P), cy - R * Math.cos((2 * Math.PI * i) / P)];
  g.append(s("circle", { cx, cy, r: R, fill: "none", stroke: "var(--line)", "stroke-width": 2, "stroke-dasharray": "3 5" }));
  const current = st.step < P ? d.steps[st.step] : null;
  for (let p = 0; p < P; p++) {
    const [x, y] = at(p);
    // Arc: one segment per step already absorbed, shaded by how much of the block was computed.
    for (let t = 0; t < st.step; t++) {
      const pairs = d.steps[t].pairs[p];
      const a0 = (2 * Math.PI * t) / P, a1 = (2 * Math.PI * (t + 1)) / P - 0.04;
      const ra = r + 6;
      const arc = `M${x + ra * Math.sin(a0)},${y - ra * Math.cos(a0)} A${ra},${ra} 0 ${a1 - a0 > Math.PI ? 1 : 0} 1 ${x + ra * Math.sin(a1)},${y - ra * Math.cos(a1)}`;
      g.append(s("path", { d: arc, fill: "none", stroke: pairs ? colour(d.steps[t].holds[p]) : "var(--line)", "stroke-width": 6, opacity: pairs ? 0.35 + 0.65 * (pairs / full) : 1, "data-arc": `${p}-${t}` },
        s("title", {}, pairs ? `step ${t}: ${pairs} pairs with block ${d.steps[t].holds[p]}` : `step ${t}: block ${d.steps[t].holds[p]} skipped (all in the future)`)));
    }
    g.append(s("circle", { cx: x, cy: y, r, fill: "var(--card)", stroke: colour(p), "stroke-width": 2.5 }),
      s("text", { x, y: y + 4, "text-anchor": "middle", "font-weight": 700, "font-size": P > 10 ? 10 : 12 }, `Q${p}`));
    if (current) {
      const held = current.holds[p];
      const [tx, ty] = [cx + (R - r - 26) * Math.sin((2 * Math.PI * p) / P), cy - (R - r - 26) * Math.cos((2 * Math.PI * p) / P)];
      g.append(s("rect", { x: tx - 17, y: ty - 10, width: 34, height: 20, rx: 4, fill: colour(held), opacity: current.pairs[p] ? 1 : 0.35 }),
        s("text", { x: tx, y: ty + 4, "text-anchor": "middle", "font-size": 10, style: "fill:#fff", "font-weight": 700 }, `KV${held}`));
    }
  }
  g.append(s("text", { x: cx, y: cy + R + r + 26, "text-anchor": "middle", class: "muted" }, current ? `step ${st.step}: absorb the held block, pass it on` : "every block absorbed: arcs full"));

  // Token layout strip: which device holds each position.
  const left = 400, right = 748, s0 = d.devices * d.tokens_per_device;
  const owner = new Array(s0);
  d.positions.forEach((row, p) => row.forEach((pos) => { owner[pos] = p; }));
  const cw = (right - left) / s0;
  g.append(s("text", { x: left, y: 24, "font-weight": 600 }, `who holds each token (${s0} tokens)`));
  owner.forEach((p, pos) => g.append(s("rect", { x: left + pos * cw, y: 32, width: Math.max(cw, 0.6), height: 16, fill: colour(p) })));

  // Work bars from the emulated run.
  const maxWork = Math.max(...d.work), top = 78, barH = Math.min(26, 280 / P);
  g.append(s("text", { x: left, y: top - 8, "font-weight": 600 }, `(query, key) pairs per device${d.causal ? ", causal" : ""}`));
  d.work.forEach((work, p) => {
    const y = top + p * barH, bw = (work / maxWork) * (right - left - 70);
    g.append(s("text", { x: left + 24, y: y + barH * 0.65, "text-anchor": "end", "font-size": 11, class: "muted" }, `${p}`),
      s("rect", { x: left + 30, y: y + 2, width: bw, height: barH - 5, rx: 3, fill: colour(p) }),
      s("text", { x: left + 34 + bw, y: y + barH * 0.65, "font-size": 11, "data-work": p }, int(work)));
  });
  fill(document.getElementById("chart"), g);

  fill(document.getElementById("stats"),
    h("div", {}, h("span", {}, "work max / min"), h("b", { id: "imbalance" }, `${d.imbalance.toFixed(2)}×`)),
    h("div", {}, h("span", {}, "least · most pairs"), h("b", { id: "range" }, `${int(Math.min(...d.work))} … ${int(Math.max(...d.work))}`)),
    h("div", {}, h("span", {}, "blocks skipped"), h("b", {}, `${d.blocks_skipped.reduce((a, b) => a + b, 0)} of ${P * P}`)),
    h("div", {}, h("span", {}, "max |ring − PyTorch attention|"), h("b", { id: "exact" }, d.max_abs_diff.toExponential(1))));
  fill(document.getElementById("caption"),
    `${P} devices × ${d.tokens_per_device} tokens, ${d.causal ? "causal" : "full (non-causal)"} attention, ${d.layout} layout. `,
    d.causal
      ? `The busiest device computes ${d.imbalance.toFixed(2)}× the pairs of the idlest; the ring runs at the busiest one's pace. `
      : "Without a mask every device computes the same number of pairs. ",
    `The output equals PyTorch's own attention to float64 rounding.`);
}
