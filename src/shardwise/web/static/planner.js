import { api, clearFieldErrors, copyText, escapeHtml, explainerLink, fillForm, humanCount, humanTime, markStale, pct, readForm, readState, renderNav, showError, showFieldErrors, writeState } from "/static/common.js";
import { fitWidth, horizontalBars, legend, stackedColumns } from "/static/charts.js";
import { modelFields, setupPickers } from "/static/picker.js";

const DEFAULTS = { model: "llama3-8b", impl: "megatron-te", gpus: 64, gpu: "h100", gpus_per_node: 8, seq: 8192, global_batch: "4M-tokens", tokens: "", price: "", layout: "", top: 10, fix: "", max: "", all_variants: false, intra: "", inter: "", dtype: "bf16", headroom: 0.85, flash: true, compile: "", tp_overlap: "", dp_overlap: "", attention: "", rank_by: "step", mtbf_gpu_hours: "", checkpoint_bandwidth: "", restart_minutes: "", async_checkpoint: false, choose: "simplest" };
const ALIASES = { "config.json": "model", "accelerator": "gpu", "--price": "price", "token budget": "tokens", "--fix": "fix", "--max": "max", "layout item": "layout", "batch": "global_batch", "no layout fits": "gpus", "whole nodes": "gpus" };
// plan_report._LABELS, in the same order
const COMPONENTS = [
  ["compute", "compute", "var(--compute)"], ["tp_comm", "TP comm (exposed)", "var(--tp)"],
  ["cp_comm_exposed", "CP comm (exposed)", "var(--cp)"], ["ep_comm", "EP all-to-all", "var(--ep)"],
  ["pp_comm", "PP p2p", "var(--pp)"], ["bubble", "pipeline bubble", "var(--bubble)"],
  ["dp_comm_exposed", "DP/ZeRO comm (exposed)", "var(--dp)"], ["optimizer", "optimizer step", "var(--opt)"],
];
const PARTS = [["weights", "var(--weights)"], ["grads", "var(--grads)"], ["optimizer", "var(--optimizer)"], ["activations", "var(--activations)"], ["logits", "var(--logits)"], ["workspace", "var(--workspace)"]]
  .map(([key, color]) => ({ key, label: key, color }));
const GIB = 2 ** 30;
const form = document.getElementById("form");
const formError = document.getElementById("form-error");
const results = document.getElementById("results");
let sortState = { column: 0, descending: false };

const number = (text) => (text === "" ? null : Number(text));

function request(state) {
  const { model, tokens, price, layout, fix, max, intra, inter, mtbf_gpu_hours, checkpoint_bandwidth, restart_minutes, ...rest } = state;
  return { ...rest, ...modelFields(model), tokens: tokens || null, layout: layout || null, fix: fix || null, max: max || null, price: number(price), intra: intra || null, inter: inter || null,
    mtbf_gpu_hours: number(mtbf_gpu_hours), checkpoint_bandwidth: checkpoint_bandwidth || null, restart_minutes: number(restart_minutes) };
}

async function run(initial = null) {
  const state = initial || readForm(form, DEFAULTS);
  writeState(state);
  const button = document.getElementById("run");
  button.disabled = true;
  button.textContent = "Searching…";
  const started = performance.now();
  try {
    const body = { ...request(state), link: location.href };  // the share link, for the downloads' header
    const out = await api("/api/plan", body, { method: "POST" });
    clearFieldErrors(form);
    showError(formError, "");
    document.getElementById("timing").textContent = `${Math.round(performance.now() - started)} ms`;
    render(out, state);
    markStale(results, false);
    await renderMemory(out, body, state);
  } catch (error) {
    showFieldErrors(form, error, formError, ALIASES);
    markStale(results, !results.hidden);
  } finally {
    document.getElementById("loading").hidden = true;
    button.disabled = false;
    button.textContent = "Plan";
  }
}

