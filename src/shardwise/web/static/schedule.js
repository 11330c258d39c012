import { api, clearFieldErrors, debounce, escapeHtml, fillForm, readForm, readState, renderNav, showError, showFieldErrors, writeState } from "/static/common.js";
import { fitWidth, gantt } from "/static/charts.js";

const DEFAULTS = { schedule: "1f1b", stages: 4, microbatches: 8, chunks: "", t_f: 1, t_b: 1, t_w: "", p2p_latency: 0 };
const ALIASES = { "m=": "microbatches", "chunks": "chunks" };
const form = document.getElementById("form");
const formError = document.getElementById("form-error");
let sequence = 0;

async function update() {
  const state = readForm(form, DEFAULTS);
  for (const key of ["stages", "microbatches"]) document.getElementById(`${key}-out`).textContent = state[key];
  writeState(state);
  const mine = ++sequence;
  try {
    const blank = (key) => (state[key] === "" ? null : Number(state[key]));
    const out = await api("/api/schedule", { ...state, chunks: blank("chunks"), t_w: blank("t_w") }, { method: "POST" });
    if (mine !== sequence) return;
    clearFieldErrors(form);
    showError(formError, "");
    render(out);
    const query = new URLSearchParams(Object.entries(state).filter(([, v]) => v !== ""));
    document.getElementById("svg-link").href = `/api/schedule.svg?${query}`;
  } catch (error) {
    if (mine === sequence) showFieldErrors(form, error, formError, ALIASES);
  }
}

function render(out) {
  const closed = out.bubble_closed_form;
  document.getElementById("kpis").innerHTML = [
    ["makespan", Number(out.makespan.toPrecision(6))],
    ["bubble (simulated)", out.bubble_fraction.toFixed(4)],
    ["bubble (closed form)", closed === null ? "–" : closed.toFixed(4)],
    ["actions", out.actions],
  ].map(([label, value]) => `<div class="kpi"><b data-kpi="${escapeHtml(label)}">${value}</b><span>${escapeHtml(label)}</span></div>`).join("");
  const times = `t_f ${out.t_f}, t_b ${out.t_b}` + (out.t_w === null ? "" : ` (B ${Number((out.t_b - out.t_w).toPrecision(6))} + W ${out.t_w})`);
  document.getElementById("chart-title").textContent = `${out.schedule}: p=${out.stages}, m=${out.microbatches}, v=${out.chunks}${out.placement === "v" ? " in a V" : ""}; ${times}`;
  const chart = document.getElementById("chart");
  chart.innerHTML = gantt({ events: out.timeline, stages: out.stages, makespan: out.makespan, chunks: out.chunks, title: `${out.schedule} timeline`, width: fitWidth(chart, 1000) });
  document.getElementById("peaks").innerHTML = `<thead><tr><th>stage</th>${out.peak_in_flight.map((_, s) => `<th>${s}</th>`).join("")}</tr></thead>`
    + `<tbody><tr><td>peak in flight</td>${out.peak_in_flight.map((n) => `<td>${Number(n.toPrecision(6))}</td>`).join("")}</tr></tbody>`;
  document.getElementById("text").textContent = out.text;
}

renderNav();
fillForm(form, readState(DEFAULTS));
const later = debounce(update, 80);
form.addEventListener("input", later);
form.addEventListener("submit", (event) => { event.preventDefault(); update(); });
update();
