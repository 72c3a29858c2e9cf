/* loraplex dashboard: the Webhooks page (#/webhooks). The tenant's endpoints (create: the secret is
   shown once; enable/disable, send a test event, delete) and each one's recent deliveries
   (state, attempts, last status, next try; redeliver). Uses app.js's helpers (h, api, ...). */
"use strict";

const WEBHOOK_TYPES = ["fine_tuning.job.succeeded", "fine_tuning.job.failed", "fine_tuning.job.cancelled",
  "task.running", "task.paused", "task.succeeded", "task.failed", "task.cancelled",
  "job.exited", "job.completed", "job.failed"];

function webhooksView(main) {
  const list = h("div", { id: "webhooks-list" });
  const msg = h("p", { id: "webhooks-msg", class: "error-text" });
  main.appendChild(h("section", { class: "layout" },
    h("div", { class: "card wide" }, h("h2", {}, "Webhook endpoints"), list, msg),
    webhookForm(() => refresh())));
  let timer = null, stopped = false, gen = 0;
  const open = new Set(); // endpoints whose deliveries are shown

  async function act(fn, what) {
    msg.textContent = "";
    try { await fn(); } catch (e) { msg.textContent = `${what} failed: ${errText(e)}`; }
    refresh();
  }

  function deliveriesTable(w, page) {
    const rows = page.data.map((d) => h("tr", { "data-delivery": d.id },
      h("td", { class: "mono", title: d.event_id }, d.event_type),
      h("td", {}, stateBadge(d.state)),
      h("td", { class: "num" }, d.attempts),
      h("td", { class: "num", title: d.last_error || "" }, d.last_status_code ?? (d.last_error ? "error" : "-")),
      d.state === "pending" ? timeCell(d.next_attempt_at) : h("td", { class: "muted" }, "-"),
      timeCell(d.delivered_at),
      h("td", {}, h("button", { type: "button", class: "small-btn wh-redeliver", onclick: () => act(() =>
        api(`/v1/webhooks/${w.id}/deliveries/${d.id}/redeliver`, { method: "POST" }), "Redeliver") }, "Redeliver"))));
    if (!rows.length) rows.push(h("tr", {}, h("td", { colspan: 7, class: "muted" }, "No deliveries yet.")));
    return h("div", { class: "scroll" }, h("table", { class: "grid-table deliveries" },
      h("thead", {}, h("tr", {}, ["Event", "State", "Attempts", "Last status", "Next try", "Delivered", ""].map((c) => h("th", {}, c)))),
      h("tbody", {}, rows)));
  }

  async function endpointCard(w) {
    const toggle = h("button", { type: "button", class: "small-btn wh-toggle", onclick: () => act(() =>
      api(`/v1/webhooks/${w.id}`, { method: "PATCH", json: { enabled: !w.enabled } }), w.enabled ? "Disable" : "Enable") },
      w.enabled ? "Disable" : "Enable");
    const test = h("button", { type: "button", class: "small-btn wh-test", disabled: !w.enabled, onclick: () => act(() =>
      api(`/v1/webhooks/${w.id}/test`, { method: "POST" }), "Test") }, "Send test");
    const del = h("button", { type: "button", class: "small-btn wh-delete", onclick: () => {
      if (confirm(`Delete the endpoint ${w.url}?`)) act(() => api(`/v1/webhooks/${w.id}`, { method: "DELETE" }), "Delete");
    } }, "Delete");
    const shown = open.has(w.id);
    const more = h("button", { type: "button", class: "small-btn wh-deliveries", onclick: () => {
      shown ? open.delete(w.id) : open.add(w.id); refresh();
    } }, shown ? "Hide deliveries" : "Deliveries");
    const card = h("div", { class: "webhook", "data-webhook": w.id },
      h("p", {}, h("span", { class: "mono" }, w.url), " ", stateBadge(w.enabled ? "enabled" : "disabled")),
      w.description ? h("p", { class: "muted small" }, w.description) : null,
      h("p", { class: "small" }, w.event_types.join(", ")),
      h("div", { class: "buttons" }, more, toggle, test, del));
    if (shown) {
      const page = await api(`/v1/webhooks/${w.id}/deliveries?limit=20`);
      card.appendChild(deliveriesTable(w, page));
    }
    return card;
  }

  async function refresh() {
    const mine = ++gen; // a newer refresh makes this one's answer stale
    clearTimeout(timer);
    try {
      const page = await api("/v1/webhooks?limit=100");
      const cards = await Promise.all(page.data.map(endpointCard));
      if (mine !== gen || stopped) return;
      while (list.firstChild) list.removeChild(list.firstChild);
      for (const c of cards) list.appendChild(c);
      if (!cards.length) list.appendChild(h("p", { class: "muted" }, "No endpoints yet: add one with the form."));
    } catch (e) {
      if (e.status === 401) { store.key = ""; location.hash = "#/signin"; return; }
      if (mine !== gen) return;
      msg.textContent = `Could not load webhooks: ${errText(e)}`;
    }
    if (!stopped) timer = setTimeout(refresh, 5000);
  }
  refresh();
  view = { stop() { stopped = true; clearTimeout(timer); } };
}

function webhookForm(created) {
  const url = h("input", { id: "wh-url", type: "url", placeholder: "https://example.com/hooks/loraplex" });
  const desc = h("input", { id: "wh-desc", placeholder: "optional" });
  const boxes = WEBHOOK_TYPES.map((t) => h("input", { type: "checkbox", value: t, "data-type": t, checked: t.startsWith("fine_tuning.") }));
  const msg = h("p", { id: "wh-msg", class: "error-text" });
  const secret = h("div", { id: "wh-secret", class: "estimate", hidden: true });
  const form = h("form", { class: "card", id: "webhook-form", onsubmit: async (ev) => {
    ev.preventDefault();
    msg.textContent = "";
    secret.hidden = true;
    const body = { url: url.value.trim(), event_types: boxes.filter((b) => b.checked).map((b) => b.value) };
    if (desc.value.trim()) body.description = desc.value.trim();
    try {
      const w = await api("/v1/webhooks", { method: "POST", json: body });
      while (secret.firstChild) secret.removeChild(secret.firstChild);
      secret.appendChild(h("h3", {}, "Signing secret (shown only now: copy it)"));
      secret.appendChild(h("p", { class: "mono", id: "wh-secret-value" }, w.secret));
      secret.hidden = false;
      url.value = ""; desc.value = "";
      created();
    } catch (e) { msg.textContent = `Create failed: ${errText(e)}`; }
  } },
  h("h2", {}, "New endpoint"),
  h("label", {}, "URL", url),
  h("label", {}, "Description", desc),
  h("fieldset", {}, h("legend", {}, "Events"), boxes.map((b) => h("label", { class: "inline" }, b, b.value))),
  h("div", { class: "buttons" }, h("button", { id: "btn-webhook", type: "submit", class: "primary" }, "Add endpoint")),
  secret, msg,
  h("p", { class: "muted small" }, "Deliveries are signed (Standard Webhooks: webhook-id, webhook-timestamp, webhook-signature) and retried with backoff for 24 h."));
  return form;
}