function shares(entry) {
  const e = entry.estimate;
  const s = (k) => e[k] / e.total;
  return { compute: s("compute"), tp: s("tp_comm"), dp: s("dp_comm_exposed"), pp: s("pp_comm") + s("bubble"), other: s("cp_comm_exposed") + s("ep_comm") + s("optimizer") };
}

function row(entry, label, cls, tier) {
  const e = entry.estimate, sh = shares(entry), sure = e.uncertainty;
  const band = sure ? `±${Math.round(sure.band * 100)}%` : "";
  const cells = [
    [label, entry.rank ?? 1e9], [entry.short, entry.short], [`${humanTime(step(entry))}${band ? ` ${band}` : ""}`, step(entry)], [humanCount(e.tokens_per_s), e.tokens_per_s],
    [pct(e.mfu), e.mfu], [pct(e.hfu), e.hfu], [(entry.memory.total / GIB).toFixed(1), entry.memory.total],
    [pct(sh.compute), sh.compute], [pct(sh.tp), sh.tp], [pct(sh.dp), sh.dp], [pct(sh.pp), sh.pp], [pct(sh.other), sh.other],
  ].map(([text, key]) => [escapeHtml(text), key]);
  // plan_report.variants_text: the layouts this row folds (ZeRO group size, stage split)
  if (entry.variants) cells[1][0] += ` <span class="variants" title="layouts that differ only in ZeRO group size or stage partition">+${entry.variants} variant${entry.variants === 1 ? "" : "s"}</span>`;
  // estimate.uncertainty (estimate/uncertainty.py): what no published run measured
  if (sure && sure.unvalidated.length) cells[1][0] += ` <span class="unvalidated" title="not validated by any published run: ${escapeHtml(sure.unvalidated.join("; "))}">†</span>`;
  if (sure) cells[2][0] = `${escapeHtml(humanTime(step(entry)))} <span class="band" title="band from ${sure.runs} published runs of ${escapeHtml(sure.group)} (out of sample)">${band}</span>`;
  if (tier !== undefined) cells[0][0] += ` <span class="tier" title="tier ${tier}${tier === 1 ? ": tied with the fastest" : ""}">${tier === 1 ? "tie" : `t${tier}`}</span>`;
  return `<tr class="${cls}"${tier !== undefined ? ` data-tier="${tier}"` : ""}>${cells.map(([html, key]) => `<td data-sort="${escapeHtml(key)}">${html}</td>`).join("")}</tr>`;
}

const HEADERS = ["#", "layout", "step", "tokens/s", "MFU", "HFU", "mem GiB", "compute", "TP", "DP", "PP+bubble", "other"];
let rankBy = "step";
// the figure the plan ranked by (PlanEntry.figure): the step time, or step ÷ goodput
const step = (entry) => (rankBy === "goodput" ? entry.goodput.effective_step_s : entry.estimate.total);

function renderRanked(out, best) {
  rankBy = out.rank_by;
  const headers = HEADERS.map((h) => (h === "step" && rankBy === "goodput" ? "step ÷ goodput" : h));
  const table = document.getElementById("ranked");
  table.innerHTML = `<thead><tr>${headers.map((h, i) => `<th aria-sort="none"><button type="button" data-column="${i}">${h}</button></th>`).join("")}</tr></thead><tbody>`
    + out.ranked.map((e) => row(e, String(e.rank), [e.rank === 1 ? "winner" : "", e.tier === 1 ? "tie" : "", e.short === best.short ? "recommended" : ""].join(" ").trim(), e.tier)).join("")
    + (out.given ? row(out.given, "yours", "given") : "") + "</tbody>";
  for (const button of table.querySelectorAll("th button")) {
    button.addEventListener("click", () => {
      const column = Number(button.dataset.column);
      sortState = { column, descending: sortState.column === column ? !sortState.descending : column >= 3 && column !== 6 };
      sortTable(table);
    });
  }
  sortState = { column: 0, descending: false };
}

