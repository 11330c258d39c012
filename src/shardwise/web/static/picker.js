// Model and GPU pickers shared by the planner and memory pages: presets from the API, or a
// Hugging Face config.json read in the browser and checked by POST /api/models (kept in this
// tab's sessionStorage so the page can re-run; a shared link needs the file again).
import { api, escapeHtml, humanCount, showError } from "/static/common.js";

const UPLOAD_KEY = "shardwise-upload";
export const UPLOAD = "upload";

export async function setupPickers(form, onChange) {
  const [models, hardware] = await Promise.all([api("/api/models"), api("/api/hardware")]);
  const select = form.elements.model;
  select.innerHTML = models.map((m) => `<option value="${m.name}">${m.name} (${humanCount(m.total_params)})</option>`).join("")
    + `<option value="${UPLOAD}">config.json…</option>`;
  const gpu = form.elements.gpu;
  gpu.innerHTML = Object.entries(hardware.aliases).map(([alias, name]) => `<option value="${alias}">${alias} (${name})</option>`).join("")
    + Object.keys(hardware.accelerators).filter((n) => !Object.values(hardware.aliases).includes(n))
      .map((n) => `<option value="${n}">${n}</option>`).join("");
  for (const stacks of form.querySelectorAll("select[data-stacks]")) {
    stacks.innerHTML = Object.entries(hardware.stacks).map(([name, title]) => `<option value="${name}">${escapeHtml(title)}</option>`).join("");
  }
  for (const links of form.querySelectorAll("select[data-links]")) {
    links.innerHTML = `<option value="">the GPU's default</option>` + Object.keys(hardware.links).map((n) => `<option value="${n}">${n}</option>`).join("");
  }
  const file = form.querySelector("input[type=file]");
  const status = form.querySelector("#upload-status");
  const slot = form.querySelector('[data-error-for="model"]');
  const upload = uploaded();
  if (upload) status.textContent = `${upload.name}: uploaded`;
  select.addEventListener("change", () => {
    if (select.value === UPLOAD && !uploaded()) file.click();
  });
  file.addEventListener("change", async () => {
    const chosen = file.files[0];
    if (!chosen) return;
    showError(slot, "");
    try {
      if (chosen.size > 1_000_000) throw new Error(`${chosen.name} is over 1 MB; a config.json is a few kB`);
      let config;
      try { config = JSON.parse(await chosen.text()); } catch { throw new Error(`${chosen.name} is not valid JSON`); }
      const name = chosen.name === "config.json" ? "uploaded" : chosen.name.replace(/\.json$/, "").replace(/[^\w.+-]/g, "_");
      const row = await api("/api/models", { name, config }, { method: "POST" });
      sessionStorage.setItem(UPLOAD_KEY, JSON.stringify({ name, config }));
      status.innerHTML = `${escapeHtml(row.name)}: ${row.layers} layers, h=${row.hidden}, ${humanCount(row.total_params)} parameters`;
      select.value = UPLOAD;
      onChange();
    } catch (error) {
      showError(slot, error.message);
      file.value = "";
    }
  });
  return models;
}

export function uploaded() {
  const raw = sessionStorage.getItem(UPLOAD_KEY);
  return raw ? JSON.parse(raw) : null;
}

// The request fields naming the model: a preset, or the uploaded config.
export function modelFields(model) {
  if (model !== UPLOAD) return { model };
  const upload = uploaded();
  if (!upload) throw new Error("upload the config.json again (it is kept only in the tab that read it)");
  return { hf_config: upload };
}
