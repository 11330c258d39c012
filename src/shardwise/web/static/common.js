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
  if (!response.ok) throw new ApiError(errorText(body.detail), body.detail, response.status);
  return body;
}

export class ApiError extends Error {
  constructor(message, detail, status) { super(message); this.detail = detail; this.status = status; }
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
