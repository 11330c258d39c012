// Shared by the Learn pages: the list of explainers, the page frame, a small widget loop
// (URL state -> API -> draw), SVG helpers and number formatting. No formula lives here: the
// numbers come from /api/learn/*; this file only scales and draws them.
import { api, readState, renderNav, showError, writeState } from "/static/common.js";

export const WIDGETS = [
  ["memory-budget", "Drive the memory budget", "Parameters, devices and ZeRO stage against an 80 GB device."],
  ["ring-allreduce", "Step through the ring", "Reduce-scatter then all-gather, one step at a time."],
  ["zero-stages", "ZeRO stages", "What each device keeps at stages 0 to 3, for 7.5B parameters on 64 devices."],
  ["tp-mlp", "Tensor-parallel MLP", "One forward pass split over two devices, with its single all-reduce."],
  ["bubble", "Bubble vs micro-batches", "How the pipeline's idle share falls as micro-batches grow."],
  ["pipeline-grid", "Pipeline grid", "GPipe, 1F1B, interleaved and ZB-H1 on a device × time grid."],
  ["ring-attention", "Ring attention", "K/V blocks hop around the ring; causal balance by layout."],
  ["context-wall", "Context wall", "The longest sequence that fits grows with context-parallel devices."],
  ["checkpoint-interval", "How often to checkpoint", "Checkpoint stalls against the work a failure loses, and the interval between them that wastes least."],
  ["run-timeline", "A run's timeline", "One simulated run's failures, checkpoints, restarts and stragglers, and the goodput each checkpoint policy leaves."],
];

const SVG_NS = "http://www.w3.org/2000/svg";

/** An SVG element: s("rect", {x: 1, ...}, child, "text"). */
export function s(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value !== undefined && value !== null && value !== false) node.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(typeof child === "string" || typeof child === "number" ? String(child) : child);
  }
  return node;
}

/** An HTML element: h("td", {class: "x"}, "text"). */
export function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "text") node.textContent = value;
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(typeof child === "string" || typeof child === "number" ? String(child) : child);
  }
  return node;
}

/** Replace an element's children. */
export function fill(target, ...children) {
  target.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined));
  return target;
}

// ----------------------------------------------------------------------- formatting only
export const gb = (bytes, digits = 2) => (bytes / 1e9).toFixed(digits);
export const pct = (fraction, digits = 1) => `${(100 * fraction).toFixed(digits)}%`;
export const int = (x) => Math.round(x).toLocaleString("en-US");

/** 7.5e9 -> "7.5B", 1.2e11 -> "120B", 3e8 -> "300M", 1e12 -> "1T". */
export function count(x) {
  for (const [scale, suffix] of [[1e12, "T"], [1e9, "B"], [1e6, "M"], [1e3, "k"]]) {
    if (x >= scale) return `${+(x / scale).toPrecision(3)}${suffix}`;
  }
  return String(x);
}

/** Tokens: 102576 -> "103k", 6.56e6 -> "6.56M". */
// Token counts in binary units, as context lengths are spoken of: k = 2¹⁰, M = 2²⁰ tokens
// (131,072 → "128k", 2,097,152 → "2M").
export const tokens = (x) => (x >= 2 ** 20 ? `${+(x / 2 ** 20).toPrecision(3)}M` : x >= 2 ** 10 ? `${+(x / 2 ** 10).toPrecision(3)}k` : String(x));

// -------------------------------------------------------------------------- page frame
/** Nav bar, breadcrumb and previous/next links for the widget page `slug`. */
export function frame(slug) {
  renderNav();
  const index = WIDGETS.findIndex(([name]) => name === slug);
  const main = document.querySelector("main");
  main.prepend(h("p", { class: "crumbs" }, h("a", { href: "/learn/index" }, "Learn"),
    ` › ${index + 1} of ${WIDGETS.length}`));
  const links = [];
  if (index > 0) links.push(h("a", { href: `/learn/${WIDGETS[index - 1][0]}`, rel: "prev" }, `← ${WIDGETS[index - 1][1]}`));
  if (index < WIDGETS.length - 1) links.push(h("a", { href: `/learn/${WIDGETS[index + 1][0]}`, rel: "next" }, `${WIDGETS[index + 1][1]} →`));
  main.append(h("nav", { class: "prevnext", "aria-label": "explainers" }, ...links));
}

/**
 * The widget loop. `defaults` are the URL-state keys; every element with `data-key` is bound
 * to one of them (range/number/select/checkbox/radio). `load(state)` returns the API data,
 * `draw(data, state)` renders it; a later change supersedes a pending request. `toControl` and
 * `fromControl` map a key's state value to the control's value and back (log sliders).
 * Returns {state, update(changes), redraw()}.
 */
