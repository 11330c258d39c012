// Shared by every page: the API client, the navigation bar, URL state and error display.
// No formula lives here: pages only show what the API returns.

export async function api(path, params = {}, options = {}) {
  const query = new URLSearchParams(
    Object.entries(params).filter(([, v]) => v !== undefined && v !== null && v !== ""));
  const url = options.method === "POST" ? path : `${path}?${query}`;
  const response = await fetch(url, options.method === "POST"
    ? { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(params) }
    : {});
  const body = await response.json().catch(() => ({ detail: response.statusText }));
  if (!response.ok) throw new ApiError(errorText(body.detail), body.detail, response.status, body.field);
  return body;
}

export class ApiError extends Error {
  // field: the form field a 400 names (web/tools.py FieldError)
  constructor(message, detail, status, field) { super(message); this.detail = detail; this.status = status; this.field = field; }
}

function errorText(detail) {
  if (Array.isArray(detail)) {  // pydantic 422: [{loc, msg}, ...]
    return detail.map((d) => `${d.loc.slice(1).join(".")}: ${d.msg}`).join("; ");
  }
  return String(detail);
}

const NAV = [
  ["/planner", "Planner"], ["/memory", "Memory"], ["/schedule", "Schedule"], ["/learn/index", "Learn"],
];

export function renderNav() {
  const nav = document.createElement("nav");
  nav.className = "topnav";
  nav.innerHTML = `<a class="brand" href="/">shardwise</a>` + NAV.map(([href, label]) =>
    `<a href="${href}"${location.pathname.startsWith(href.replace("/index", "")) ? ' aria-current="page"' : ""}>${label}</a>`,
  ).join("") + `<a href="/docs">API</a>`;
  document.body.prepend(nav);
}

export function readState(defaults) {
  const query = new URLSearchParams(location.search);
  const state = { ...defaults };
  for (const key of Object.keys(defaults)) {
    if (!query.has(key)) continue;
    const raw = query.get(key);
    state[key] = typeof defaults[key] === "number" ? Number(raw)
      : typeof defaults[key] === "boolean" ? raw === "1" || raw === "true" : raw;
  }
  return state;
}

export function writeState(state) {
  const query = new URLSearchParams();
  for (const [key, value] of Object.entries(state)) {
    if (value === undefined || value === null || value === "") continue;
    query.set(key, typeof value === "boolean" ? (value ? "1" : "0") : String(value));
  }
  history.replaceState(null, "", `${location.pathname}?${query}`);
}

export function showError(target, message) {
  target.textContent = message || "";
  target.hidden = !message;
}

// While the form has an error the last good result stays, dimmed, under a badge saying so.
export function markStale(results, stale) {
  let badge = results.querySelector(":scope > .stale-badge");
  if (!badge && stale) {
    badge = Object.assign(document.createElement("p"), { className: "stale-badge", textContent: "Last valid result: fix the form to update it" });
    badge.setAttribute("role", "status");
    results.prepend(badge);
  }
  results.classList.toggle("stale", stale);
  if (badge) badge.hidden = !stale;
}

// The explainer of each term a tool shows (the key of a step-time or memory part).
const EXPLAINERS = {
  tp_comm: ["tp-mlp", "tensor-parallel MLP"], cp_comm_exposed: ["ring-attention", "ring attention"],
  pp_comm: ["bubble", "bubble vs micro-batches"], bubble: ["bubble", "bubble vs micro-batches"],
  dp_comm_exposed: ["ring-allreduce", "ring all-reduce"], weights: ["memory-budget", "the memory budget"],
  grads: ["zero-stages", "ZeRO stages"], optimizer: ["zero-stages", "ZeRO stages"],
  activations: ["context-wall", "the context wall"], logits: ["context-wall", "the context wall"],
  schedule: ["pipeline-grid", "the pipeline grid"],
};

// "Learn: …" for the largest of `parts` ({key: value}) that has an explainer, else "".
export function explainerLink(parts, what) {
  const [key] = Object.entries(parts).filter(([k, v]) => EXPLAINERS[k] && v > 0).sort((a, b) => b[1] - a[1])[0] || [];
  if (!key) return "";
  const [page, title] = EXPLAINERS[key];
  return `<a class="learn-link" href="/learn/${page}">Learn: ${escapeHtml(title)}</a> <span class="hint">(${escapeHtml(what(key))})</span>`;
}

// A form field's visible name: its label without the hint.
function fieldLabel(form, name) {
  const control = form.querySelector(`[name="${name}"]`);
  const label = form.querySelector(`label[for="${control?.id}"]`) || (control && document.getElementById(`${name}-label`));
  if (!label) return null;
  const copy = label.cloneNode(true);
  copy.querySelectorAll(".hint, output").forEach((el) => el.remove());
  return copy.textContent.replace(/[:\s]+$/, "").trim();
}

