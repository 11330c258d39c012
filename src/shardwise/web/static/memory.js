import { api, clearFieldErrors, debounce, escapeHtml, explainerLink, fillForm, markStale, readForm, readState, renderNav, showError, showFieldErrors, writeState } from "/static/common.js";
import { fitWidth, horizontalBars, legend, stackedColumns } from "/static/charts.js";
import { modelFields, setupPickers } from "/static/picker.js";

// SPEC §4's example: Llama-3-70B on 64 H100s, TP 8 × DP 8, ZeRO-1, selective recompute + SP.
const DEFAULTS = {
  model: "llama3-70b", gpus: 64, gpu: "h100", gpus_per_node: 8, seq: 8192, global_batch: "",
  tp: 8, pp: 1, dp: "", cp: 1, ep: 1, micro_batch: 1, schedule: "1f1b", chunks: 1, zero: 1,
  recompute: "selective", sp: true, flash: true, formula: "generalised", impl: "megatron-te", headroom: 0.85,
  unit: "GB",
};
const PARTS = [
  { key: "weights", label: "weights", color: "var(--weights)" },
  { key: "grads", label: "gradients", color: "var(--grads)" },
  { key: "optimizer", label: "optimizer", color: "var(--optimizer)" },
  { key: "activations", label: "activations", color: "var(--activations)" },
  { key: "logits", label: "logits", color: "var(--logits)" },
  { key: "workspace", label: "workspace", color: "var(--workspace)" },
];
const UNITS = { GB: 1e9, GiB: 2 ** 30 };
const ALIASES = { "config.json": "model", "accelerator": "gpu", "global batch": "global_batch", "tp·pp·cp": "tp", "chunks": "chunks", "micro-batch": "micro_batch", "whole nodes": "gpus" };
const KNOBS = { zero: "ZeRO stage", recompute: "recompute", tp: "TP", pp: "PP" };

const form = document.getElementById("form");
const formError = document.getElementById("form-error");
let last = null;
let sequence = 0;

function request(state) {
  const { unit, model, dp, global_batch, zero, ...rest } = state;
  return { ...rest, ...modelFields(model), zero: Number(zero), dp: dp === "" ? null : Number(dp), global_batch: global_batch || null };
}

async function update(initial = null) {
  const state = initial || readForm(form, DEFAULTS);
  writeState(state);
  const mine = ++sequence;
  document.getElementById("results").classList.add("busy");
  try {
    const out = await api("/api/memory", request(state), { method: "POST" });
    if (mine !== sequence) return;
    clearFieldErrors(form);
    showError(formError, "");
    last = out;
    render(out, state.unit);
    markStale(document.getElementById("results"), false);
  } catch (error) {
    if (mine !== sequence) return;
    showFieldErrors(form, error, formError, ALIASES);
    markStale(document.getElementById("results"), last !== null);
  } finally {
    if (mine === sequence) {
      document.getElementById("results").classList.remove("busy");
      document.getElementById("loading").hidden = true;
    }
  }
}