function sortTable(table) {
  const { column, descending } = sortState;
  const body = table.tBodies[0];
  const rows = [...body.rows];
  const key = (r) => { const v = r.cells[column].dataset.sort; return Number.isNaN(Number(v)) ? v : Number(v); };
  rows.sort((a, b) => { const x = key(a), y = key(b); return (x < y ? -1 : x > y ? 1 : 0) * (descending ? -1 : 1); });
  body.append(...rows);
  table.querySelectorAll("th").forEach((th, i) => th.setAttribute("aria-sort", i === column ? (descending ? "descending" : "ascending") : "none"));
}

// One layout's step time by component; `max` (seconds) sets the scale so that bars of
// several layouts compare.
function breakdown(entry, max, target) {
  const e = entry.estimate;
  return horizontalBars({
    title: `step time of ${entry.short}`, max, width: fitWidth(target, 520),
    rows: COMPONENTS.map(([key, label, color]) => ({
      label: label + (key === "bubble" && e.bubble_source === "simulator" ? " (simulated)" : ""),
      value: e[key], color, text: `${humanTime(e[key])} · ${pct(e[key] / e.total)}`,
    })),
  });
}

// The layout the answer card recommends (the payload's `recommended`: the fastest, or the
// simplest of the first tier); its figures and exports are the ones shown.
function recommended(out, state) {
  return out.recommended ?? out.ranked[0];
}

