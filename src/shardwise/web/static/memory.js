import { api, clearFieldErrors, debounce, escapeHtml, fillForm, readForm, readState, renderNav, showError, showFieldErrors, writeState } from "/static/common.js";
import { legend, stackedColumns } from "/static/charts.js";
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
const ALIASES = { "config.json": "model", "accelerator": "gpu", "global batch": "global_batch", "tp·pp·cp": "tp", "chunks": "chunks", "micro-batch": "micro_batch" };

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
  } catch (error) {
    if (mine !== sequence) return;
    showFieldErrors(form, error, formError, ALIASES);
  } finally {
    if (mine === sequence) document.getElementById("results").classList.remove("busy");
  }
}

function render(out, unit) {
  const div = UNITS[unit];
  const fmt = (bytes) => (bytes / div).toFixed(2);
  const worst = out.stages[out.largest_stage];
  document.getElementById("kpis").innerHTML = [
    [`${fmt(worst.total)} ${unit}`, `largest stage (stage ${worst.stage})`],
    [`${fmt(out.budget_bytes)} ${unit}`, `budget (${Math.round(out.headroom * 100)}% of ${fmt(out.memory_bytes)} ${unit})`],
    [out.fits ? "fits" : "does not fit", out.layout_short],
  ].map(([value, label], i) => `<div class="kpi"><b class="${i === 2 ? `verdict ${out.fits ? "ok" : "bad"}` : ""}" id="kpi-${i}">${escapeHtml(value)}</b><span>${escapeHtml(label)}</span></div>`).join("");
  document.getElementById("chart-title").textContent = `${out.model} on ${out.gpus}× ${out.accelerator}: per-GPU memory by pipeline stage (${unit})`;
  document.getElementById("legend").innerHTML = legend(PARTS) + `<span><i style="background:#b42318"></i>budget</span>`;
  document.getElementById("chart").innerHTML = stackedColumns({
    groups: out.stages.map((s) => ({ label: `stage ${s.stage}`, values: Object.fromEntries(PARTS.map((p) => [p.key, s[p.key] / div])) })),
    keys: PARTS, budget: out.budget_bytes / div, unit, title: "per-stage memory",
  });
  const cols = ["weights", "grads", "optimizer", "activations", "logits", "workspace", "total"];
  document.getElementById("stages").innerHTML = `<caption class="hint" style="text-align:left">per GPU, ${unit} = ${unit === "GB" ? "10⁹" : "2³⁰"} bytes; ${out.formula === "generalised" ? `activations of ${escapeHtml(out.impl_title)}` : `${out.formula} activation count`}, ${out.fused_attention ? "FlashAttention" : "materialised attention"}</caption>`
    + `<thead><tr><th>stage</th><th>layers</th><th>in flight</th>${cols.map((c) => `<th>${c}</th>`).join("")}</tr></thead><tbody>`
    + out.stages.map((s) => `<tr data-stage="${s.stage}"><td>${s.stage}</td><td>${s.layers}</td><td>${s.in_flight}</td>${cols.map((c) => `<td data-part="${c}">${fmt(s[c])}</td>`).join("")}</tr>`).join("")
    + "</tbody>";
  document.getElementById("verdict").innerHTML = `Largest stage ${worst.stage}: ${fmt(worst.total)} ${unit} — <span class="verdict ${out.fits ? "ok" : "bad"}">${out.fits ? "fits" : "does not fit"}</span> in ${fmt(out.budget_bytes)} ${unit}.`;
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