function render(out, unit) {
  const div = UNITS[unit];
  const fmt = (bytes) => (bytes / div).toFixed(2);
  const worst = out.stages[out.largest_stage];
  const peak = out.stages[out.largest_peak_stage];
  document.getElementById("kpis").innerHTML = [
    [`${fmt(worst.total)} ${unit}`, `largest stage (stage ${worst.stage})`],
    [`${fmt(out.budget_bytes)} ${unit}`, `budget (${Math.round(out.headroom * 100)}% of ${fmt(out.memory_bytes)} ${unit})`],
    [out.fits ? "fits" : "does not fit", out.layout_short],
    [`${fmt(out.margin_bytes)} ${unit}`, out.margin_bytes >= 0 ? "margin (budget − largest stage)" : "over the budget by"],
    [`${fmt(peak.peak)} ${unit}`, `peak (stage ${peak.stage}, with its ${peak.peak_transient || "no"} transient)`],
  ].map(([value, label], i) => `<div class="kpi"><b class="${i === 2 ? `verdict ${out.fits ? "ok" : "bad"}` : ""}" id="kpi-${i}">${escapeHtml(value.replace(/^-/, ""))}</b><span>${escapeHtml(label)}</span></div>`).join("");
  renderHints(out, fmt, unit);
  document.getElementById("chart-title").textContent = `${out.model} on ${out.gpus}× ${out.accelerator}: per-GPU memory by pipeline stage (${unit})`;
  document.getElementById("legend").innerHTML = legend(PARTS) + `<span><i style="background:#b42318"></i>budget</span>`;
  const chart = document.getElementById("chart");
  chart.innerHTML = stackedColumns({
    groups: out.stages.map((s) => ({ label: `stage ${s.stage}`, values: Object.fromEntries(PARTS.map((p) => [p.key, s[p.key] / div])) })),
    keys: PARTS, budget: out.budget_bytes / div, unit, title: "per-stage memory", width: fitWidth(chart, 760),
  });
  const labels = Object.fromEntries(PARTS.map((p) => [p.key, p.label]));
  document.getElementById("learn-link").innerHTML = explainerLink(Object.fromEntries(PARTS.map((p) => [p.key, worst[p.key]])), (key) => `${labels[key]}: the largest part of stage ${worst.stage}`);
  const cols = ["weights", "grads", "optimizer", "activations", "logits", "workspace", "total", "peak", "margin"];
  document.getElementById("stages").innerHTML = `<caption class="hint" style="text-align:left">per GPU, ${unit} = ${unit === "GB" ? "10⁹" : "2³⁰"} bytes; ${out.formula === "generalised" ? `activations of ${escapeHtml(out.profile_title)}` : `${out.formula} activation count`}, ${out.fused_attention ? "FlashAttention" : "materialised attention"}</caption>`
    + `<thead><tr><th>stage</th><th>layers</th><th>in flight</th>${cols.map((c) => `<th>${c}</th>`).join("")}</tr></thead><tbody>`
    + out.stages.map((s) => `<tr data-stage="${s.stage}"><td>${s.stage}</td><td>${s.layers}</td><td>${s.in_flight}</td>${cols.map((c) => `<td data-part="${c}">${fmt(s[c])}</td>`).join("")}</tr>`).join("")
    + "</tbody>";
  document.getElementById("verdict").innerHTML = `Largest stage ${worst.stage}: ${fmt(worst.total)} ${unit} — <span class="verdict ${out.fits ? "ok" : "bad"}">${out.fits ? "fits" : "does not fit"}</span> in ${fmt(out.budget_bytes)} ${unit}. Peak: what a stage holds plus its largest transient buffer; margin: budget − held.`;
  renderLayer(out.layer_saved);
}

// shardwise memory's "to make it fit": one change per knob, each applied by a click.
function renderHints(out, fmt, unit) {
  const box = document.getElementById("fit");
  box.hidden = out.fits;
  const list = document.getElementById("hints");
  list.innerHTML = out.fit_hints.length
    ? out.fit_hints.map((h, i) => `<li><button type="button" data-hint="${i}">${escapeHtml(KNOBS[h.knob])} ${escapeHtml(String(h.value))}</button> → ${escapeHtml(h.short)}: ${fmt(h.total_bytes)} ${unit}, ${fmt(h.margin_bytes)} ${unit} to spare</li>`).join("")
    : "<li>No single change of ZeRO stage, recompute, TP or PP fits: more GPUs (the planner searches them) or a shorter sequence.</li>";
  for (const button of list.querySelectorAll("button")) {
    button.addEventListener("click", () => {
      const layout = out.fit_hints[Number(button.dataset.hint)].layout;
      fillForm(form, { tp: layout.tp, pp: layout.pp, dp: "", zero: layout.zero, recompute: layout.recompute });
      update();
    });
  }
}

// One layer's saved tensors by component (MiB), from the same payload as the table.
function renderLayer(layer) {
  const box = document.getElementById("layer");
  const rows = Object.entries(layer.by_component).map(([name, bytes]) => ({ label: name, value: bytes / 2 ** 20, color: "var(--activations)", text: `${(bytes / 2 ** 20).toFixed(1)} MiB` }));
  document.getElementById("layer-title").textContent = `What one ${layer.moe ? "MoE layer" : "layer"} saves for backward, per micro-batch (MiB = 2²⁰ B, ${layer.recompute} recompute)`;
  box.innerHTML = rows.length ? horizontalBars({ rows, title: "saved tensors per layer", width: fitWidth(box, 620) }) : "<p class=\"hint\">Full recompute: a layer keeps only its input.</p>";
}

async function main() {
  renderNav();
  const schedule = debounce(() => update(), 120);
  const state = readState(DEFAULTS);
  const first = update(state);  // the numbers load while the pickers do
  await setupPickers(form, () => update());
  fillForm(form, state);
  form.addEventListener("input", (event) => {
    if (event.target.name === "unit") { if (last) render(last, readForm(form, DEFAULTS).unit); writeState(readForm(form, DEFAULTS)); return; }
    if (event.target.type !== "file") schedule();
  });
  form.addEventListener("submit", (event) => { event.preventDefault(); update(); });
  await first;
}

main();