function render(out, state) {
  document.getElementById("results").hidden = false;
  const best = recommended(out, state), e = best.estimate, c = out.cluster, t = out.train;
  document.getElementById("summary").textContent = `${out.model} on ${c.gpus}× ${c.accelerator} (${c.gpus / c.gpus_per_node} nodes × ${c.gpus_per_node}, ${c.intra} / ${c.inter}), s=${t.seq_len}, global batch ${t.global_batch.toLocaleString("en")} sequences (${humanCount(t.global_batch * t.seq_len)} tokens), ${t.dtype}; for ${out.stack.title} (${out.stack.version}${out.stack.assumed.length ? `; its defaults assumed: ${out.stack.assumed.join(", ")}` : ""}); budget ${(out.budget_bytes / GIB).toFixed(1)} GiB per GPU (${Math.round(out.headroom * 100)}%)${out.constraint ? `; searched only ${out.constraint}` : ""}.`;
  const kpis = [["step" + bandRange(e.uncertainty), humanTime(e.total) + (e.uncertainty ? ` ±${Math.round(e.uncertainty.band * 100)}%` : "")], ["tokens/s", humanCount(e.tokens_per_s)], ["MFU (model FLOPs)", pct(e.mfu)], ["memory (largest stage)", `${(best.memory.total / GIB).toFixed(1)} GiB`]];
  if (out.training) kpis.push(["time to train", humanTime(out.training.seconds)], ["GPU-hours", Math.round(out.training.gpu_hours).toLocaleString("en")]);
  if (out.training?.cost !== undefined) kpis.push(["cost", `$${Math.round(out.training.cost).toLocaleString("en")}`]);
  document.getElementById("kpis").innerHTML = kpis.map(([label, value]) => `<div class="kpi"><b>${escapeHtml(value)}</b><span>${escapeHtml(label)}</span></div>`).join("");
  document.getElementById("ranked-title").textContent = `Top ${out.ranked.length} layouts by ${out.rank_by === "goodput" ? "step ÷ goodput (failures, checkpoints and restarts counted)" : "step time"} for ${out.stack.title} (${out.stack.export ? `export: ${out.stack.export}` : "no export"}; of ${out.stats.fits.toLocaleString("en")} that fit${out.all_variants ? "" : "; +N: variants folded into their best"}; step ± its band, † not validated by a published run)`;
  renderRanked(out, best);
  renderAnswer(out, best, state);
  const g = out.given;
  document.getElementById("given-note").textContent = g ? `Your layout ${g.short}: ${humanTime(g.estimate.total)} per step, MFU ${pct(g.estimate.mfu)}, ${g.fits ? "fits" : `does NOT fit (${(g.memory.total / GIB).toFixed(1)} GiB > ${(g.budget_bytes / GIB).toFixed(1)} GiB)`}; ${(g.estimate.total / e.total).toFixed(2)}× the recommended layout's step time (${out.given_note}).` : "";
  document.getElementById("explanation").textContent = out.explanation;
  document.getElementById("training").textContent = out.training
    ? `Training ${humanCount(out.training.tokens)} tokens: ${humanTime(out.training.seconds)}, ${Math.round(out.training.gpu_hours).toLocaleString("en")} GPU-hours${out.training.cost !== undefined ? `, $${Math.round(out.training.cost).toLocaleString("en")} at $${out.training.price_per_gpu_hour}/GPU-hour` : ""}.` : "";
  document.getElementById("breakdown-title").textContent = `Step time: ${best.short} (${e.microbatches} micro-batches, ${humanTime(e.total)})`;
  // the winner's and your layout's bars on one scale
  const scale = Math.max(...[best, g].filter(Boolean).flatMap((x) => COMPONENTS.map(([key]) => x.estimate[key])));
  const chart = document.getElementById("breakdown");
  chart.innerHTML = breakdown(best, scale, chart);
  document.getElementById("given-breakdown").innerHTML = g ? `<h2>Your layout: ${escapeHtml(g.short)}</h2>${breakdown(g, scale, chart)}` : "";
  const overheads = Object.fromEntries(COMPONENTS.filter(([key]) => key !== "compute").map(([key]) => [key, e[key]]));
  const labels = Object.fromEntries(COMPONENTS.map(([key, label]) => [key, label]));
  document.getElementById("learn-link").innerHTML = explainerLink(overheads, (key) => `${labels[key]}: the recommended layout's largest cost besides compute`);
  renderGoodput(out, best);
  renderEmits(out);
  document.getElementById("rejected").innerHTML = "<thead><tr><th>reason</th><th>grid points</th><th>example</th></tr></thead><tbody>"
    + out.rejected.map((r) => `<tr><td>${escapeHtml(r.reason)}</td><td>${r.count.toLocaleString("en")}</td><td>${escapeHtml(r.example)}</td></tr>`).join("") + "</tbody>";
  const s = out.stats;
  document.getElementById("stats").textContent = `Searched ${s.grid.toLocaleString("en")} grid points; evaluated ${s.evaluated.toLocaleString("en")} valid layouts in ${Math.round(s.evaluation_seconds * 1e3)} ms, ${Math.round(s.seconds * 1e3)} ms in all.`;
}

