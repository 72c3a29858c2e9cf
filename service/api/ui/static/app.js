/* loraplex dashboard: sign in with an API key (sessionStorage only), the tasks of the tenant,
   one task live (loss curves, leaderboard, events, usage, result file, tracking, downloads,
   cancel/pause/resume) and the cluster (operator token). Plain JavaScript against the public API; no build step. */
"use strict";

const store = {
  get key() { return sessionStorage.getItem("lpx.key") || ""; },
  set key(v) { v ? sessionStorage.setItem("lpx.key", v) : sessionStorage.removeItem("lpx.key"); },
  get op() { return sessionStorage.getItem("lpx.op") || ""; },
  set op(v) { v ? sessionStorage.setItem("lpx.op", v) : sessionStorage.removeItem("lpx.op"); },
};
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
const JOB_DONE = new Set(["exited", "completed", "failed", "cancelled"]);
const MAX_POINTS = 500;
let view = { stop() {} };

/* ---------- small helpers ---------- */

function h(tag, attrs, ...kids) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else if (k === "style") el.style.cssText = v; // CSSOM: allowed by the page's CSP, unlike the attribute
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const kid of kids.flat()) {
    if (kid === null || kid === undefined || kid === false) continue;
    el.appendChild(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return el;
}

function flash(msg, kind) {
  const el = document.getElementById("flash");
  el.textContent = msg || "";
  el.className = `flash ${kind || "error"}`;
  el.hidden = !msg;
}

class ApiError extends Error {
  constructor(status, body) {
    const e = (body && body.error) || {};
    super(e.message || (typeof body === "string" && body) || `HTTP ${status}`);
    this.status = status;
    this.code = e.code || "";
    this.param = e.param || null;
  }
}

async function api(path, opts) {
  const o = opts || {};
  const token = o.operator ? store.op : store.key;
  const headers = Object.assign({}, o.headers || {});
  if (token) headers.Authorization = `Bearer ${token}`;
  let body = o.body;
  if (o.json !== undefined) { headers["Content-Type"] = "application/json"; body = JSON.stringify(o.json); }
  for (let attempt = 1; ; attempt++) {
    const r = await fetch(path, { method: o.method || "GET", headers, body, signal: o.signal });
    if (o.raw) { if (!r.ok) throw new ApiError(r.status, await r.json().catch(() => null)); return r; }
    const text = await r.text();
    let data = null;
    try { data = text ? JSON.parse(text) : null; } catch (_) { data = text; }
    // A request that raced a concurrent change was rolled back (nothing changed): send it again.
    const raced = r.status === 503 && data && data.error && data.error.code === "concurrent_change";
    if (raced && attempt < 4) {
      const wait = Math.min(5, Number(r.headers.get("Retry-After")) || 1);
      await new Promise((done) => setTimeout(done, wait * 1000));
      continue;
    }
    if (!r.ok) throw new ApiError(r.status, data);
    return data;
  }
}

function errText(e) {
  if (e instanceof ApiError) return `${e.message}${e.param ? ` (${e.param})` : ""}`;
  return String((e && e.message) || e);
}

function randomKey() {
  const b = new Uint8Array(16);
  crypto.getRandomValues(b);
  return Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
}

/* A time of the API: ISO 8601, or Unix seconds (the OpenAI-style fields). */
function toDate(v) { return typeof v === "number" ? new Date(v * 1000) : new Date(v); }

function when(iso) {
  if (iso === null || iso === undefined || iso === "") return "";
  const t = toDate(iso), d = (t.getTime() - Date.now()) / 1000, a = Math.abs(d);
  const rel = a < 60 ? `${Math.round(a)} s` : a < 3600 ? `${Math.round(a / 60)} min` : `${(a / 3600).toFixed(1)} h`;
  return d > 5 ? `in ${rel}` : a <= 5 ? "now" : `${rel} ago`;
}

function timeCell(iso, planned) {
  if (!iso) return h("td", { class: "muted" }, "-");
  return h("td", { title: toDate(iso).toLocaleString() }, planned ? h("span", { class: "muted" }, "planned ") : "", when(iso));
}

function stateBadge(state, id) {
  return h("span", { class: `badge s-${state}`, id }, state);
}

function fmtLoss(x) { return x === null || x === undefined ? "-" : Number(x).toFixed(4); }

function short(id) { return id ? id.slice(0, 14) : ""; }

async function download(path, fallbackName, msgEl) {
  try {
    const r = await api(path, { raw: true });
    const cd = r.headers.get("Content-Disposition") || "";
    const m = /filename="([^"]+)"/.exec(cd);
    const url = URL.createObjectURL(await r.blob());
    const a = h("a", { href: url, download: m ? m[1] : fallbackName, hidden: true });
    document.body.appendChild(a);
    a.click();
    setTimeout(() => { URL.revokeObjectURL(url); a.remove(); }, 60000);
    if (msgEl) msgEl.textContent = `Downloaded ${m ? m[1] : fallbackName}`;
  } catch (e) {
    if (msgEl) msgEl.textContent = `Download failed: ${errText(e)}`;
    flash(`Download failed: ${errText(e)}`);
  }
}

/* ---------- routing ---------- */