export function widget({ defaults, load, draw, toControl = {}, fromControl = {}, onInput }) {
  const state = readState(defaults);
  const error = document.getElementById("error");
  let data = null;
  let ticket = 0;
  const controls = [...document.querySelectorAll("[data-key]")];

  function syncControls() {
    for (const control of controls) {
      const key = control.dataset.key;
      const value = toControl[key] ? toControl[key](state[key]) : state[key];
      if (control.type === "checkbox") control.checked = Boolean(value);
      else if (control.type === "radio") control.checked = control.value === String(value);
      else control.value = String(value);
      const out = document.querySelector(`output[for="${control.id}"]`);
      if (out && control.dataset.show !== undefined) out.textContent = show(key);
    }
  }

  function show(key) {
    const control = controls.find((c) => c.dataset.key === key && c.dataset.show !== undefined);
    const formatter = control && control.dataset.show;
    if (formatter === "count") return count(state[key]);
    return String(state[key]);
  }

  function readControl(control) {
    const key = control.dataset.key;
    let value = control.type === "checkbox" ? control.checked : control.value;
    if (typeof defaults[key] === "number") value = Number(value);
    return fromControl[key] ? fromControl[key](value) : value;
  }

  const figure = document.querySelector("section.widget figure");
  const caption = document.getElementById("caption");
  if (caption && !caption.textContent) caption.textContent = "Computing…";

  async function refresh() {
    writeState(state);
    const mine = ++ticket;
    figure?.setAttribute("aria-busy", "true");
    try {
      const result = await load(state);
      if (mine !== ticket) return;
      data = result;
      showError(error, "");
      draw(data, state);
    } catch (exc) {
      if (mine !== ticket) return;
      showError(error, exc.message);
    } finally {
      if (mine === ticket) figure?.removeAttribute("aria-busy");
    }
  }

  for (const control of controls) {
    const event = control.tagName === "SELECT" || control.type === "checkbox" || control.type === "radio" ? "change" : "input";
    control.addEventListener(event, () => {
      if (control.type === "radio" && !control.checked) return;
      state[control.dataset.key] = readControl(control);
      syncControls();
      if (onInput && onInput(control.dataset.key, state) === false) return;
      refresh();
    });
  }
  syncControls();
  refresh();
  return {
    state,
    get data() { return data; },
    update(changes) { Object.assign(state, changes); syncControls(); return refresh(); },
    redraw() { if (data) { writeState(state); draw(data, state); } },
  };
}

export { api, showError, writeState };

/** A slider over a list of values (positions 0..values.length-1): log-like sliders that land on round numbers. */
export function listScale(values) {
  return {
    max: values.length - 1,
    toControl: (value) => values.reduce((best, v, i) => (Math.abs(Math.log(v / value)) < Math.abs(Math.log(values[best] / value)) ? i : best), 0),
    fromControl: (position) => values[Math.max(0, Math.min(values.length - 1, position))],
  };
}

/** Round numbers from lo to hi, `mantissas` in every decade: 1e8, 1.5e8, 2e8, … */
export function decades(lo, hi, mantissas = [1, 1.5, 2, 3, 4, 5, 7, 7.5]) {
  const out = [];
  for (let scale = lo; scale <= hi; scale *= 10) for (const m of mantissas) if (m * scale <= hi * (1 + 1e-9)) out.push(+(m * scale).toPrecision(3));
  return out;
}

/** Nice ticks for a linear axis 0..max. */
export function ticks(max, count = 5) {
  if (!(max > 0)) return [0];
  const raw = max / count;
  const power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((k) => k * power).find((k) => k >= raw);
  const out = [];
  for (let t = 0; t <= max + 1e-9 * max; t += step) out.push(+t.toPrecision(12));
  return out;
}

/** Play/pause a step counter: calls `advance()` every `ms` until it returns false. */
export function player(button, advance, ms = 700) {
  let timer = null;
  const stop = () => { clearInterval(timer); timer = null; button.textContent = "▶ Play"; button.setAttribute("aria-pressed", "false"); };
  button.addEventListener("click", () => {
    if (timer) return stop();
    button.textContent = "❚❚ Pause";
    button.setAttribute("aria-pressed", "true");
    if (advance(true) === false) return stop();
    timer = setInterval(() => { if (advance(false) === false) stop(); }, ms);
  });
  return { stop };
}

/** Arrow keys Left/Right call back(), forward() unless focus is in a text field or slider. */
export function arrowKeys(back, forward) {
  document.addEventListener("keydown", (event) => {
    const tag = event.target.tagName;
    if (tag === "INPUT" || tag === "SELECT" || tag === "TEXTAREA") return;
    if (event.key === "ArrowRight") { forward(); event.preventDefault(); }
    if (event.key === "ArrowLeft") { back(); event.preventDefault(); }
  });
}