// The winner's goodput (estimate.goodput, as `shardwise plan --json` gives it): figures, the
// wall time's shares and a link to the explainer set to the winner's numbers.
function renderGoodput(out, best) {
  const g = out.goodput, r = out.reliability;
  const kpis = [["goodput", pct(g.goodput)], ["a failure every", humanTime(g.job_mtbf_hours * 3600)], ["interruptions", g.interruption_rate],
    ["checkpoint every", `${humanTime(g.checkpoint_interval_s)} (${g.checkpoint_every_steps.toLocaleString("en")} steps)`],
    ["checkpoint", `${(g.checkpoint_bytes / 1e9).toLocaleString("en", { maximumFractionDigits: 1 })} GB`], ["write", humanTime(g.checkpoint_write_s)]];
  if (g.days !== null) kpis.push(["days with failures", g.days.toFixed(1)], ["interruptions", Math.round(g.expected_interruptions).toLocaleString("en")]);
  if (g.cost !== null) kpis.push(["cost with failures", `$${Math.round(g.cost).toLocaleString("en")}`]);
  document.getElementById("goodput-title").textContent = `Failures, checkpoints and restarts: ${best.short}`;
  document.getElementById("goodput-kpis").innerHTML = kpis.map(([label, value]) => `<div class="kpi"><b>${escapeHtml(value)}</b><span>${escapeHtml(label)}</span></div>`).join("");
  const chart = document.getElementById("goodput-chart");
  const rows = [["training", g.goodput, "var(--compute)"], ["checkpoints", g.shares.checkpoint, "var(--optimizer)"], ["restarts", g.shares.restart, "var(--activations)"], ["lost work", g.shares["lost work"], "var(--grads)"]];
  chart.innerHTML = horizontalBars({ title: "share of the wall time", width: fitWidth(chart, 520), max: 1,
    rows: rows.map(([label, value, color]) => ({ label, value, color, text: pct(value) })) });
  document.getElementById("goodput-text").textContent = `${g.bytes_per_param} B/param; the busiest node writes ${(g.checkpoint_node_bytes / 1e9).toFixed(2)} GB at ${(r.checkpoint_bandwidth / 1e9).toPrecision(3)} GB/s; `
    + `${g.async_checkpoint ? `asynchronous: a ${humanTime(g.checkpoint_stall_s)} stall` : "synchronous: the whole write stalls"}; restart ${humanTime(g.restart_s)}; ${r.mtbf_gpu_hours.toLocaleString("en", { maximumFractionDigits: 0 })} GPU-hours between failures per GPU.`;
  const params = new URLSearchParams({ gpus: g.gpus, mtbf_gpu_hours: Math.round(r.mtbf_gpu_hours), stall_s: Math.max(1, Math.round(g.checkpoint_stall_s)), restart_min: Math.min(240, Math.round(g.restart_s / 60)) });
  document.getElementById("goodput-learn").innerHTML = `<a class="learn-link" href="/learn/checkpoint-interval?${params}">Learn: how often to checkpoint</a> <span class="hint">(this plan's failures and checkpoint)</span>`;
}

let downloadUrl = "";
let jobUrls = [];

// each launcher's job (`emits[framework].jobs`, `shardwise plan … --launcher L`) as a download;
// a launcher that cannot write one says why (k8s: the container image)
function jobLinks(emit) {
  jobUrls.forEach((url) => URL.revokeObjectURL(url));
  jobUrls = [];
  const entries = Object.entries(emit.launchers ?? {});
  const links = [...entries.filter(([l]) => emit.jobs?.[l]), ...entries.filter(([l]) => !emit.jobs?.[l])].map(([launcher, job]) => {
    const file = emit.jobs?.[launcher];
    if (!file) return `<span class="hint" id="job-${launcher}">${escapeHtml(launcher)}: ${escapeHtml(job.error ?? "no job")}</span>`;
    const url = URL.createObjectURL(new Blob([file.text], { type: "text/plain" }));
    jobUrls.push(url);
    return `<a class="button" id="job-${launcher}" download="${escapeHtml(file.filename)}" href="${url}">Download ${escapeHtml(file.filename)}</a>`;
  });
  return links.length ? `<p class="hint">The job that runs it on the planned nodes (<code>--launcher</code>):</p><div class="actions" id="jobs">${links.join("")}</div>` : "";
}