function route() {
  view.stop();
  view = { stop() {} };
  flash("");
  const main = document.getElementById("view");
  while (main.firstChild) main.removeChild(main.firstChild);
  const hash = location.hash.replace(/^#\/?/, "");
  const [page, arg] = hash.split("/");
  const signedIn = !!(store.key || store.op);
  document.getElementById("nav").hidden = !signedIn;
  document.getElementById("sign-out").hidden = !signedIn;
  document.getElementById("whoami").textContent = store.key ? `key …${store.key.slice(-4)}` : store.op ? "operator" : "";
  for (const a of document.querySelectorAll("#nav a")) a.classList.toggle("active", a.id === `nav-${page === "task" ? "tasks" : page}`);
  if (!signedIn || page === "signin") return signInView(main);
  if (page === "cluster") return clusterView(main);
  if (!store.key) return signInView(main, "Tasks need an API key.");
  if (page === "task" && arg) return taskView(main, decodeURIComponent(arg));
  if (page === "webhooks") return webhooksView(main); // webhooks.js
  if (page === "usage") return usageView(main); // usage.js
  return tasksView(main);
}

/* ---------- sign in ---------- */

function signInView(main, note) {
  const key = h("input", { id: "api-key", type: "password", autocomplete: "off", placeholder: "lpx-…", value: store.key });
  const op = h("input", { id: "op-token", type: "password", autocomplete: "off", placeholder: "optional: for the cluster view", value: store.op });
  const msg = h("p", { id: "signin-msg", class: "error-text" }, note || "");
  const form = h("form", { class: "card narrow", id: "signin-form", onsubmit: async (ev) => {
    ev.preventDefault();
    msg.textContent = "";
    const k = key.value.trim(), o = op.value.trim();
    if (!k && !o) { msg.textContent = "Enter an API key (or an operator token for the cluster view)."; return; }
    try {
      if (k) { store.key = k; await api("/v1/models"); }
      if (o) { store.op = o; await api("/v1/cluster", { operator: true }); }
      location.hash = k ? "#/tasks" : "#/cluster";
      route();
    } catch (e) {
      store.key = ""; store.op = "";
      msg.textContent = `Sign-in failed: ${errText(e)}`;
    }
  } },
  h("h1", {}, "Sign in"),
  h("p", { class: "muted" }, "Your API key stays in this browser tab (session storage) and is sent only to this service."),
  h("label", {}, "API key", key),
  h("label", {}, "Operator token", op),
  h("button", { id: "btn-sign-in", type: "submit", class: "primary" }, "Sign in"),
  msg);
  main.appendChild(form);
  key.focus();
}

/* ---------- tasks list + create ---------- */

function progress(t) {
  const done = Object.entries(t.job_counts || {}).filter(([s]) => JOB_DONE.has(s)).reduce((a, [, n]) => a + n, 0);
  const frac = t.num_jobs ? done / t.num_jobs : 0;
  return h("td", {}, h("div", { class: "progress", role: "progressbar", "aria-valuenow": Math.round(frac * 100), "aria-valuemin": 0, "aria-valuemax": 100 },
    h("div", { style: `width:${(frac * 100).toFixed(1)}%` })), h("span", { class: "muted small" }, `${done}/${t.num_jobs} jobs`));
}

function tasksView(main) {
  const tbody = h("tbody", { id: "tasks-body" });
  const table = h("div", { class: "scroll" }, h("table", { id: "tasks-table", class: "grid-table" },
    h("thead", {}, h("tr", {}, ["Task", "State", "Model", "Progress", "Start", "Finish", "Created"].map((c) => h("th", {}, c)))), tbody));
  main.appendChild(h("section", { class: "layout" },
    h("div", { class: "card wide" }, h("h2", {}, "Tasks"), table, h("p", { class: "muted small", id: "tasks-count" })),
    createForm()));
  let timer = null, stopped = false;
  async function refresh() {
    try {
      const page = await api("/v1/tasks?limit=100");
      if (stopped) return; // the page changed while this was loading
      while (tbody.firstChild) tbody.removeChild(tbody.firstChild);
      for (const t of page.data) {
        tbody.appendChild(h("tr", { "data-task": t.id },
          h("td", {}, h("a", { href: `#/task/${t.id}`, class: "mono", title: t.id }, t.id.replace(/^task_/, "").slice(0, 12))),
          h("td", {}, stateBadge(t.state)),
          h("td", {}, t.base_model, h("span", { class: "muted small" }, ` ${t.method}`)),
          progress(t),
          t.started_at ? timeCell(t.started_at) : timeCell(t.planned_start, true),
          t.finished_at ? timeCell(t.finished_at) : timeCell(t.planned_end, true),
          timeCell(t.created_at)));
      }
      if (!page.data.length) tbody.appendChild(h("tr", {}, h("td", { colspan: 7, class: "muted" }, "No tasks yet: create one with the form.")));
      document.getElementById("tasks-count").textContent = `${page.data.length}${page.has_more ? "+" : ""} tasks, refreshed ${new Date().toLocaleTimeString()}`;
    } catch (e) {
      if (stopped) return;
      if (e.status === 401) { store.key = ""; location.hash = "#/signin"; return; }
      flash(`Could not load tasks: ${errText(e)}`);
    }
    if (!stopped) timer = setTimeout(refresh, 3000);
  }
  refresh();
  view = { stop() { stopped = true; clearTimeout(timer); } };
}

function listOf(text, kind, field) {
  const items = text.split(/[,\s]+/).filter(Boolean);
  if (!items.length) return undefined;
  return items.map((s) => {
    const v = Number(s);
    if (!isFinite(v) || (kind === "int" && !Number.isInteger(v))) throw new Error(`${field}: "${s}" is not ${kind === "int" ? "an integer" : "a number"}`);
    return v;
  });
}

let dryRunSupported = null;
async function supportsDryRun() {
  if (dryRunSupported !== null) return dryRunSupported;
  try {
    const spec = await fetch("/openapi.json").then((r) => r.json());
    const post = ((spec.paths || {})["/v1/tasks"] || {}).post || {};
    dryRunSupported = (post.parameters || []).some((p) => p.name === "dry_run");
  } catch (_) { dryRunSupported = false; }
  return dryRunSupported;
}

function createForm() {
  const uploaded = new Map(); // file identity -> file id, so a second click does not upload again
  const field = (label, input, hint) => h("label", {}, label, input, hint ? h("span", { class: "muted small" }, hint) : null);
  const train = h("input", { id: "f-train", type: "file", accept: ".jsonl,.json,application/jsonl" });
  const val = h("input", { id: "f-val", type: "file", accept: ".jsonl,.json,application/jsonl" });
  const model = h("select", { id: "f-model" });
  const method = h("select", { id: "f-method" }, h("option", { value: "sft" }, "sft"));
  const methodKnobs = h("div", { id: "f-method-knobs", class: "row2" }); // the chosen method's own knobs
  const ownKnobs = []; // [method, knob name, input]
  const showKnobs = () => { for (const [m, , input] of ownKnobs) input.parentNode.hidden = m !== method.value; };
  method.addEventListener("change", showKnobs);
  fetch("/ui/v1/methods").then((r) => r.json()).then((p) => { // the methods, from contract.methods
    method.textContent = "";
    for (const m of p.data) {
      method.appendChild(h("option", { value: m.name, title: m.summary }, m.name));
      for (const k of m.knobs) {
        const input = h("input", { id: `f-knob-${k.name}`, value: String(k.default) });
        ownKnobs.push([m.name, k.name, input]);
        methodKnobs.appendChild(field(k.name, input));
      }
    }
    showKnobs();
  }).catch(() => {});
  const lr = h("input", { id: "f-lr", value: "1e-4, 3e-4" });
  const rank = h("input", { id: "f-rank", value: "8" });
  const alpha = h("input", { id: "f-alpha", value: "16" });
  const bs = h("input", { id: "f-bs", value: "8" });
  const epochs = h("input", { id: "f-epochs", type: "number", min: 1, max: 100, value: 1 });
  const extra = h("textarea", { id: "f-extra", rows: 4, spellcheck: "false", placeholder: '{"early_exit": {"keep_fraction": 0.5}, "eval": {"eval_every_steps": 20}}' });
  const est = h("div", { id: "estimate", class: "estimate", hidden: true });
  const msg = h("p", { id: "create-msg", class: "error-text" });
  const estBtn = h("button", { id: "btn-estimate", type: "button" }, "Estimate");
  const createBtn = h("button", { id: "btn-create", type: "submit", class: "primary" }, "Create task");
  api("/v1/models").then((p) => {
    for (const m of p.data) model.appendChild(h("option", { value: m.id }, `${m.id} (${m.family || "?"}, ${m.gpus} GPU)`));
    if (!p.data.length) msg.textContent = "No base models are registered on this service.";
  }).catch((e) => { msg.textContent = `Could not load models: ${errText(e)}`; });
  supportsDryRun().then((ok) => { if (!ok) { estBtn.disabled = true; estBtn.title = "This API has no dry run (POST /v1/tasks?dry_run=true)"; } });

  async function upload(input, what) {
    const f = input.files && input.files[0];
    if (!f) return null;
    const id = `${f.name}:${f.size}:${f.lastModified}`;
    if (uploaded.has(id)) return uploaded.get(id);
    msg.textContent = `Uploading ${f.name}…`;
    const form = new FormData();
    form.append("file", f, f.name);
    form.append("purpose", "fine-tune");
    try {
      const out = await api("/v1/files", { method: "POST", body: form });
      uploaded.set(id, out.id);
      return out.id;
    } catch (e) { throw new Error(`${what} file: ${errText(e)}`); }
  }

  async function body() {
    const space = {};
    const knobs = [["learning_rate", lr, "num"], ["lora_rank", rank, "int"], ["lora_alpha", alpha, "num"], ["batch_size", bs, "int"]];
    for (const [m, k, input] of ownKnobs) if (m === method.value) knobs.push([k, input, "num"]);
    for (const [k, input, kind] of knobs) { const v = listOf(input.value, kind, k); if (v) space[k] = v; }
    let more = {};
    if (extra.value.trim()) {
      try { more = JSON.parse(extra.value); } catch (e) { throw new Error(`extra settings: not JSON (${e.message})`); }
      if (typeof more !== "object" || Array.isArray(more) || more === null) throw new Error("extra settings: must be a JSON object");
    }
    if (!train.files || !train.files[0]) throw new Error("training file: choose a JSONL file");
    const b = Object.assign({ base_model: model.value, method: method.value, epochs: Number(epochs.value) || 1 }, more);
    b.search_space = Object.assign({}, space, more.search_space || {});
    b.training_file = await upload(train, "training");
    const v = await upload(val, "validation");
    if (v) b.validation_file = v;
    return b;
  }

  estBtn.addEventListener("click", async () => {
    msg.textContent = "";
    est.hidden = true;
    try {
      const out = await api("/v1/tasks?dry_run=true", { method: "POST", json: await body() });
      if (!out || out.dry_run !== true) { msg.textContent = "This API gave no estimate."; return; }
      while (est.firstChild) est.removeChild(est.firstChild);
      const row = (k, v) => h("div", {}, h("dt", {}, k), h("dd", {}, v));
      est.appendChild(h("h3", {}, "Estimate (nothing started)"));
      est.appendChild(h("dl", {},
        row("Jobs", out.num_jobs ?? (out.jobs || []).length),
        row("GPUs", out.gpus ?? "-"),
        row("Trained tokens", out.trained_tokens != null ? Number(out.trained_tokens).toLocaleString() : "-"),
        row("With early exit", out.expected_tokens != null ? Number(out.expected_tokens).toLocaleString() : "-"),
        row("GPU hours", out.estimated_gpu_hours != null ? Number(out.estimated_gpu_hours).toPrecision(3) : "-"),
        row("Start", out.estimated_start != null ? `${toDate(out.estimated_start).toLocaleTimeString()} (${when(out.estimated_start)})` : "-"),
        row("Finish", out.estimated_finish != null ? `${toDate(out.estimated_finish).toLocaleTimeString()} (${when(out.estimated_finish)})` : "-")));
      est.hidden = false;
      msg.textContent = "";
    } catch (e) { msg.textContent = `Estimate failed: ${errText(e)}`; }
  });

  let idem = randomKey();
  const form = h("form", { class: "card", id: "create-form", onsubmit: async (ev) => {
    ev.preventDefault();
    msg.textContent = "";
    createBtn.disabled = true;
    try {
      const task = await api("/v1/tasks", { method: "POST", json: await body(), headers: { "Idempotency-Key": idem } });
      idem = randomKey();
      location.hash = `#/task/${task.id}`;
    } catch (e) {
      msg.textContent = `Create failed: ${errText(e)}`;
    } finally { createBtn.disabled = false; }
  }, oninput: () => { idem = randomKey(); } },
  h("h2", {}, "New task"),
  field("Training file (JSONL)", train),
  field("Validation file", val, "optional: else a held-out split"),
  h("div", { class: "row2" }, field("Base model", model), field("Method", method)),
  h("fieldset", {}, h("legend", {}, "Search space (comma-separated lists; the grid of them is the jobs)"),
    h("div", { class: "row2" }, field("learning_rate", lr), field("lora_rank", rank)),
    h("div", { class: "row2" }, field("lora_alpha", alpha), field("batch_size", bs)), methodKnobs),
  field("Epochs", epochs),
  field("More settings (JSON, merged into the request)", extra, "e.g. early_exit, eval, max_seq_len, validation_split, priority"),
  h("div", { class: "buttons" }, estBtn, createBtn),
  est, msg);
  return form;
}

/* ---------- one task ---------- */

function taskView(main, taskId) {
  const st = { task: null, jobs: [], curves: {}, events: [], sort: { key: "best_val_loss", dir: 1 },
               highlight: null, showTrain: true, showVal: true, logY: false, updates: 0,
               acc: {}, accKey: "", fileNames: {} };
  const ctl = new AbortController();
  let stopped = false, retry = null, drawPending = false;
  const msg = h("p", { id: "task-msg", class: "error-text" });
  const head = h("div", { class: "task-head" });
  const extra = h("div", { id: "task-extra" }); // usage, tracking
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.id = "loss-chart";
  svg.setAttribute("class", "chart");
  const legend = h("div", { class: "legend", id: "legend" });
  const lbBody = h("tbody", { id: "leaderboard-body" });
  const lbHead = h("tr", {});
  const log = h("ol", { id: "events", class: "events" });
  const live = h("span", { id: "live-status", class: "muted small" }, "connecting…");
  const check = (id, label, key) => h("label", { class: "inline" }, h("input", { type: "checkbox", id, checked: st[key], onchange: (e) => { st[key] = e.target.checked; draw(); } }), label);

  main.appendChild(h("section", {}, h("div", { class: "card" }, head, msg, extra)));
  main.appendChild(h("section", { class: "card" },
    h("div", { class: "chart-head" }, h("h2", {}, "Loss curves"), check("show-train", "train", "showTrain"), check("show-val", "validation", "showVal"), check("log-y", "log scale", "logY"), h("span", { class: "spacer" }), live),
    h("div", { class: "chart-wrap" }, svg), legend,
    h("p", { class: "muted small" }, "Solid: train; dashed: validation; ✕: early exit (hover for the reason). Click a leaderboard row to highlight a job.")));
  main.appendChild(h("section", { class: "card" }, h("h2", {}, "Leaderboard"),
    h("div", { class: "scroll" }, h("table", { id: "leaderboard", class: "grid-table" }, h("thead", {}, lbHead), lbBody))));
  const samplesCard = h("section", { class: "card", id: "samples", hidden: true });
  main.appendChild(samplesCard);
  // Samples on demand (POST /v1/tasks/{id}/samples): your prompts, once the task succeeded.
  const askCard = h("section", { class: "card", id: "ask-samples", hidden: true });
  main.appendChild(askCard);
  main.appendChild(h("section", { class: "card" }, h("h2", {}, "Events"), h("div", { class: "events-wrap" }, log)));

  function action(label, id, fn) { return h("button", { id, type: "button", onclick: fn }, label); }
  async function post(path, what) {
    msg.textContent = "";
    try {
      const t = await api(path, { method: "POST" });
      if (t && t.object === "task") { st.task = t; renderHead(); }
      msg.textContent = `${what}: ${t && t.state ? t.state : "ok"}`;
      msg.className = "ok-text";
    } catch (e) { msg.className = "error-text"; msg.textContent = `${what} failed: ${errText(e)}`; }
  }

  // The best adapter merged into the base model: the first click asks for it (built in the
  // background), a click once it succeeded downloads the .tar.
  async function mergedModel(id) {
    msg.textContent = "";
    try {
      const m = await api(`/v1/tasks/${id}/merged`, { method: "POST" });
      if (m.state === "succeeded") return download(`/v1/tasks/${id}/merged/content`, `${id}-merged.tar`, msg);
      msg.className = "ok-text";
      msg.textContent = `Merged model: ${m.state}; click again once it succeeded`;
    } catch (e) { msg.className = "error-text"; msg.textContent = `Merged model failed: ${errText(e)}`; }
  }

  function renderHead() {
    const t = st.task;
    while (head.firstChild) head.removeChild(head.firstChild);
    if (!t) { head.appendChild(h("h1", {}, taskId)); return; }
    const counts = Object.entries(t.job_counts || {}).map(([k, v]) => `${v} ${k}`).join(", ");
    head.appendChild(h("h1", {}, h("span", { class: "mono" }, t.id), " ", stateBadge(t.state, "task-state")));
    head.appendChild(h("p", { class: "muted" }, `${t.base_model} · ${t.method} · ${t.num_jobs} jobs (${counts}) · attempt ${t.attempt}`,
      t.planned_start ? ` · planned ${when(t.planned_start)}` : "", t.planned_end && !t.finished_at ? ` → ${when(t.planned_end)}` : "",
      t.finished_at ? ` · finished ${when(t.finished_at)}` : ""));
    if (t.error) head.appendChild(h("p", { class: "error-text" }, `${t.error.code || "error"}: ${t.error.message || ""}`));
    if (t.init_adapter_file) {
      const name = st.fileNames[t.init_adapter_file];
      head.appendChild(h("p", { id: "init-adapter", "data-file": t.init_adapter_file }, "Continued from the adapter ",
        h("span", { class: "mono" }, t.init_adapter_file), name ? ` (${name})` : "", h("span", { class: "muted small" }, ": every job started from it")));
      if (name === undefined) fileName(t.init_adapter_file);
    }
    const done = TERMINAL.has(t.state);
    const best = action("Download best adapter", "btn-best", () => download(`/v1/tasks/${t.id}/adapter`, `${t.id}.tar.gz`, msg));
    best.disabled = !t.best_job_id;
    const merged = action("Merged model", "btn-merged", () => mergedModel(t.id));
    merged.disabled = t.state !== "succeeded" || !t.best_job_id;
    const cancel = action("Cancel", "btn-cancel", () => post(`/v1/tasks/${t.id}/cancel`, "Cancel"));
    cancel.disabled = done;
    const pause = action("Pause", "btn-pause", () => post(`/v1/tasks/${t.id}/pause`, "Pause"));
    pause.disabled = done || t.state === "paused" || t.state === "pausing";
    const resume = action("Resume", "btn-resume", () => post(`/v1/tasks/${t.id}/resume`, "Resume"));
    resume.disabled = t.state !== "paused";
    // the step metrics CSV's id is the task's own (the samples file, when there is one, is another)
    const csvId = `file_${t.id.slice(t.id.indexOf("_") + 1)}`;
    const resultFile = (t.result_files || []).includes(csvId) ? csvId : null;
    const results = action("Results (CSV)", "btn-results", () => downloadResults(resultFile));
    results.disabled = !resultFile;
    results.title = resultFile ? `step metrics of every job: ${resultFile}` : "once the task has ended with step metrics";
    if (resultFile) results.dataset.file = resultFile;
    head.appendChild(h("div", { class: "buttons" }, best, merged, results, cancel, pause, resume,
      t.best_job_id ? h("span", { class: "muted small" }, `best job ${t.best_job_id}`) : null));
    while (extra.firstChild) extra.removeChild(extra.firstChild);
    extra.append(taskUsageTable(t.usage) || "", integrationsTable(t.integrations) || ""); // usage.js
  }

  // A file's name, for the page (null once asked: the id alone is shown when it cannot be read).
  async function fileName(id) {
    st.fileNames[id] = null;
    try { st.fileNames[id] = (await api(`/v1/files/${encodeURIComponent(id)}`)).filename; renderHead(); } catch (_) { /* the id says enough */ }
  }

  async function downloadResults(id) {
    if (st.fileNames[id] === undefined) await fileName(id);
    return download(`/v1/files/${encodeURIComponent(id)}/content`, st.fileNames[id] || `${id}.csv`, msg);
  }

  // Each job's validation token accuracy at its best step (what its adapter holds): the
  // task's checkpoints (GET /v1/fine_tuning/jobs/{id}/checkpoints), read again when a job's best
  // step or adapter changes.
  let accLoading = false;
  async function loadAccuracy() {
    const key = st.jobs.map((j) => `${j.id}:${j.best_step}:${j.has_adapter}`).join(",");
    if (accLoading || key === st.accKey || !st.jobs.some((j) => j.has_adapter)) return;
    accLoading = true;
    try {
      const acc = {};
      let after = null;
      for (let page = 0; page < 50; page++) {
        const q = new URLSearchParams({ limit: "100" });
        if (after) q.set("after", after);
        const r = await api(`/v1/fine_tuning/jobs/${encodeURIComponent(taskId)}/checkpoints?${q}`);
        for (const c of r.data) acc[c.job_id] = (c.metrics || {}).valid_mean_token_accuracy ?? null;
        if (!r.has_more || !r.last_id) break;
        after = r.last_id;
      }
      if (stopped) return;
      st.acc = acc;
      st.accKey = key;
      renderBoard();
    } catch (_) { /* shown as "-"; read again on the next change */ } finally { accLoading = false; }
    if (!stopped && key !== st.jobs.map((j) => `${j.id}:${j.best_step}:${j.has_adapter}`).join(",")) loadAccuracy();
  }

  // Once the stream has ended: the task as GET /v1/tasks/{id} shows it (its result file is made
  // there when the end's own attempt missed it), again every 5 s while a tracking sync is due.
  // The completions the task ended with (GET /v1/tasks/{id}/samples): each prompt's row holds the
  // base model's and each leading configuration's side by side, in the leaderboard's order.
  async function loadSamples() {
    try {
      const r = await api(`/v1/tasks/${encodeURIComponent(taskId)}/samples`);
      if (!stopped && r.data.length) renderSamples(r);
    } catch (_) { /* shown on the next end or samples event */ }
  }

  function renderAsk() {
    if (!askCard.hidden || !st.task || st.task.state !== "succeeded") return;
    const prompts = h("textarea", { id: "ask-prompts", rows: 3, placeholder: "One prompt per line (up to 32)" });
    const topK = h("input", { id: "ask-top-k", type: "number", min: 0, max: 8, value: 3 });
    const tokens = h("input", { id: "ask-tokens", type: "number", min: 1, max: 1024, value: 128 });
    const note = h("p", { class: "muted small", id: "ask-state" });
    const out = h("div", {});
    async function ask() {
      const body = { prompts: prompts.value.split("\n").filter((x) => x.trim()), top_k: Number(topK.value), max_new_tokens: Number(tokens.value) };
      try {
        let r = await api(`/v1/tasks/${encodeURIComponent(taskId)}/samples`, { method: "POST", json: body });
        while (!stopped && (r.state === "queued" || r.state === "running")) {
          note.textContent = `request ${r.id}: ${r.state}`;
          await new Promise((ok) => setTimeout(ok, 1000));
          r = await api(`/v1/tasks/${encodeURIComponent(taskId)}/samples/${encodeURIComponent(r.id)}`);
        }
        note.textContent = `request ${r.id}: ${r.state}${r.error ? ` (${r.error})` : ""}`;
        while (out.firstChild) out.removeChild(out.firstChild);
        if (r.state === "succeeded") out.appendChild(samplesTable(r));
      } catch (e) { note.textContent = e.message || String(e); }
    }
    askCard.append(h("h2", {}, "Ask your own prompts"), prompts,
      h("div", {}, h("label", {}, "top k ", topK), " ", h("label", {}, "max new tokens ", tokens), " ",
        h("button", { id: "ask-run", type: "button", onclick: ask }, "Sample")), note, out);
    askCard.hidden = false;
  }

  function renderSamples(r) {
    while (samplesCard.firstChild) samplesCard.removeChild(samplesCard.firstChild);
    samplesCard.append(h("h2", {}, "Samples"),
      h("p", { class: "muted small" }, "What the leading configurations and the base model write on the same held-out prompts. ",
        h("span", { class: "mono" }, r.file_id || "")), samplesTable(r, "samples-table"));
    samplesCard.hidden = false;
  }

  function samplesTable(r, id) {
    const cols = [...new Set(r.data.map((s) => s.job_id))];
    const rows = new Map();
    for (const s of r.data) {
      if (!rows.has(s.prompt)) rows.set(s.prompt, {});
      rows.get(s.prompt)[s.job_id] = s;
    }
    const label = (id) => {
      if (id === null) return "base model";
      const j = st.jobs.find((x) => x.id === id);
      const hp = j ? Object.entries(j.hyperparameters || {}).filter(([, v]) => v !== null).map(([k, v]) => `${k} ${v}`).join(", ") : "";
      return `${short(id)}${hp ? ` (${hp})` : ""}`;
    };
    const head = h("tr", {}, h("th", {}, "Prompt"), ...cols.map((c) => h("th", { "data-job": c ?? "base" }, label(c))));
    const body = h("tbody", {}, ...[...rows.entries()].map(([prompt, by]) =>
      h("tr", {}, h("td", {}, h("pre", { class: "sample" }, prompt)),
        ...cols.map((c) => h("td", { "data-job": c ?? "base" }, h("pre", { class: "sample" }, by[c] ? by[c].completion : ""))))));
    return h("div", { class: "scroll" }, h("table", { id, class: "grid-table" }, h("thead", {}, head), body));
  }

  async function afterEnd() {
    try {
      const t = await api(`/v1/tasks/${encodeURIComponent(taskId)}`);
      if (stopped) return;
      st.task = t;
      renderHead();
      loadSamples();
      renderAsk();
      if ((t.integrations || []).some((i) => i.status === "waiting" || i.status === "pending")) retry = setTimeout(afterEnd, 5000);
    } catch (e) {
      if (!stopped && e.status !== 404 && e.status !== 401) retry = setTimeout(afterEnd, 5000);
    }
  }

  function knobs() {
    const keys = new Set();
    for (const j of st.jobs) for (const k of Object.keys(j.hyperparameters || {})) if (j.hyperparameters[k] !== null) keys.add(k);
    return ["learning_rate", "lora_rank", "lora_alpha", "batch_size", "beta"].filter((k) => keys.has(k)).concat([...keys].filter((k) => !["learning_rate", "lora_rank", "lora_alpha", "batch_size", "beta"].includes(k)));
  }

  function renderBoard() {
    const ks = knobs();
    const cols = [["index", "#"], ...ks.map((k) => [`hp.${k}`, k]), ["state", "state"], ["exit_reason", "exit reason"],
      ["best_val_loss", "best val loss"], ["val_token_accuracy", "val token acc"], ["best_step", "best step"], ["last_step", "last step"], [null, "adapter"]];
    while (lbHead.firstChild) lbHead.removeChild(lbHead.firstChild);
    for (const [key, label] of cols) {
      const sorted = key && st.sort.key === key;
      lbHead.appendChild(h("th", { "data-sort": key, class: key ? "sortable" : null, "aria-sort": sorted ? (st.sort.dir > 0 ? "ascending" : "descending") : null,
        onclick: key ? () => { st.sort = { key, dir: st.sort.key === key ? -st.sort.dir : 1 }; renderBoard(); } : null },
        label, sorted ? (st.sort.dir > 0 ? " ▲" : " ▼") : ""));
    }
    const val = (j, key) => key.startsWith("hp.") ? (j.hyperparameters || {})[key.slice(3)] : key === "val_token_accuracy" ? st.acc[j.id] : j[key];
    const rows = st.jobs.slice().sort((a, b) => {
      const x = val(a, st.sort.key), y = val(b, st.sort.key);
      if (x === null || x === undefined) return (y === null || y === undefined) ? a.index - b.index : 1; // nulls last
      if (y === null || y === undefined) return -1;
      return (x < y ? -1 : x > y ? 1 : a.index - b.index) * st.sort.dir;
    });
    while (lbBody.firstChild) lbBody.removeChild(lbBody.firstChild);
    for (const j of rows) {
      const best = st.task && st.task.best_job_id === j.id;
      const dl = h("button", { type: "button", class: "small-btn", "data-job": j.id, disabled: !j.has_adapter,
        onclick: (e) => { e.stopPropagation(); download(`/v1/jobs/${j.id}/adapter`, `${j.id}.tar.gz`, msg); } }, "Download");
      lbBody.appendChild(h("tr", { "data-job": j.id, class: `${best ? "best" : ""}${st.highlight === j.id ? " hl" : ""}`,
        onclick: () => { st.highlight = st.highlight === j.id ? null : j.id; renderBoard(); draw(); } },
        h("td", {}, h("span", { class: "swatch", style: `background:${LoraplexChart.jobColor(j.index)}` }), j.index, best ? " ★" : ""),
        ks.map((k) => h("td", { class: "num" }, (j.hyperparameters || {})[k] ?? "-")),
        h("td", {}, stateBadge(j.state)), h("td", { class: "exit-reason" }, j.exit_reason || ""),
        h("td", { class: "num" }, fmtLoss(j.best_val_loss)),
        h("td", { class: "num val-acc", "data-job": j.id, "data-value": st.acc[j.id] ?? "", title: "validation mean token accuracy at the best step" }, fmtAcc(st.acc[j.id])),
        h("td", { class: "num" }, j.best_step ?? "-"),
        h("td", { class: "num" }, j.last_step ?? "-"), h("td", {}, dl)));
    }
  }

  function draw() {
    if (drawPending) return;
    drawPending = true;
    requestAnimationFrame(() => {
      drawPending = false;
      const curves = [];
      for (const j of st.jobs) {
        const c = st.curves[j.id] || { train: [], val: [] };
        const common = { job: j.id, label: `job ${j.index}`, color: LoraplexChart.jobColor(j.index),
                         dim: !!st.highlight && st.highlight !== j.id, bold: st.highlight === j.id };
        const exit = j.state === "exited" ? { reason: j.exit_reason || "exited", step: j.last_step } : null;
        if (st.showTrain) curves.push(Object.assign({ split: "train", points: c.train, exit }, common));
        if (st.showVal) curves.push(Object.assign({ split: "val", points: c.val, exit: null }, common));
        if (!st.showTrain && exit) curves.push(Object.assign({ split: "train", points: [], exit }, common));
      }
      LoraplexChart.drawLossChart(svg, curves, { logY: st.logY });
      while (legend.firstChild) legend.removeChild(legend.firstChild);
      if (st.jobs.length <= 24) {
        for (const j of st.jobs) legend.appendChild(h("span", { class: "legend-item" }, h("span", { class: "swatch", style: `background:${LoraplexChart.jobColor(j.index)}` }), `job ${j.index}`, j.state === "exited" ? ` ✕ ${j.exit_reason || ""}` : ""));
      } else legend.appendChild(h("span", { class: "muted small" }, `${st.jobs.length} jobs: colours by job index (see the leaderboard)`));
    });
  }

  let lastEventId = -1;
  function renderEvents(all) {
    const list = all.filter((e) => e.id > lastEventId); // a reconnect's snapshot repeats some
    if (!list.length) return;
    lastEventId = list[list.length - 1].id;
    const atBottom = log.parentElement && log.parentElement.scrollTop + log.parentElement.clientHeight >= log.parentElement.scrollHeight - 4;
    for (const e of list) {
      log.appendChild(h("li", { class: `ev ${e.level}`, "data-type": e.type, "data-id": e.id },
        h("time", { title: e.created_at }, new Date(e.created_at).toLocaleTimeString()), " ",
        h("b", {}, e.type), e.job_id ? h("span", { class: "muted" }, ` ${short(e.job_id)}`) : "", " ", e.message || ""));
    }
    while (log.childNodes.length > 1000) log.removeChild(log.firstChild);
    if (atBottom && log.parentElement) log.parentElement.scrollTop = log.parentElement.scrollHeight;
  }

  function apply(u) {
    st.updates++;
    if (u.gone) { msg.textContent = "This task does not exist (or is not yours)."; return; }
    if (u.task) { st.task = u.task; renderHead(); }
    if (u.jobs) { st.jobs = u.jobs; renderBoard(); loadAccuracy(); }
    if (u.events) { renderEvents(u.events); if (u.events.some((e) => e.type === "samples")) loadSamples(); }
    if (u.points) {
      if (u.reset) st.curves = {};
      for (const [jid, c] of Object.entries(u.points)) {
        const cur = st.curves[jid] || (st.curves[jid] = { train: [], val: [] });
        cur.train.push(...c.train);
        cur.val.push(...c.val);
      }
    }
    if (u.points || u.jobs) draw();
  }

  async function connect() {
    live.textContent = "live";
    try {
      const r = await api(`/ui/v1/tasks/${encodeURIComponent(taskId)}/live?max_points=${MAX_POINTS}`, { raw: true, signal: ctl.signal });
      const reader = r.body.getReader();
      const dec = new TextDecoder();
      let buf = "", ended = false;
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += dec.decode(value, { stream: true });
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const frame = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          let type = "message", data = "";
          for (const line of frame.split("\n")) {
            if (line.startsWith("event:")) type = line.slice(6).trim();
            else if (line.startsWith("data:")) data += line.slice(5).trim();
          }
          if (type === "update") apply(JSON.parse(data));
          else if (type === "end") ended = JSON.parse(data || "{}").ended;
        }
      }
      if (ended) { live.textContent = "ended"; afterEnd(); return; }
      if (!stopped) retry = setTimeout(connect, 200);
    } catch (e) {
      if (stopped) return;
      if (e.status === 404) { msg.textContent = "This task does not exist (or is not yours)."; live.textContent = ""; return; }
      if (e.status === 401) { store.key = ""; location.hash = "#/signin"; return; }
      live.textContent = `reconnecting (${errText(e)})`;
      retry = setTimeout(connect, 2000);
    }
  }
  renderHead();
  connect();
  window.__lpxTask = st; // for tests and the curious: the page's state
  view = { stop() { stopped = true; clearTimeout(retry); ctl.abort(); } };
}

