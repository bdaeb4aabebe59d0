// The micro-batch console: draws what /microbatch/api/... returns. No
// framework and no CDN: Airflow's machines may have no internet.
"use strict";

const BASE = document.currentScript.src.replace(/\/static\/console\.js.*$/, "");
const AIRFLOW = BASE.replace(/\/microbatch$/, "");
const params = new URLSearchParams(location.search);
const state = { pipelines: [], selected: params.get("dag_id"), batches: [], quarantine: null, reason: null, scope: null };

const $ = (sel) => document.querySelector(sel);
const fmt = (n) => (n === null || n === undefined ? "" : Number(n).toLocaleString("en-US"));

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(child ?? ""));
  return node;
}

async function api(path, options = {}) {
  const response = await fetch(`${BASE}/api/${path}`, { credentials: "same-origin", ...options });
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(`${response.status}: ${body.detail ? JSON.stringify(body.detail) : response.statusText}`);
  return body;
}

function showError(err) {
  const box = $("#error");
  box.hidden = !err;
  box.textContent = err ? String(err.message || err) : "";
}

function ago(iso) {
  if (!iso) return "";
  const s = (Date.now() - Date.parse(iso)) / 1000;
  if (s < 90) return `${Math.round(s)} s ago`;
  if (s < 5400) return `${Math.round(s / 60)} min ago`;
  if (s < 172800) return `${Math.round(s / 3600)} h ago`;
  return `${Math.round(s / 86400)} days ago`;
}

function age(seconds) {
  if (seconds === null || seconds === undefined) return "";
  if (seconds < 90) return `${Math.round(seconds)} s`;
  if (seconds < 5400) return `${Math.round(seconds / 60)} min`;
  if (seconds < 172800) return `${Math.round(seconds / 3600)} h`;
  return `${Math.round(seconds / 86400)} days`;
}

function offsets(o) {
  if (!o) return "";
  if ("files" in o) return `files ${fmt(o.files)}`;
  if ("version" in o) return `v${o.version}`;
  const parts = [];
  for (const [topic, partitions] of Object.entries(o)) {
    if (topic.startsWith("@") || typeof partitions !== "object") continue;
    parts.push(`${topic} ` + Object.entries(partitions).map(([p, n]) => `${p}:${n}`).join(" "));
  }
  return parts.join(", ") || JSON.stringify(o);
}

// -- pipelines ---------------------------------------------------------------

function renderPipelines() {
  const body = $("#pipelines tbody");
  body.replaceChildren();
  for (const p of state.pipelines) {
    const lag = p.lag;
    const row = el(
      "tr",
      { class: p.name === state.selected ? "selected" : "", "data-name": p.name || "", onclick: () => p.dag_id && select(p.name) },
      el("td", {}, p.name || ""),
      el("td", {}, el("span", { class: `badge ${String(p.status).replace(/ /g, "-")}` }, p.status)),
      el("td", { class: "mono" }, p.batch_id === null || p.batch_id === undefined ? "" : `epoch ${p.epoch}, batch ${p.batch_id}`),
      el("td", { class: "num" }, fmt(p.state_version)),
      el("td", {}, lag ? `${fmt(lag.count)} ${lag.count === 1 ? lag.unit.replace(/s$/, "") : lag.unit}` : ""),
      el("td", {}, lag ? age(lag.oldest_age_s) : ""),
      el("td", { title: p.last_committed_at || "" }, ago(p.last_committed_at)),
      el("td", { class: "error" }, (p.problems || []).join("\n")),
    );
    body.append(row);
  }
}