function renderEmits(out) {
  const tabs = document.getElementById("tabs");
  const names = Object.keys(out.emits);
  tabs.innerHTML = names.map((n, i) => `<button type="button" role="tab" id="tab-${n}" aria-selected="${i === 0}" data-name="${n}">${n}</button>`).join("");
  const show = (name) => {
    const emit = out.emits[name];
    tabs.querySelectorAll("button").forEach((b) => {
      b.setAttribute("aria-selected", String(b.dataset.name === name));
      b.tabIndex = b.dataset.name === name ? 0 : -1;
    });
    const panel = document.getElementById("emit");
    if (emit.error) {
      // another stack exports this framework: re-plan for it instead of the CLI's words
      const again = emit.replan;
      panel.innerHTML = again
        ? `<p class="replan">These layouts are for ${escapeHtml(out.stack.title)}; ${escapeHtml(name)} runs ${escapeHtml(again.title)}, whose best layouts may differ.</p><div class="actions"><button type="button" class="primary" id="replan">Re-plan for ${escapeHtml(again.title)}</button></div>`
        : `<p class="error">${escapeHtml(emit.error)}</p>`;
      document.getElementById("replan")?.addEventListener("click", () => {
        form.elements.impl.value = again.impl;
        run();
      });
      return;
    }
    const file = emit.download;
    URL.revokeObjectURL(downloadUrl);
    downloadUrl = URL.createObjectURL(new Blob([file.text], { type: "text/plain" }));
    const which = out.given ? `your layout, ${out.given.short}` : `the recommended layout, ${(out.recommended ?? out.ranked[0]).short}`;
    panel.innerHTML = `<p class="hint" id="emit-for">For ${escapeHtml(which)} (as <code>shardwise plan … --emit ${escapeHtml(name)}</code>).</p><div class="actions"><a class="button primary" id="download" download="${escapeHtml(file.filename)}" href="${downloadUrl}">Download ${escapeHtml(file.filename)}</a><button type="button" id="copy">Copy ${escapeHtml(name)} config</button></div>${jobLinks(emit)}<pre class="code" id="emit-text" tabindex="0"></pre>`
      + (emit.notes.length ? `<ul class="hint">${emit.notes.map((n) => `<li>${escapeHtml(n)}</li>`).join("")}</ul>` : "");
    document.getElementById("emit-text").textContent = file.text;
    document.getElementById("copy").addEventListener("click", (ev) => copyText(ev.target, file.text));
  };
  tabs.querySelectorAll("button").forEach((b) => b.addEventListener("click", () => show(b.dataset.name)));
  tabs.onkeydown = (event) => {  // arrow keys move between the tabs (WAI-ARIA tabs pattern)
    const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
    if (!step) return;
    const current = names.indexOf(tabs.querySelector("[aria-selected=true]").dataset.name);
    const next = names[(current + step + names.length) % names.length];
    show(next);
    document.getElementById(`tab-${next}`).focus();
  };
  show(names[0]);
}

async function renderMemory(out, body, state) {
  const best = recommended(out, state);
  const { top, tokens, price, layout, fix, max, all_variants, global_batch, intra, inter, rank_by, mtbf_gpu_hours, checkpoint_bandwidth, restart_minutes, async_checkpoint, choose, link, ...common } = body;
  const mem = await api("/api/memory", { ...common, ...best.layout, global_batch: String(out.train.global_batch) }, { method: "POST" });
  document.getElementById("memory-title").textContent = `Memory per stage: ${best.short} (GiB)`;
  document.getElementById("memory-legend").innerHTML = legend(PARTS) + `<span><i style="background:#b42318"></i>budget</span>`;
  const chart = document.getElementById("memory");
  chart.innerHTML = stackedColumns({
    groups: mem.stages.map((s) => ({ label: `${s.stage}`, values: Object.fromEntries(PARTS.map((p) => [p.key, s[p.key] / GIB])) })),
    keys: PARTS, budget: mem.budget_bytes / GIB, unit: "GiB", title: "per-stage memory of the recommended layout", width: fitWidth(chart, 520), height: 260,
  });
}

async function main() {
  renderNav();
  const state = readState(DEFAULTS);
  const first = run(state);  // the search starts while the pickers load
  await setupPickers(form, () => {});
  fillForm(form, state);
  form.addEventListener("submit", (event) => { event.preventDefault(); run(); });
  for (const radio of document.querySelectorAll("input[name=choose-view]")) {
    radio.checked = radio.value === state.choose;
    radio.addEventListener("change", () => { form.elements.choose.value = radio.value; run(); });
  }
  await first;
}

main();

