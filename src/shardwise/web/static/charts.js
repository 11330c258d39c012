// Inline SVG charts drawn from API numbers: scaling to pixels is the only arithmetic here.
import { escapeHtml } from "/static/common.js";

function niceStep(span, ticks = 5) {
  const raw = span / ticks;
  const power = 10 ** Math.floor(Math.log10(raw));
  return [1, 2, 2.5, 5, 10].map((m) => m * power).find((s) => s >= raw) || raw;
}

function ticksUpTo(max) {
  const step = niceStep(max || 1);
  const out = [];
  for (let v = 0; v <= max * 1.0001 + 1e-12; v += step) out.push(v);
  return out;
}

// A chart's width in SVG units: the element's own width in pixels, at most `natural`, so that
// text drawn at 11 units reads at 11 px on a phone instead of shrinking with the figure.
export function fitWidth(element, natural) {
  const room = element?.clientWidth || natural;
  return Math.max(240, Math.min(natural, Math.floor(room)));
}

const fmtTick = (v) => (Math.abs(v) >= 100 || Number.isInteger(v) ? v.toFixed(0) : v.toPrecision(3).replace(/\.?0+$/, ""));

// Stacked columns, one per group (e.g. pipeline stage), against an optional budget line.
// groups: [{label, values: {key: number}}]; keys: [{key, label, color}]; values already in display units.
export function stackedColumns({ groups, keys, budget = null, unit = "", title = "", width = 760, height = 300 }) {
  const left = 54, right = 16, top = 16, bottom = 34;
  const totals = groups.map((g) => keys.reduce((s, k) => s + (g.values[k.key] || 0), 0));
  const max = Math.max(...totals, budget || 0) * 1.08 || 1;
  const y = (v) => top + (height - top - bottom) * (1 - v / max);
  const band = (width - left - right) / groups.length;
  const bar = Math.max(2, Math.min(64, band * 0.7));
  const parts = [`<svg viewBox="0 0 ${width} ${height}" role="img" aria-label="${escapeHtml(title)}">`];
  for (const t of ticksUpTo(max)) {
    parts.push(`<line x1="${left}" x2="${width - right}" y1="${y(t)}" y2="${y(t)}" stroke="#e5e7eb"/>`,
      `<text x="${left - 6}" y="${y(t) + 4}" text-anchor="end">${fmtTick(t)}</text>`);
  }
  parts.push(`<text x="12" y="${top + (height - top - bottom) / 2}" transform="rotate(-90 12 ${top + (height - top - bottom) / 2})" text-anchor="middle">${escapeHtml(unit)}</text>`);
  const labelEvery = Math.ceil(groups.length / 24);
  groups.forEach((g, i) => {
    const x = left + band * i + (band - bar) / 2;
    let acc = 0;
    for (const k of keys) {
      const v = g.values[k.key] || 0;
      if (v <= 0) continue;
      parts.push(`<rect class="seg-${k.key}" x="${x}" y="${y(acc + v)}" width="${bar}" height="${y(acc) - y(acc + v)}" fill="${k.color}"><title>${escapeHtml(g.label)} · ${escapeHtml(k.label)}: ${v.toFixed(2)} ${escapeHtml(unit)}</title></rect>`);
      acc += v;
    }
    if (i % labelEvery === 0) parts.push(`<text x="${x + bar / 2}" y="${height - bottom + 14}" text-anchor="middle">${escapeHtml(g.label)}</text>`);
  });
  if (budget) {
    parts.push(`<line class="budget" x1="${left}" x2="${width - right}" y1="${y(budget)}" y2="${y(budget)}" stroke="#b42318" stroke-width="1.5" stroke-dasharray="6 4"/>`,
      `<text x="${width - right}" y="${y(budget) - 5}" text-anchor="end" style="fill:#b42318">budget ${budget.toFixed(2)} ${escapeHtml(unit)}</text>`);
  }
  parts.push("</svg>");
  return parts.join("");
}

