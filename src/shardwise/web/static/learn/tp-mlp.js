// Widget 4: the Megatron MLP's forward pass over a few devices (/api/learn/tp-mlp).
import { api, arrowKeys, fill, frame, h, s, widget } from "/static/learn/learn-common.js";

frame("tp-mlp");

const w = widget({
  defaults: { devices: 2, seed: 0, stage: 0 },
  load: (st) => api("/api/learn/tp-mlp", { devices: st.devices, seed: st.seed }),
  draw,
});
const go = (stage) => { if (w.data && stage >= 0 && stage < w.data.stages.length) { w.state.stage = stage; w.redraw(); } };
document.getElementById("back").addEventListener("click", () => go(w.state.stage - 1));
document.getElementById("next").addEventListener("click", () => go(w.state.stage + 1));
document.getElementById("reseed").addEventListener("click", () => w.update({ seed: w.state.seed + 1 }));
arrowKeys(() => go(w.state.stage - 1), () => go(w.state.stage + 1));

const shape = (t) => `${t.shape[0]}×${t.shape[1]}`;

function draw(d, st) {
  st.stage = Math.min(st.stage, d.stages.length - 1);
  const current = d.stages[st.stage];
  document.getElementById("back").disabled = st.stage === 0;
  document.getElementById("next").disabled = st.stage === d.stages.length - 1;
  fill(document.getElementById("stages"), d.stages.map((stage, i) => {
    const b = h("button", { type: "button", "aria-current": i === st.stage ? "step" : null, "data-stage": stage.key }, `${i + 1}. ${stage.key === "g" ? "all-reduce g" : stage.key === "x" ? "X" : stage.key === "xa" ? "X·Aᵢ" : stage.key === "gelu" ? "GeLU" : "Yᵢ·Bᵢ"}`);
    b.addEventListener("click", () => go(i));
    return b;
  }));
  drawFlow(d, st.stage);
  fill(document.getElementById("values"),
    h("p", { class: "note" }, `${current.title} — `, current.communication ? h("strong", { style: "color:var(--grads)" }, `communication: ${current.communication}`) : "no communication",
      current.replicated ? " (the same on every device)" : " (one per device)"),
    h("div", { class: "buttons" }, current.tensors.map((t) => matrix(t))));
  fill(document.getElementById("operators"),
    h("thead", {}, h("tr", {}, h("th", {}, "operator"), h("th", {}, "forward"), h("th", {}, "backward"))),
    h("tbody", {}, Object.entries(d.operators).map(([name, role]) =>
      h("tr", { title: role.where }, h("td", {}, h("strong", {}, name)), h("td", {}, role.forward), h("td", {}, role.backward)))));
  const equal = d.max_abs_diff < 1e-12;
  fill(document.getElementById("caption"),
    `X is ${d.tokens}×${d.hidden}, A is ${d.hidden}×${d.ffn} and B is ${d.ffn}×${d.hidden}; on ${d.devices} device${d.devices > 1 ? "s" : ""} each holds a ${shape(d.weights[0])} block of A and a ${shape(d.weights[d.devices])} block of B. `,
    h("strong", { id: "equal" }, equal ? "Z equals the single-device result" : "Z differs from the single-device result"),
    `: largest difference ${d.max_abs_diff.toExponential(1)} (${d.dtype}). The only communication is the all-reduce g.`);
}

function drawFlow(d, at) {
  const lanes = d.devices, top = 28, laneH = Math.min(70, 190 / lanes), mid = top + (laneH * lanes) / 2;
  const cols = [40, 170, 300, 430, 560, 690];
  const g = s("g", {});
  const active = (i) => (i === at ? 1 : i < at ? 0.85 : 0.3);
  const box = (x, y, wd, ht, label, sub, colour, opacity, key) => s("g", { "data-box": key },
    s("rect", { x: x - wd / 2, y: y - ht / 2, width: wd, height: ht, rx: 6, fill: "var(--card)" }),
    s("g", { opacity },
      s("rect", { x: x - wd / 2, y: y - ht / 2, width: wd, height: ht, rx: 6, fill: "none", stroke: colour, "stroke-width": 2 }),
      s("text", { x, y: y - 2, "text-anchor": "middle", "font-weight": 700 }, label),
      s("text", { x, y: y + 13, "text-anchor": "middle", "font-size": 11, class: "muted" }, sub)));
  for (let i = 0; i < lanes; i++) {
    const y = top + laneH * (i + 0.5);
    g.append(s("text", { x: 108, y: y - laneH / 2 + 12, "font-size": 10, class: "muted" }, `device ${i}`));
    g.append(s("line", { x1: cols[0] + 34, x2: cols[5] - 34, y1: y, y2: y, stroke: "var(--line)", "stroke-width": 2 }));
  }
  g.append(s("rect", { x: 100, y: top, width: 520, height: laneH * lanes, rx: 8, fill: "none", stroke: "var(--line)", "stroke-dasharray": "4 4" }));
  const [X, XA, Y, P, Z] = d.stages;
  g.append(box(cols[0], mid, 64, 44, "X", shape(X.tensors[0]), "var(--accent)", active(0), "x"));
  g.append(s("text", { x: cols[0] + 48, y: top - 8, "text-anchor": "middle", "font-size": 11, style: "fill:var(--accent)" }, "f"));
  [XA, Y, P].forEach((stage, k) => stage.tensors.forEach((t, i) => {
    const y = top + laneH * (i + 0.5);
    g.append(box(cols[k + 1], y, 92, Math.min(44, laneH - 8), k === 0 ? `X·A${sub(i)}` : k === 1 ? `GeLU` : `Y${sub(i)}·B${sub(i)}`, shape(t), k === 2 ? "var(--grads)" : "var(--weights)", active(k + 1), `${stage.key}-${i}`));
  }));
  const gOn = at >= 4;
  g.append(s("rect", { x: cols[4] + 55, y: top - 4, width: 36, height: laneH * lanes + 8, rx: 8, fill: "var(--card)" }));
  g.append(s("g", { opacity: active(4), "data-box": "g" },
    s("rect", { x: cols[4] + 55, y: top - 4, width: 36, height: laneH * lanes + 8, rx: 8, fill: gOn ? "var(--grads)" : "var(--card)", stroke: "var(--grads)", "stroke-width": 2 }),
    s("text", { x: cols[4] + 73, y: mid + 5, "text-anchor": "middle", "font-weight": 700, style: gOn ? "fill:#fff" : "fill:var(--grads)" }, "g")));
  g.append(box(cols[5], mid, 64, 44, "Z", shape(Z.tensors[0]), "var(--accent)", active(4), "z"));
  g.append(s("text", { x: 380, y: top + laneH * lanes + 26, "text-anchor": "middle", "font-size": 12, class: "muted" },
    "inside the dashed box each device works alone; g is the one all-reduce"));
  fill(document.getElementById("flow"), g);
}

const sub = (i) => String(i + 1).replace(/\d/g, (c) => "₀₁₂₃₄₅₆₇₈₉"[c]);

function matrix(t) {
  const flat = t.values.flat();
  const m = Math.max(...flat.map(Math.abs)) || 1;
  return h("div", {}, h("div", { class: "note" }, `${t.name} (${shape(t)})`),
    h("table", { class: "matrix", "data-name": t.name }, h("tbody", {}, t.values.map((row) => h("tr", {}, row.map((v) =>
      h("td", { style: `background: color-mix(in srgb, ${v >= 0 ? "var(--weights)" : "var(--grads)"} ${Math.round((Math.abs(v) / m) * 45)}%, transparent)` }, v.toFixed(2))))))));
}