// " (low–high)": the band's range in seconds (estimate.uncertainty), when the payload has it
function bandRange(sure) {
  return sure && sure.low !== undefined ? ` (${humanTime(sure.low)}–${humanTime(sure.high)}${sure.coverage !== undefined ? `, ${pct(sure.coverage, 0)} of published runs inside` : ""})` : "";
}

const learn = (page, title) => `<a class="learn-link" href="/learn/${page}">Learn: ${escapeHtml(title)}</a>`;

// One line per decision of the recommended layout, each with the explainer of its cost; the
// shares are the estimate's seconds over its total, as the table shows them.
function decisions(entry, out) {
  const l = entry.layout, e = entry.estimate, share = (k) => pct(e[k] / e.total);
  const lines = [
    [l.tp > 1 ? `Tensor parallel ${l.tp}${l.sp ? " with sequence parallelism" : ""} inside each node: its exposed communication is ${share("tp_comm")} of the step.` : "No tensor parallelism: every layer whole on each GPU.", learn("tp-mlp", "tensor-parallel MLP")],
    [l.pp > 1 ? `A pipeline of ${l.pp} stages (${l.schedule}${l.chunks > 1 ? `, ${l.chunks} chunks per stage` : ""}, ${e.microbatches} micro-batches): its bubble is ${share("bubble")} of the step.` : "No pipeline, so no bubble.", learn("bubble", "bubble vs micro-batches")],
  ];
  if (l.cp > 1) lines.push([`Context parallel ${l.cp} (${l.cp_kind}): ${share("cp_comm_exposed")} of the step exposed.`, learn("ring-attention", "ring attention")]);
  if (l.ep > 1) lines.push([`Expert parallel ${l.ep}: the all-to-all is ${share("ep_comm")} of the step.`, ""]);
  lines.push([`Data parallel ${l.dp}${l.zero ? `, ZeRO-${l.zero}${l.zero_group ? ` in groups of ${l.zero_group}` : ""}` : ", no ZeRO"}: ${share("dp_comm_exposed")} of the step is exposed DP traffic.`, learn(l.zero ? "zero-stages" : "ring-allreduce", l.zero ? "ZeRO stages" : "ring all-reduce")]);
  lines.push([`Recompute ${l.recompute}, micro-batch ${l.micro_batch}: the largest stage needs ${(entry.memory.total / GIB).toFixed(1)} of the ${(out.budget_bytes / GIB).toFixed(1)} GiB budget.`, learn("memory-budget", "the memory budget")]);
  return lines.map(([text, link]) => `<li>${escapeHtml(text)}${link ? ` ${link}` : ""}</li>`).join("");
}

function renderAnswer(out, best, state) {
  const choose = out.choose ?? state.choose, fastest = out.ranked[0];
  const first = out.ranked.filter((r) => r.tier === 1);
  document.getElementById("answer-kind").textContent = best.short === fastest.short
    ? `The fastest layout${choose === "simplest" ? ", and the simplest of those tied with it" : ""}`
    : `The simplest layout tied with the fastest (${fastest.short}, ${humanTime(fastest.estimate.total)})`;
  document.getElementById("answer-layout").textContent = best.short;
  document.getElementById("decisions").innerHTML = decisions(best, out);
  const tiers = out.tiers;
  document.getElementById("ties").innerHTML = first.length
    ? `${first.length === 1 ? "No row ties with the fastest" : `${first.length === out.ranked.length ? "All rows shown" : `Rows ${escapeHtml(first.map((r) => r.rank).join(", "))}`} are ties: the model cannot order them${tiers ? ` (the first tier: ${tiers.count.toLocaleString("en")} layouts within a resolution of ${pct(tiers.resolution, 0)}; <span title="${escapeHtml(tiers.rule)}">rule</span>)` : ""}`}; a tie is marked in the table's first column.`
    : "";
  for (const radio of document.querySelectorAll("input[name=choose-view]")) radio.checked = radio.value === choose;
}
