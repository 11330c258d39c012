// Widget 5: bubble fraction against micro-batches (/api/learn/bubble).
import { api, fill, frame, h, pct, s, widget } from "/static/learn/learn-common.js";

frame("bubble");

widget({
  defaults: { p: 4, m: 8, interleaved: false, v: 2, slowback: false },
  load: (st) => api("/api/learn/bubble", { p: st.p, m: st.m, v: st.v, t_b: st.slowback ? 2 : 1 }),
  draw,
});

function draw(d, st) {
  const left = 60, right = 740, top = 20, bottom = 310;
  const x = (m) => left + (Math.log2(m) / Math.log2(d.max_m)) * (right - left);
  const y = (b) => bottom - b * (bottom - top);
  const g = s("g", {});
  for (const b of [0, 0.2, 0.4, 0.6, 0.8, 1]) {
    g.append(s("line", { x1: left, x2: right, y1: y(b), y2: y(b), class: "axis" }),
      s("text", { x: left - 8, y: y(b) + 4, "text-anchor": "end", class: "muted" }, `${b * 100}%`));
  }
  for (let m = 1; m <= d.max_m; m *= 2) {
    g.append(s("text", { x: x(m), y: bottom + 18, "text-anchor": "middle", class: "muted" }, m));
  }
  g.append(s("text", { x: (left + right) / 2, y: bottom + 40, "text-anchor": "middle", class: "muted" }, "micro-batches M (log scale)"),
    s("text", { x: 14, y: (top + bottom) / 2, transform: `rotate(-90 14 ${(top + bottom) / 2})`, "text-anchor": "middle", class: "muted" }, "bubble (idle share of the step)"));
  const path = (curve) => curve.map((pt, i) => `${i ? "L" : "M"}${x(pt.m).toFixed(1)},${y(pt.bubble).toFixed(1)}`).join("");
  const x4 = x(Math.min(d.m_4p, d.max_m));
  g.append(s("line", { x1: x4, x2: x4, y1: top, y2: bottom, stroke: "var(--accent)", "stroke-dasharray": "5 4", opacity: 0.7 }),
    s("text", { x: x4 + 5, y: top + 14, style: "fill:var(--accent)", "font-size": 12 }, `M = 4P = ${d.m_4p}`),
    s("circle", { cx: x4, cy: y(d.bubble_at_4p), r: 4, fill: "var(--accent)" }));
  if (st.interleaved) g.append(s("path", { d: path(d.curve_interleaved), fill: "none", stroke: "var(--optimizer)", "stroke-width": 2.5, "stroke-dasharray": "7 4" }));
  g.append(s("path", { d: path(d.curve), fill: "none", stroke: "var(--accent)", "stroke-width": 3 }));
  for (const pt of d.simulated) {
    g.append(s("circle", { cx: x(pt.m), cy: y(pt.bubble), r: 4.5, fill: "var(--card)", stroke: "var(--grads)", "stroke-width": 2 },
      s("title", {}, `simulated 1F1B, M = ${pt.m}: ${pct(pt.bubble, 2)}`)));
  }
  const cx = x(d.m), cy = y(d.bubble);
  g.append(s("line", { x1: cx, x2: cx, y1: cy, y2: bottom, stroke: "var(--fg)", "stroke-dasharray": "2 3" }),
    s("circle", { cx, cy, r: 8, fill: "var(--accent)", stroke: "#fff", "stroke-width": 3 }),
    s("text", { x: cx + 12, y: cy - 10, "font-weight": 700 }, pct(d.bubble)));
  if (st.interleaved) {
    const iy = y(d.bubble_interleaved);
    g.append(s("circle", { cx, cy: iy, r: 6, fill: "var(--optimizer)", stroke: "#fff", "stroke-width": 2 }),
      s("text", { x: cx + 12, y: iy + 16, style: "fill:var(--optimizer)", "font-weight": 700 }, pct(d.bubble_interleaved)));
  }
  fill(document.getElementById("chart"), g);
  fill(document.getElementById("stats"),
    h("div", {}, h("span", {}, "bubble at this M"), h("b", { id: "bubble" }, pct(d.bubble))),
    h("div", {}, h("span", {}, `at M = 4P = ${d.m_4p}`), h("b", { id: "bubble-4p" }, pct(d.bubble_at_4p))),
    st.interleaved ? h("div", {}, h("span", {}, `interleaved, v = ${d.v}`), h("b", { id: "bubble-v" }, pct(d.bubble_interleaved))) : null);
  fill(document.getElementById("caption"),
    `P = ${d.p} stages, M = ${d.m} micro-batches: (P−1)/(M+P−1) = ${d.bubble.toFixed(4)}, so ${pct(d.bubble)} of each device's step is idle. `,
    st.interleaved ? `Interleaving v = ${d.v} chunks per stage makes the fill and drain v times shorter: ${d.bubble_interleaved.toFixed(4)}. ` : "",
    `Dots: 1F1B simulated with backward = ${d.simulated_t_b}× forward.`);
}
