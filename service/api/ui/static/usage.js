/* loraplex dashboard: usage (a task's usage beside its dry-run estimate, on the task page; the
   tenant's report of a period, #/usage, from GET /v1/usage) and a task's tracking integrations.
   Uses app.js's helpers (h, api, ...). */
"use strict";

function fmtTokens(n) { return n === null || n === undefined ? "-" : Number(n).toLocaleString("en-US"); }
function fmtSeconds(s) { return s === null || s === undefined ? "-" : `${Number(s).toFixed(1)} s`; }
function fmtCost(c) { return c === null || c === undefined ? "-" : Number(c).toFixed(4); }
function fmtAcc(x) { return x === null || x === undefined ? "-" : Number(x).toFixed(4); }

/* A number cell whose data-value is the API's own value (the text is rounded for reading). */
function numCell(value, text, attrs) {
  return h("td", Object.assign({ class: "num", "data-value": value ?? "" }, attrs || {}), text);
}

/* The task page's usage: what it used (exact tokens, GPU-seconds, cost when priced) beside the
   dry run's estimate (all steps; with early exit as set). */
function taskUsageTable(u) {
  if (!u) return null;
  const cell = (key, value, fmt) => numCell(value, fmt(value), { "data-usage": key });
  const price = u.price_per_gpu_hour;
  return h("div", { class: "scroll" }, h("table", { id: "task-usage", class: "grid-table usage" },
    h("thead", {}, h("tr", {}, ["Usage", "Used", "Estimated", ""].map((c) => h("th", {}, c)))),
    h("tbody", {},
      h("tr", {}, h("th", {}, "Tokens trained"), cell("trained_tokens", u.trained_tokens, fmtTokens),
        cell("expected_tokens", u.expected_tokens, fmtTokens),
        h("td", { class: "muted small" }, "all steps: ", h("span", { "data-usage": "estimated_tokens", "data-value": u.estimated_tokens ?? "" }, fmtTokens(u.estimated_tokens)))),
      h("tr", {}, h("th", {}, "GPU-seconds"), cell("gpu_seconds", u.gpu_seconds, fmtSeconds),
        cell("estimated_gpu_seconds", u.estimated_gpu_seconds, fmtSeconds), h("td", {})),
      h("tr", {}, h("th", {}, "Cost"), cell("cost", u.cost, fmtCost), cell("estimated_cost", u.estimated_cost, fmtCost),
        h("td", { class: "muted small", "data-usage": "price_per_gpu_hour", "data-value": price ?? "" },
          price === null || price === undefined ? "not priced here" : `at ${price} per GPU-hour`)))));
}

/* The task page's tracking integrations: where each one writes and its sync. */
function integrationsTable(list) {
  if (!list || !list.length) return null;
  const rows = list.map((it, i) => {
    const where = it.type === "wandb" && it.wandb
      ? [`project ${it.wandb.project}`, it.wandb.entity ? `entity ${it.wandb.entity}` : "", it.wandb.name ? `name ${it.wandb.name}` : ""]
      : it.mlflow ? [`experiment ${it.mlflow.experiment_name}`, it.mlflow.tracking_uri, it.mlflow.run_name ? `run ${it.mlflow.run_name}` : ""] : [];
    return h("tr", { "data-integration": i, "data-type": it.type },
      h("td", {}, it.type === "wandb" ? "W&B" : "MLflow"),
      h("td", { class: "small" }, where.filter(Boolean).join(" · ")),
      h("td", { class: "sync-status" }, stateBadge(it.status)),
      h("td", { class: "num" }, it.attempts),
      h("td", { class: "small" }, it.synced_at ? when(it.synced_at) : "-"),
      h("td", { class: "small error-text last-error" }, it.last_error || ""));
  });
  return h("div", { class: "scroll" }, h("table", { id: "integrations", class: "grid-table" },
    h("thead", {}, h("tr", {}, ["Tracking", "Where", "Sync", "Attempts", "Synced", "Last error"].map((c) => h("th", {}, c)))),
    h("tbody", {}, rows)));
}