// The CLI's wording in plain words: "--gpus 64" → "GPUs (64)", naming the form's field.
export function plainWords(message, form) {
  return String(message).replace(/--([a-z][a-z-]*)(?: ([^\s,;)]+))?/g, (whole, option, value) => {
    const label = fieldLabel(form, option.replaceAll("-", "_"));
    if (!label) return whole;
    return value === undefined ? label : `${label} (${value})`;
  });
}

// ---- formatting (units.py's human_time / human_count, for display only) ----
export function humanTime(s) {
  if (s < 1e-3) return `${(s * 1e6).toFixed(1)} µs`;
  if (s < 1) return `${(s * 1e3).toFixed(1)} ms`;
  if (s < 120) return `${s.toFixed(2)} s`;
  if (s < 7200) return `${(s / 60).toFixed(1)} min`;
  if (s < 3 * 86400) return `${(s / 3600).toFixed(1)} h`;
  return `${(s / 86400).toFixed(1)} days`;
}

export function humanCount(n) {
  for (const [scale, suffix] of [[1e12, "T"], [1e9, "B"], [1e6, "M"], [1e3, "K"]]) {
    if (Math.abs(n) >= scale) return `${Number((n / scale).toPrecision(3))}${suffix}`;
  }
  return `${Number(n.toPrecision(3))}`;
}

export const pct = (x, digits = 1) => `${(100 * x).toFixed(digits)}%`;

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

// ---- forms: controls named like the state keys ----
export function fillForm(form, state) {
  for (const [key, value] of Object.entries(state)) {
    const controls = form.querySelectorAll(`[name="${key}"]`);
    for (const el of controls) {
      if (el.type === "checkbox") el.checked = Boolean(value);
      else if (el.type === "radio") el.checked = el.value === String(value);
      else el.value = value ?? "";
    }
  }
}

export function readForm(form, defaults) {
  const state = {};
  for (const [key, fallback] of Object.entries(defaults)) {
    const controls = [...form.querySelectorAll(`[name="${key}"]`)];
    if (!controls.length) { state[key] = fallback; continue; }
    const el = controls.find((c) => c.type !== "radio" || c.checked) || controls[0];
    if (el.type === "checkbox") state[key] = el.checked;
    else if (typeof fallback === "number") state[key] = el.value === "" ? fallback : Number(el.value);
    else state[key] = el.value;
  }
  return state;
}

// Show an API error next to the field it names (422: pydantic's loc; 400: the option the
// CLI's message names, e.g. "--gpus 8" or "unknown accelerator"), else in `fallback`.
// Messages are shown in plain words, the field they concern named by its label.
export function showFieldErrors(form, error, fallback, aliases = {}) {
  clearFieldErrors(form);
  const items = Array.isArray(error.detail)
    ? error.detail.map((d) => [String(d.loc[d.loc.length - 1]), `${d.msg}`])
    : [[error.field ?? null, error.message]];
  const unplaced = [];
  for (const [loc, message] of items) {
    const name = loc && form.querySelector(`[name="${loc}"]`) ? loc : guessField(form, message, aliases);
    const slot = name && form.querySelector(`[data-error-for="${name}"]`);
    const label = name && fieldLabel(form, name);
    const plain = plainWords(message, form);
    if (slot) {
      showError(slot, plain);
      form.querySelector(`[name="${name}"]`)?.setAttribute("aria-invalid", "true");
    }
    unplaced.push(label && !plain.includes(label) ? `${label}: ${plain}` : plain);
  }
  showError(fallback, unplaced.join("; "));
}

export function clearFieldErrors(form) {
  for (const slot of form.querySelectorAll("[data-error-for]")) showError(slot, "");
  for (const el of form.querySelectorAll("[aria-invalid]")) el.removeAttribute("aria-invalid");
}

function guessField(form, message, aliases) {
  for (const [word, name] of Object.entries(aliases)) if (message.includes(word)) return name;
  for (const slot of form.querySelectorAll("[data-error-for]")) {
    const name = slot.dataset.errorFor;
    const option = `--${name.replaceAll("_", "-")}`;
    if (message.includes(`${option} `) || message.includes(`${option})`) || message.startsWith(`${name}=`)) return name;
  }
  return null;
}

export function debounce(fn, ms = 150) {
  let timer;
  return (...args) => { clearTimeout(timer); timer = setTimeout(() => fn(...args), ms); };
}

export async function copyText(button, text) {
  try { await navigator.clipboard.writeText(text); } catch {
    const area = Object.assign(document.createElement("textarea"), { value: text });
    document.body.append(area); area.select(); document.execCommand("copy"); area.remove();
  }
  const label = button.textContent;
  button.textContent = "Copied";
  setTimeout(() => { button.textContent = label; }, 1200);
}