// Horizontal bars, one per row: rows [{label, value, color, text}], value in display units;
// `max` fixes the scale (to compare several charts), else the largest row fills the width.
// Narrow (a phone): each label above its bar.
export function horizontalBars({ rows, title = "", width = 520, max = null }) {
  const narrow = width < 420;
  const rowH = narrow ? 36 : 24, left = narrow ? 0 : 170, right = narrow ? 120 : 110, top = narrow ? 14 : 0;
  const height = rows.length * rowH + 8;
  max = max || Math.max(...rows.map((r) => r.value)) || 1;
  const parts = [`<svg viewBox="0 0 ${width} ${height}" role="img" aria-label="${escapeHtml(title)}">`];
  rows.forEach((r, i) => {
    const y = 4 + i * rowH;
    const w = ((width - left - right) * r.value) / max;
    parts.push(narrow ? `<text x="0" y="${y + 10}">${escapeHtml(r.label)}</text>`
      : `<text x="${left - 8}" y="${y + 16}" text-anchor="end">${escapeHtml(r.label)}</text>`,
    `<rect x="${left}" y="${y + top + 3}" width="${Math.max(w, r.value > 0 ? 1 : 0)}" height="16" rx="3" fill="${r.color}"><title>${escapeHtml(r.label)}: ${escapeHtml(r.text)}</title></rect>`,
    `<text x="${left + w + 6}" y="${y + top + 16}">${escapeHtml(r.text)}</text>`);
  });
  parts.push("</svg>");
  return parts.join("");
}

// Pipeline Gantt chart: events [{stage, kind, microbatch, chunk, start, end}] from the simulator.
const KIND_COLOR = { F: "var(--forward)", B: "var(--backward)", W: "var(--wgrad)" };
// `width`: the drawing's width in screen pixels (fitWidth), so its labels keep their size on a
// phone instead of shrinking with a wide drawing.
export function gantt({ events, stages, makespan, chunks = 1, title = "", width = 1000 }) {
  const left = 62, right = 12, top = 8, row = 26, box = 20;
  const height = top + stages * row + 30;
  const x = (t) => left + ((width - left - right) * t) / makespan;
  const parts = [`<svg viewBox="0 0 ${width} ${height}" role="img" aria-label="${escapeHtml(title)}">`];
  for (let s = 0; s < stages; s++) {
    parts.push(`<text x="${left - 8}" y="${top + s * row + box / 2 + 4}" text-anchor="end">stage ${s}</text>`,
      `<rect x="${left}" y="${top + s * row}" width="${width - left - right}" height="${box}" fill="#f1f3f7"/>`);
  }
  for (const e of events) {
    const w = x(e.end) - x(e.start);
    const label = `${e.kind}${e.microbatch}${chunks > 1 ? `.${e.chunk}` : ""}`;
    const opacity = chunks > 1 ? 1 - (0.45 * e.chunk) / Math.max(1, chunks - 1) : 1;
    const y = top + e.stage * row;
    parts.push(`<g class="ev ev-${e.kind}"><rect x="${x(e.start)}" y="${y}" width="${Math.max(w - 0.6, 0.5)}" height="${box}" fill="${KIND_COLOR[e.kind]}" fill-opacity="${opacity}" rx="2"><title>stage ${e.stage}: ${label} from ${e.start} to ${e.end}</title></rect>`);
    if (w > 8 * label.length) parts.push(`<text x="${x(e.start) + w / 2}" y="${y + box / 2 + 4}" text-anchor="middle" style="fill:#fff">${label}</text>`);
    parts.push("</g>");
  }
  const axis = top + stages * row + 2;
  for (const t of ticksUpTo(makespan)) {
    parts.push(`<line x1="${x(t)}" x2="${x(t)}" y1="${axis}" y2="${axis + 4}" stroke="#9aa3b2"/>`,
      `<text x="${x(t)}" y="${axis + 16}" text-anchor="middle">${fmtTick(t)}</text>`);
  }
  parts.push("</svg>");
  return parts.join("");
}

export function legend(keys) {
  return keys.map((k) => `<span><i style="background:${k.color}"></i>${escapeHtml(k.label)}</span>`).join("");
}