/* ---------- cluster ---------- */

function hashColor(s) {
  let x = 0;
  for (const ch of s) x = (x * 31 + ch.charCodeAt(0)) >>> 0;
  return `hsl(${x % 360}, 55%, 55%)`;
}

function clusterView(main) {
  if (!store.op) {
    const tok = h("input", { id: "op-token-cluster", type: "password", autocomplete: "off" });
    const m = h("p", { class: "error-text" });
    main.appendChild(h("form", { class: "card narrow", onsubmit: async (ev) => {
      ev.preventDefault();
      store.op = tok.value.trim();
      try { await api("/v1/cluster", { operator: true }); route(); } catch (e) { store.op = ""; m.textContent = `Refused: ${errText(e)}`; }
    } }, h("h1", {}, "Cluster"), h("p", { class: "muted" }, "The cluster view needs the operator token."),
    h("label", {}, "Operator token", tok), h("button", { type: "submit", class: "primary", id: "btn-op" }, "Open"), m));
    return;
  }
  const summary = h("div", { id: "cluster-summary", class: "stats" });
  const nodes = h("tbody", { id: "nodes-body" });
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.id = "timeline";
  svg.setAttribute("class", "timeline");
  const waiting = h("tbody", { id: "waiting-body" });
  const tenants = h("tbody", { id: "tenants-body" });
  main.appendChild(h("section", { class: "card" }, h("h1", {}, "Cluster"), summary));
  main.appendChild(h("section", { class: "card" }, h("h2", {}, "Nodes"), h("div", { class: "scroll" }, h("table", { id: "nodes", class: "grid-table" },
    h("thead", {}, h("tr", {}, ["Node", "State", "GPU type", "GPUs", "GPU memory", "Last heartbeat", "Running now"].map((c) => h("th", {}, c)))), nodes))));
  main.appendChild(h("section", { class: "card" }, h("h2", {}, "Plan"), h("p", { class: "muted small" }, "One row per GPU; a bar per placement from its planned start to its planned end; the red line is now. Hatched: planned, waiting to start."),
    h("div", { class: "chart-wrap" }, svg), h("h3", {}, "Waiting"),
    h("div", { class: "scroll" }, h("table", { class: "grid-table", id: "waiting" }, h("thead", {}, h("tr", {}, ["Task", "Tenant", "Priority", "Node / GPUs", "Planned start", "Planned end"].map((c) => h("th", {}, c)))), waiting))));
  main.appendChild(h("section", { class: "card" }, h("h2", {}, "Tenants"), h("div", { class: "scroll" }, h("table", { class: "grid-table" },
    h("thead", {}, h("tr", {}, ["Tenant", "Running", "Queued", "GPUs in use", "GPU limit"].map((c) => h("th", {}, c)))), tenants))));

  let timer = null, stopped = false;
  async function refresh() {
    try {
      const c = await api("/v1/cluster", { operator: true });
      while (summary.firstChild) summary.removeChild(summary.firstChild);
      const lp = c.last_plan;
      const stat = (k, v) => h("div", { class: "stat" }, h("div", { class: "stat-v" }, v), h("div", { class: "muted small" }, k));
      summary.append(stat("GPUs up", `${c.gpus_up} / ${c.gpus_total}`), stat("nodes", c.nodes.length), stat("running tasks", c.running_tasks),
        stat("queued tasks", c.queued_tasks), stat("last plan", lp ? `${lp.status}${lp.at ? `, ${when(lp.at)}` : ""}` : "none"));
      if (lp && lp.unschedulable && lp.unschedulable.length) summary.append(h("p", { class: "error-text" }, `Unschedulable: ${lp.unschedulable.map((u) => `${u.task_id} (${u.reason})`).join(", ")}`));
      const nodeName = Object.fromEntries(c.nodes.map((n) => [n.id, n.name]));
      while (nodes.firstChild) nodes.removeChild(nodes.firstChild);
      for (const n of c.nodes) {
        const running = c.gpus.filter((g) => g.node_id === n.id && g.running_task_id).map((g) => `gpu${g.index}: ${short(g.running_task_id)}`);
        nodes.appendChild(h("tr", { "data-node": n.id }, h("td", {}, n.name), h("td", {}, stateBadge(n.state)), h("td", {}, n.gpu_type),
          h("td", { class: "num" }, n.gpu_count), h("td", { class: "num" }, `${(n.gpu_memory_bytes / 2 ** 30).toFixed(0)} GiB`),
          timeCell(n.last_heartbeat_at), h("td", { class: "small" }, running.join(", ") || "-")));
      }
      if (!c.nodes.length) nodes.appendChild(h("tr", {}, h("td", { colspan: 7, class: "muted" }, "No nodes registered.")));
      const now = Date.now();
      const rows = c.gpus.map((g) => ({ label: `${g.node_name} · gpu${g.index}`, bars: g.placements.map((p) => ({
        start: new Date(p.planned_start).getTime(), end: Math.max(new Date(p.planned_end).getTime(), new Date(p.planned_start).getTime() + 1000),
        state: p.state, task: p.task_id, color: hashColor(p.task_id), label: short(p.task_id),
        title: `${p.task_id} (${p.state}, attempt ${p.attempt}${p.tenant_id ? `, tenant ${p.tenant_id}` : ""}${p.priority ? `, priority ${p.priority}` : ""})\n${new Date(p.planned_start).toLocaleString()} → ${new Date(p.planned_end).toLocaleString()}` })) }));
      LoraplexChart.drawTimeline(svg, rows, { now });
      while (waiting.firstChild) waiting.removeChild(waiting.firstChild);
      for (const p of c.plan.filter((x) => x.state === "planned")) {
        waiting.appendChild(h("tr", { "data-task": p.task_id }, h("td", { class: "mono" }, p.task_id), h("td", { class: "small" }, p.tenant_id || "-"),
          h("td", { class: "num" }, p.priority ?? "-"), h("td", {}, `${nodeName[p.node_id] || p.node_id} / ${p.gpu_indices.join(",")}`),
          timeCell(p.planned_start), timeCell(p.planned_end)));
      }
      if (!waiting.firstChild) waiting.appendChild(h("tr", {}, h("td", { colspan: 6, class: "muted" }, "Nothing waits.")));
      while (tenants.firstChild) tenants.removeChild(tenants.firstChild);
      for (const t of c.tenants) tenants.appendChild(h("tr", {}, h("td", {}, t.name), h("td", { class: "num" }, t.running_tasks), h("td", { class: "num" }, t.queued_tasks),
        h("td", { class: "num" }, t.gpus_in_use), h("td", { class: "num" }, t.max_gpus ?? "-")));
      flash("");
    } catch (e) {
      if (e.status === 401 || e.status === 403) { store.op = ""; flash(`Operator token refused: ${errText(e)}`); route(); return; }
      flash(`Could not load the cluster: ${errText(e)}`);
    }
    if (!stopped) timer = setTimeout(refresh, 3000);
  }
  refresh();
  view = { stop() { stopped = true; clearTimeout(timer); } };
}

/* ---------- start ---------- */

document.getElementById("sign-out").addEventListener("click", () => { store.key = ""; store.op = ""; location.hash = "#/signin"; route(); });
window.addEventListener("hashchange", route);
route();