async function loadPipelines() {
  state.pipelines = await api("pipelines");
  if (!state.selected) {
    // The first pipeline with batches, else the first that has a DAG.
    const first = state.pipelines.find((p) => p.dag_id && p.batch_id) || state.pipelines.find((p) => p.dag_id) || {};
    state.selected = first.name || null;
  }
  renderPipelines();
  $("#updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
}

// -- one pipeline --------------------------------------------------------------

function abandoned(row, rows) {
  // A batch a later rewind went back before is no longer in the state's lineage.
  return rows.some((r) => r.status === "rewound" && r.epoch > row.epoch && r.batch_id < row.batch_id);
}

function renderBatches(pipeline) {
  const body = $("#batches tbody");
  body.replaceChildren();
  const rows = state.batches.slice().reverse();
  const oldest = pipeline.oldest_rewindable;
  const wanted = { run: params.get("run_id"), epoch: params.get("epoch"), batch: params.get("batch_id") };
  for (const r of rows) {
    const rewindable = r.status === "committed" && oldest !== null && r.batch_id >= oldest && !abandoned(r, rows);
    const highlight =
      (wanted.run && r.run_id === wanted.run && r.status !== "planned") ||
      (wanted.batch !== null && String(r.batch_id) === wanted.batch && String(r.epoch) === (wanted.epoch || "0") && r.status === "committed");
    const runCell = r.run_id
      ? el("a", { href: `${AIRFLOW}/dags/${encodeURIComponent(pipeline.dag_id)}/runs/${encodeURIComponent(r.run_id)}`, target: "_top" }, r.run_id)
      : "";
    const quarantined = r.records_quarantined
      ? el("a", { href: "#quarantine", onclick: () => loadQuarantine(pipeline, r) }, fmt(r.records_quarantined))
      : fmt(r.records_quarantined);
    body.append(
      el(
        "tr",
        { class: highlight ? "highlight" : "", "data-batch": `${r.epoch}.${r.batch_id}` },
        el("td", { class: "mono" }, `${r.batch_id}` + (r.epoch ? ` (epoch ${r.epoch})` : "")),
        el("td", {}, el("span", { class: `badge ${r.status}` }, r.status)),
        el("td", { class: "mono" }, r.status === "rewound" ? `back to ${offsets(r.end_offsets)}` : `${offsets(r.start_offsets)} → ${offsets(r.end_offsets)}`),
        el("td", { class: "num" }, fmt(r.records_in)),
        el("td", { class: "num" }, quarantined),
        el("td", { class: "num" }, fmt(r.keys_updated)),
        el("td", { class: "num" }, r.duration_ms === null || r.duration_ms === undefined ? "" : `${(r.duration_ms / 1000).toFixed(1)} s`),
        el("td", { class: "num" }, fmt(r.state_version)),
        el("td", { title: r.committed_at || "" }, ago(r.committed_at)),
        el("td", { class: "mono small" }, runCell),
        el("td", {}, rewindable ? el("button", { class: "rewind", onclick: () => askRewind(pipeline, r.batch_id) }, "Rewind here") : ""),
      ),
    );
  }
  if (!state.scrolled) {
    state.scrolled = true;
    body.querySelector("tr.highlight")?.scrollIntoView({ block: "center" });
  }
  if (rows.length) {
    body.append(el("tr", {}, el("td", { colspan: "10", class: "muted" }, "Batch 0: the empty state before the first batch"),
      el("td", {}, el("button", { class: "rewind", onclick: () => askRewind(pipeline, 0) }, "Rewind to 0"))));
  }
}

function chart(svg, values, kind) {
  svg.replaceChildren();
  const width = svg.clientWidth || 320;
  const height = svg.clientHeight || 150;
  const pad = { l: 44, r: 6, t: 8, b: 18 };
  const ns = "http://www.w3.org/2000/svg";
  const add = (tag, attrs, text) => {
    const node = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    svg.append(node);
    return node;
  };
  const points = values.filter((v) => v.y !== null && v.y !== undefined);
  if (!points.length) {
    add("text", { x: pad.l, y: height / 2 }, "no data yet");
    return;
  }
  const max = Math.max(...points.map((v) => v.y), 1e-9);
  const w = (width - pad.l - pad.r) / values.length;
  const y = (v) => pad.t + (height - pad.t - pad.b) * (1 - v / max);
  add("line", { x1: pad.l, y1: height - pad.b, x2: width - pad.r, y2: height - pad.b, class: "axis" });
  add("text", { x: 2, y: pad.t + 8 }, fmt(Math.round(max * 10) / 10));
  add("text", { x: 2, y: height - pad.b }, "0");
  add("text", { x: pad.l, y: height - 4 }, `batch ${values[0].x}`);
  add("text", { x: width - pad.r - 60, y: height - 4 }, `batch ${values[values.length - 1].x}`);
  if (kind === "bars") {
    values.forEach((v, i) => {
      if (v.y === null || v.y === undefined) return;
      const bar = add("rect", { class: "bar", x: pad.l + i * w + w * 0.1, y: y(v.y), width: Math.max(w * 0.8, 1), height: height - pad.b - y(v.y) });
      bar.append(Object.assign(document.createElementNS(ns, "title"), { textContent: `batch ${v.x}: ${fmt(v.y)}` }));
    });
  } else {
    const xy = values.map((v, i) => (v.y === null || v.y === undefined ? null : [pad.l + i * w + w / 2, y(v.y)])).filter(Boolean);
    add("polyline", { class: "line", points: xy.map((p) => p.join(",")).join(" ") });
    xy.forEach(([cx, cy]) => add("circle", { class: "dot", cx, cy, r: 2.5 }));
  }
}

function renderCharts(pipeline) {
  const committed = state.batches.filter((r) => r.status === "committed");
  const label = (r) => (r.epoch ? `${r.batch_id}/e${r.epoch}` : r.batch_id);
  chart($("#chart-records"), committed.map((r) => ({ x: label(r), y: r.records_in })), "bars");
  chart($("#chart-duration"), committed.map((r) => ({ x: label(r), y: r.duration_ms === null ? null : r.duration_ms / 1000 })), "line");
  chart($("#chart-lag"), committed.map((r) => ({ x: label(r), y: r.waiting_after })), "line");
  $("#lag-unit").textContent = pipeline.lag ? pipeline.lag.unit : "source units";
}

function renderQuarantine() {
  const q = state.quarantine;
  const reasons = $("#reasons");
  reasons.replaceChildren();
  const body = $("#quarantine tbody");
  body.replaceChildren();
  if (!q) return;
  $("#quarantine-scope").textContent = `${fmt(q.total)} record(s) ${state.scope || "in all batches"}; newest ${q.rows.length} shown`;
  for (const [reason, count] of Object.entries(q.by_reason)) {
    reasons.append(el("button", { class: reason === state.reason ? "active" : "", onclick: () => { state.reason = state.reason === reason ? null : reason; renderQuarantine(); } }, `${reason} (${fmt(count)})`));
  }
  for (const r of q.rows) {
    if (state.reason && r.reason !== state.reason) continue;
    const where = r.file && r.file.startsWith("kafka://") ? `${r.file} offset ${r.line}` : `${r.file}:${r.line}`;
    body.append(el("tr", {}, el("td", { class: "mono" }, `${r.batch_id}` + (r.epoch ? ` (epoch ${r.epoch})` : "")), el("td", { class: "mono" }, where), el("td", {}, r.reason), el("td", { class: "raw" }, r.raw)));
  }
}

async function loadQuarantine(pipeline, row) {
  const query = row ? `?batch_id=${row.batch_id}&epoch=${row.epoch}&limit=200` : "?limit=200";
  state.scope = row ? `in batch ${row.batch_id}` : null;
  state.reason = null;
  state.quarantine = await api(`pipelines/${encodeURIComponent(pipeline.name)}/quarantine${query}`);
  renderQuarantine();
}

async function select(name) {
  state.selected = name;
  renderPipelines();
  const pipeline = state.pipelines.find((p) => p.name === name);
  if (!pipeline) return;
  $("#detail").hidden = false;
  $("#detail-name").textContent = name;
  $("#detail-source").textContent = `${pipeline.source}; spec ${pipeline.spec_path}`;
  $("#dag-link").href = `${AIRFLOW}/dags/${encodeURIComponent(pipeline.dag_id)}`;
  state.batches = await api(`pipelines/${encodeURIComponent(name)}/batches?limit=100`);
  renderCharts(pipeline);
  renderBatches(pipeline);
  await loadQuarantine(pipeline, null);
}

// -- rewind ----------------------------------------------------------------------

function askRewind(pipeline, batchId) {
  const dialog = $("#rewind-dialog");
  $("#rewind-name").textContent = pipeline.name;
  $("#rewind-batch").textContent = batchId;
  dialog.onclose = async () => {
    if (dialog.returnValue !== "confirm") return;
    try {
      const run = await api(`pipelines/${encodeURIComponent(pipeline.name)}/rewind`, {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ batch_id: batchId, rewind_only: $("#rewind-only").checked }),
      });
      showError(null);
      $("#updated").textContent = `triggered ${run.dag_run_id}`;
    } catch (err) {
      showError(err);
    }
  };
  dialog.showModal();
}

// -- start ---------------------------------------------------------------------

async function refresh() {
  try {
    await loadPipelines();
    if (state.selected) await select(state.selected);
    showError(null);
  } catch (err) {
    showError(err);
  }
}

refresh();
setInterval(() => { if (!$("#rewind-dialog").open) refresh(); }, 30000);
