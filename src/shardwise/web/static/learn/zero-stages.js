// Widget 3: what each device holds at ZeRO stages 0..3 (/api/learn/memory-budget).
import { api, arrowKeys, count, fill, frame, gb, h, s, widget } from "/static/learn/learn-common.js";

frame("zero-stages");

const ROWS = [["weights", "parameters", "var(--weights)"], ["grads", "gradients", "var(--grads)"], ["optimizer", "optimizer", "var(--optimizer)"]];

const w = widget({
  defaults: { params: 7.5e9, devices: 64, stage: 0 },
  load: (st) => api("/api/learn/memory-budget", st),
  draw,
});
const go = (stage) => { if (stage >= 0 && stage <= 3 && stage !== w.state.stage) w.update({ stage }); };
document.getElementById("back").addEventListener("click", () => go(w.state.stage - 1));
document.getElementById("next").addEventListener("click", () => go(w.state.stage + 1));
arrowKeys(() => go(w.state.stage - 1), () => go(w.state.stage + 1));

function draw(d) {
  document.getElementById("back").disabled = d.stage === 0;
  document.getElementById("next").disabled = d.stage === 3;
  const n = d.devices;
  const shown = n <= 4 ? [...Array(n).keys()] : [0, 1, 2, n - 1];
  const colW = 130, gap = 20, left = 110, top = 40, rowH = 62;
  const g = s("g", {});
  shown.forEach((dev, k) => {
    const x = left + k * (colW + gap) + (k === 3 && n > 4 ? 22 : 0);
    g.append(s("text", { x: x + colW / 2, y: top - 14, "text-anchor": "middle", "font-weight": 700 }, `device ${dev}`));
    g.append(s("rect", { x: x - 8, y: top - 4, width: colW + 16, height: rowH * 3 + 10, rx: 8, fill: "none", stroke: "var(--line)" }));
    ROWS.forEach(([key, , colour], r) => {
      const y = top + r * rowH + 8;
      const part = d.per_device.partitioned[key];
      g.append(s("rect", { x, y, width: colW, height: 30, rx: 4, fill: colour, opacity: 0.12, stroke: colour, "stroke-opacity": 0.4 }));
      const sliceW = Math.max(3, colW / n);
      const sx = part ? x + (dev / n) * colW : x;
      g.append(s("rect", { x: Math.min(sx, x + colW - sliceW), y, width: part ? sliceW : colW, height: 30, rx: part ? 1 : 4, fill: colour, "data-part": key, "data-partitioned": String(part) },
        s("title", {}, part ? `slice ${dev} of ${n}` : "a full copy")));
      g.append(s("text", { x: x + colW / 2, y: y + 46, "text-anchor": "middle", "font-size": 11, class: "muted" }, part ? `1/${n} · ${gb(d.per_device[key])} GB` : `full · ${gb(d.per_device[key])} GB`));
    });
  });
  if (n > 4) g.append(s("text", { x: left + 3 * (colW + gap) + 4, y: top + 100, "text-anchor": "middle", "font-size": 22, class: "muted" }, "…"));
  ROWS.forEach(([key, label, colour], r) => {
    g.append(s("text", { x: left - 16, y: top + r * rowH + 28, "text-anchor": "end", "font-weight": 600, style: `fill:${colour}` }, label),
      s("text", { x: left - 16, y: top + r * rowH + 44, "text-anchor": "end", "font-size": 11, class: "muted" }, d.per_device.partitioned[key] ? "partitioned" : "replicated"));
  });
  // Per-device totals of the four stages, the current one highlighted.
  const by = top + rowH * 3 + 40, maxB = d.stages[0].bytes_per_device;
  d.stages.forEach((row, i) => {
    const y = by + i * 16, bw = (row.bytes_per_device / maxB) * 420;
    g.append(s("text", { x: left - 16, y: y + 10, "text-anchor": "end", "font-size": 11, "font-weight": i === d.stage ? 700 : 400 }, `stage ${i}`),
      s("rect", { x: left, y, width: Math.max(bw, 2), height: 11, rx: 2, fill: i === d.stage ? "var(--accent)" : "var(--line)" }),
      s("text", { x: left + Math.max(bw, 2) + 6, y: y + 10, "font-size": 11, "font-weight": i === d.stage ? 700 : 400, "data-stage-total": i }, `${gb(row.bytes_per_device)} GB`));
  });
  fill(document.getElementById("chart"), g);
  const row = d.stages[d.stage];
  const partitioned = ROWS.filter(([key]) => d.per_device.partitioned[key]).map(([, label]) => label);
  fill(document.getElementById("traffic"),
    h("p", { class: "note" }, `Traffic per device per step at stage ${d.stage}: `, h("strong", {}, `${gb(row.comm_bytes_per_step)} GB`),
      d.stage === 3 ? " — 1.5× plain data parallelism: weights are gathered for forward and again for backward." : " — the same as plain data parallelism's all-reduce."));
  fill(document.getElementById("caption"),
    h("strong", {}, `Stage ${d.stage} (${partitioned.length ? `partitioned: ${partitioned.join(", ")}` : "nothing partitioned"}): `),
    h("span", { id: "total" }, `${gb(d.per_device.total)} GB`), ` per device for ${count(d.params)} parameters on ${n} devices`,
    ` (parameters ${gb(d.per_device.weights)}, gradients ${gb(d.per_device.grads)}, optimizer ${gb(d.per_device.optimizer)} GB). GB = 10⁹ bytes.`);
}
