// Widget 8: the longest sequence that fits, against context-parallel devices (/api/learn/context-wall).
import { api, fill, frame, gb, h, s, tokens, widget } from "/static/learn/learn-common.js";

frame("context-wall");

const PALETTE = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#eeca3b", "#9d755d"];
const modelSelect = document.getElementById("model");

widget({
  defaults: { model: "llama3-8b", budget_gb: 80, cp: 8, tp: 8, recompute: "selective", zero: 0 },
  toControl: { cp: (cp) => Math.round(Math.log2(cp)) },
  fromControl: { cp: (position) => 2 ** position },
  load: (st) => api("/api/learn/context-wall", st),
  draw,
});

function draw(d, st) {
  if (modelSelect.options.length !== d.models.length) {
    fill(modelSelect, d.models.map((name) => h("option", { value: name }, name)));
    modelSelect.value = st.model;
  }
  document.getElementById("budget-out").textContent = `${st.budget_gb} GB`;
  document.getElementById("cp-out").textContent = `${d.cp}`;
  const most = Math.max(...d.curve.map((pt) => pt.max_seq_len), 1);
  const g = s("g", {});

  // The sequence ribbon: the longest context at this P, cut into P device slices, ending at the wall.
  const left = 40, right = 730, rtop = 36;
  const scale = (n) => (n / most) * (right - left);
  g.append(s("text", { x: left, y: 20, "font-weight": 600 }, `longest sequence at P = ${d.cp}, to scale with P = 64's`));
  g.append(s("rect", { x: left, y: rtop, width: right - left, height: 34, rx: 4, fill: "url(#beyond)", opacity: 0.6 }));
  const len = scale(d.max_seq_len);
  const slices = Math.min(d.cp, 64);
  for (let p = 0; p < slices; p++) {
    g.append(s("rect", { x: left + (p * len) / slices, y: rtop, width: Math.max(len / slices - (slices > 16 ? 0 : 1), 0.5), height: 34, fill: PALETTE[p % PALETTE.length] }));
  }
  g.append(s("rect", { x: left + len, y: rtop - 10, width: 6, height: 54, rx: 2, fill: "var(--fg)", id: "wall" }),
    s("text", { x: Math.min(left + len + 10, right - 140), y: rtop + 60, "font-weight": 700 }, `wall: ${tokens(d.max_seq_len)} tokens`));
  g.append(s("defs", {}, s("pattern", { id: "beyond", width: 8, height: 8, patternUnits: "userSpaceOnUse", patternTransform: "rotate(45)" },
    s("rect", { width: 8, height: 8, fill: "#fff" }), s("rect", { width: 3, height: 8, fill: "#e4e7ee" }))));

  // Longest context against P, log–log: doubling P doubles the wall (a slope-one line).
  const cl = 90, cr = 440, ct = 130, cb = 350;
  const pts = d.curve.filter((pt) => pt.max_seq_len > 0);
  const lo = Math.log2(Math.min(...pts.map((pt) => pt.max_seq_len), d.max_seq_len || Infinity)) - 0.5;
  const hi = Math.log2(most) + 0.5;
  const x = (cp) => cl + (Math.log2(cp) / 6) * (cr - cl);
  const y = (n) => cb - ((Math.log2(n) - lo) / (hi - lo)) * (cb - ct);
  g.append(s("text", { x: cl - 50, y: ct - 14, "font-weight": 600 }, "longest context vs P (log–log; k = 1,024 tokens)"));
  for (const pt of d.curve) g.append(s("text", { x: x(pt.cp), y: cb + 18, "text-anchor": "middle", class: "muted" }, pt.cp));
  g.append(s("text", { x: (cl + cr) / 2, y: cb + 36, "text-anchor": "middle", class: "muted" }, "context-parallel devices P"));
  for (let e = Math.ceil(lo); e <= Math.floor(hi); e += 2) {
    g.append(s("line", { x1: cl, x2: cr, y1: y(2 ** e), y2: y(2 ** e), class: "axis" }),
      s("text", { x: cl - 8, y: y(2 ** e) + 4, "text-anchor": "end", class: "muted", "font-size": 11 }, tokens(2 ** e)));
  }
  if (pts.length) {
    g.append(s("polyline", { points: pts.map((pt) => `${x(pt.cp)},${y(pt.max_seq_len)}`).join(" "), fill: "none", stroke: "var(--accent)", "stroke-width": 3 }));
    for (const pt of pts) g.append(s("circle", { cx: x(pt.cp), cy: y(pt.max_seq_len), r: 4, fill: "var(--accent)" }, s("title", {}, `P = ${pt.cp}: ${pt.max_seq_len} tokens`)));
  }
  if (d.max_seq_len) g.append(s("circle", { cx: x(d.cp), cy: y(d.max_seq_len), r: 8, fill: "var(--grads)", stroke: "#fff", "stroke-width": 3 }));

  // One device at the wall: state + activations against the budget.
  const bl = 530, bw = 120, bt = 130, bb = 350;
  const total = d.state_bytes + d.activation_bytes;
  const domain = Math.max(total, d.budget_bytes) * 1.05;
  const by = (b) => bb - (b / domain) * (bb - bt);
  g.append(s("text", { x: bl - 20, y: bt - 14, "font-weight": 600 }, "one device at the wall"));
  g.append(s("rect", { x: bl, y: by(d.state_bytes), width: bw, height: bb - by(d.state_bytes), fill: "var(--weights)" }),
    s("rect", { x: bl, y: by(total), width: bw, height: by(d.state_bytes) - by(total), fill: "var(--activations)" }),
    s("line", { x1: bl - 10, x2: bl + bw + 10, y1: by(d.budget_bytes), y2: by(d.budget_bytes), stroke: "var(--error)", "stroke-dasharray": "6 4", "stroke-width": 2 }),
    s("text", { x: bl + bw + 14, y: by(d.budget_bytes) + 4, style: "fill:var(--error)", "font-size": 11 }, `${gb(d.budget_bytes, 0)} GB`),
    s("text", { x: bl + bw + 14, y: (by(d.state_bytes) + bb) / 2 + 4, "font-size": 11 }, `state ${gb(d.state_bytes, 1)}`),
    s("text", { x: bl + bw + 14, y: (by(total) + by(d.state_bytes)) / 2 + 4, "font-size": 11 }, `activations ${gb(d.activation_bytes, 1)}`));
  fill(document.getElementById("chart"), g);

  fill(document.getElementById("stats"),
    h("div", {}, h("span", {}, "longest context"), h("b", { id: "wall-tokens" }, d.max_seq_len ? `${d.max_seq_len.toLocaleString("en-US")} tokens` : "none fits")),
    h("div", {}, h("span", {}, "tokens per device"), h("b", {}, d.per_device_tokens.toLocaleString("en-US"))),
    h("div", {}, h("span", {}, "layout"), h("b", {}, d.layout)));
  fill(document.getElementById("caption"), d.max_seq_len
    ? `${d.model} with ${d.recompute} recompute on devices of ${gb(d.budget_bytes, 0)} GB (decimal): with P = ${d.cp} the longest sequence that fits is ${d.max_seq_len.toLocaleString("en-US")} tokens, ${d.per_device_tokens.toLocaleString("en-US")} per device. Bars and points come from the memory model; GB = 10⁹ bytes.`
    : `${d.model}: the training state alone (${gb(d.state_bytes, 1)} GB) is over the ${gb(d.budget_bytes, 0)} GB budget, so no sequence fits. ${remedy(d)}`);
}

// What would shrink the state: only the knobs this page has not already turned up.
function remedy(d) {
  const more = [d.tp < 8 && "more tensor parallelism (TP 8 fits a node)", d.zero < 3 && "a higher ZeRO stage"].filter(Boolean);
  return more.length ? `Try ${more.join(" or ")}.` : "TP 8 and ZeRO-3 are already the most this page offers: the model needs devices with more memory, or a pipeline (the planner searches one).";
}