/* A datetime-local input's value for a Date, in local time. */
function localInput(d) {
  const p = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())}T${p(d.getHours())}:${p(d.getMinutes())}`;
}

function usageView(main) {
  const start = h("input", { id: "u-start", type: "datetime-local", value: localInput(new Date(Date.now() - 30 * 86400e3)) });
  const end = h("input", { id: "u-end", type: "datetime-local" });
  const msg = h("p", { id: "usage-msg", class: "error-text" });
  const summary = h("div", { id: "usage-summary", class: "stats" });
  const period = h("p", { id: "usage-period", class: "muted small" });
  const tbody = h("tbody", { id: "usage-body" });
  let stopped = false;
  const preset = (label, days) => h("button", { type: "button", class: "small-btn", onclick: () => {
    const now = new Date();
    start.value = localInput(days === "month" ? new Date(now.getFullYear(), now.getMonth(), 1) : new Date(now.getTime() - days * 86400e3));
    end.value = "";
    load();
  } }, label);

  async function load() {
    msg.textContent = "";
    if (!start.value) { msg.textContent = "Pick the period's start."; return; }
    const q = new URLSearchParams({ start: new Date(start.value).toISOString() });
    if (end.value) q.set("end", new Date(end.value).toISOString());
    try {
      const r = await api(`/v1/usage?${q}`);
      if (stopped) return;
      period.dataset.start = r.start;
      period.dataset.end = r.end;
      period.textContent = `${toDate(r.start).toLocaleString()} → ${toDate(r.end).toLocaleString()}; each training step counts in the period it was reported in.`;
      while (summary.firstChild) summary.removeChild(summary.firstChild);
      const stat = (k, v, key, raw) => h("div", { class: "stat" }, h("div", { class: "stat-v", "data-total": key, "data-value": raw ?? "" }, v), h("div", { class: "muted small" }, k));
      summary.append(stat("tokens trained", fmtTokens(r.trained_tokens), "trained_tokens", r.trained_tokens),
        stat("GPU-hours", (r.gpu_seconds / 3600).toFixed(3), "gpu_seconds", r.gpu_seconds),
        stat(`cost (${r.price_per_gpu_hour} per GPU-hour)`, fmtCost(r.cost), "cost", r.cost),
        stat("tasks", r.tasks.length, "tasks", r.tasks.length));
      while (tbody.firstChild) tbody.removeChild(tbody.firstChild);
      for (const t of r.tasks) {
        tbody.appendChild(h("tr", { "data-task": t.task_id },
          h("td", {}, h("a", { href: `#/task/${encodeURIComponent(t.task_id)}`, class: "mono", title: t.task_id }, t.task_id.replace(/^task_/, "").slice(0, 12))),
          h("td", {}, t.base_model), h("td", {}, stateBadge(t.state)),
          numCell(t.trained_tokens, fmtTokens(t.trained_tokens), { "data-usage": "trained_tokens" }),
          numCell(t.gpu_seconds, fmtSeconds(t.gpu_seconds), { "data-usage": "gpu_seconds" }),
          numCell(t.cost, fmtCost(t.cost), { "data-usage": "cost" })));
      }
      if (!r.tasks.length) tbody.appendChild(h("tr", {}, h("td", { colspan: 6, class: "muted" }, "No training in this period.")));
    } catch (e) {
      if (stopped) return;
      if (e.status === 401) { store.key = ""; location.hash = "#/signin"; return; }
      msg.textContent = `Could not load the usage: ${errText(e)}`;
    }
  }

  main.appendChild(h("section", { class: "card" }, h("h1", {}, "Usage"),
    h("form", { id: "usage-form", class: "usage-form", onsubmit: (ev) => { ev.preventDefault(); load(); } },
      h("label", {}, "From", start), h("label", {}, "Until", end, h("span", { class: "muted small" }, "empty: now")),
      h("div", { class: "buttons" }, h("button", { type: "submit", class: "primary", id: "btn-usage" }, "Show"),
        preset("Last 24 h", 1), preset("Last 7 days", 7), preset("This month", "month"))),
    msg, summary, period,
    h("div", { class: "scroll" }, h("table", { id: "usage-table", class: "grid-table" },
      h("thead", {}, h("tr", {}, ["Task", "Model", "State", "Tokens trained", "GPU-seconds", "Cost"].map((c) => h("th", {}, c)))), tbody))));
  load();
  view = { stop() { stopped = true; } };
}
