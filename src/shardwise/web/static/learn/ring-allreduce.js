// Widget 2: the emulated ring all-reduce, one snapshot per step (/api/learn/ring).
import { api, arrowKeys, fill, frame, h, int, player, s, widget } from "/static/learn/learn-common.js";

frame("ring-allreduce");

const w = widget({
  defaults: { devices: 4, step: 0 },
  load: (st) => api("/api/learn/ring", { devices: st.devices }),
  onInput: (key, st) => { if (key === "devices") st.step = 0; },
  draw,
});

const last = () => (w.data ? w.data.steps.length : 0);
function go(step) {
  if (!w.data) return false;
  const next = Math.max(0, Math.min(last(), step));
  if (next === w.state.step) return false;
  w.state.step = next;
  w.redraw();
  return true;
}
document.getElementById("back").addEventListener("click", () => go(w.state.step - 1));
document.getElementById("step").addEventListener("click", () => go(w.state.step + 1));
document.getElementById("reset").addEventListener("click", () => go(0));
player(document.getElementById("play"), (first) => {
  if (first && w.state.step === last()) go(0);
  return go(w.state.step + 1) && w.state.step < last();
}, 800);
arrowKeys(() => go(w.state.step - 1), () => go(w.state.step + 1));

function draw(d, st) {
  const n = d.devices;
  st.step = Math.max(0, Math.min(d.steps.length, st.step));
  const snap = st.step > 0 ? d.steps[st.step - 1] : null;
  const rows = snap ? snap.rows : d.initial;
  const complete = snap ? snap.complete : d.initial.map((r) => r.map(() => false));
  const sends = snap ? snap.sends : [];
  const sent = snap ? snap.bytes_sent : d.initial.map(() => 0);
  const phase = snap ? snap.phase : "start";
  document.getElementById("back").disabled = st.step === 0;
  document.getElementById("step").disabled = st.step === d.steps.length;

  fill(document.getElementById("phase"),
    h("div", {}, h("span", {}, "step"), h("b", { id: "step-no" }, `${st.step} / ${d.steps.length}`)),
    h("div", {}, h("span", {}, "phase"), h("b", { id: "phase-name" }, phase)),
    h("div", {}, h("span", {}, "finished cells"), h("b", {}, `${complete.flat().filter(Boolean).length} / ${n * n}`)));

  drawRing(d, sends, complete);

  const sentCell = new Set(sends.map(([r, c]) => `${r}:${c}`));
  const recvCell = new Set(sends.map(([r, c]) => `${(r + 1) % n}:${c}`));
  fill(document.getElementById("table"),
    h("thead", {}, h("tr", {}, h("th", {}, "device"), rows[0].map((_, c) => h("th", {}, `chunk ${c}`)))),
    h("tbody", {}, rows.map((row, r) => h("tr", { "data-device": r }, h("th", {}, `${r}`),
      row.map((value, c) => h("td", {
        class: [complete[r][c] ? "done" : "", recvCell.has(`${r}:${c}`) ? "recv" : "", sentCell.has(`${r}:${c}`) ? "sent" : ""].join(" ").trim() || null,
        "data-chunk": c,
      }, int(value)))))),
    h("tfoot", {}, h("tr", { id: "sums" }, h("td", {}, "Σ column"), d.column_sums.map((v) => h("td", {}, int(v))))));

  const target = d.expected_bytes_per_device;
  fill(document.getElementById("bytes"),
    h("p", { class: "note" }, `Bytes sent so far per device (float64, buffer M = ${d.message_bytes} B):`),
    sent.map((b, r) => h("div", { class: "row" },
      h("label", {}, `device ${r}`, h("output", {}, `${b} / ${target} B`)),
      h("progress", { max: target, value: b, "aria-label": `device ${r} bytes sent` }))),
    h("p", { class: "note" }, `Target 2(N−1)/N · M = ${target} B per device.`));

  const allDone = complete.every((row) => row.every(Boolean));
  fill(document.getElementById("caption"), st.step === 0
    ? "Each device holds its own row. Press Step (or →) to run the first reduce-scatter step: every device sends one chunk to its right-hand neighbour at the same time."
    : allDone
      ? `Done after ${d.steps.length} steps: every row equals the column sums, and each device sent ${sent[0]} B = 2(N−1)/N · M.`
      : phase === "reduce-scatter"
        ? "Orange cells were sent this step; blue cells received them and added them in. A ringed cell holds a finished chunk."
        : "All-gather: the finished (ringed) chunks are forwarded and copied, not added.");
}

function drawRing(d, sends, complete) {
  const n = d.devices, cx = 380, cy = 150, R = 110;
  const at = (i) => [cx + R * Math.sin((2 * Math.PI * i) / n), cy - R * Math.cos((2 * Math.PI * i) / n)];
  const svg = document.getElementById("ring");
  const defs = s("defs", {}, s("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" },
    s("path", { d: "M0,0 L10,5 L0,10 z", fill: "var(--grads)" })));
  const g = s("g", {});
  for (let i = 0; i < n; i++) {
    const [x1, y1] = at(i), [x2, y2] = at((i + 1) % n);
    const active = sends.find(([r]) => r === i);
    const mx = (x1 + x2) / 2, my = (y1 + y2) / 2;
    const ox = (mx - cx) * 0.18, oy = (my - cy) * 0.18;
    const shrink = (xa, ya, xb, yb) => { const dx = xb - xa, dy = yb - ya, L = Math.hypot(dx, dy); return [xa + (dx * 26) / L, ya + (dy * 26) / L]; };
    const [sx, sy] = shrink(x1, y1, mx + ox, my + oy), [ex, ey] = shrink(x2, y2, mx + ox, my + oy);
    g.append(s("path", { d: `M${sx},${sy} Q${mx + ox},${my + oy} ${ex},${ey}`, fill: "none", stroke: active ? "var(--grads)" : "var(--line)", "stroke-width": active ? 3 : 2, "marker-end": active ? "url(#arrow)" : null }));
    if (active) g.append(s("text", { x: mx + ox * 2.2, y: my + oy * 2.2 + 4, "text-anchor": "middle", "font-size": 12, style: "fill:var(--grads)" }, `chunk ${active[1]}`));
  }
  for (let i = 0; i < n; i++) {
    const [x, y] = at(i);
    const done = complete[i].filter(Boolean).length;
    g.append(s("circle", { cx: x, cy: y, r: 24, fill: "var(--card)", stroke: done ? "var(--optimizer)" : "var(--accent)", "stroke-width": done ? 3 : 2 }),
      s("text", { x, y: y + 4, "text-anchor": "middle", "font-weight": 700 }, `dev ${i}`));
  }
  g.append(s("text", { x: cx, y: cy + 4, "text-anchor": "middle", class: "muted" }, "each device sends right"));
  fill(svg, defs, g);
}
