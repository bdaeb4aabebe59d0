// The micro-batch console: draws what /microbatch/api/... returns. No
// framework and no CDN: Airflow's machines may have no internet.
"use strict";

const BASE = document.currentScript.src.replace(/\/static\/console\.js.*$/, "");
const AIRFLOW = BASE.replace(/\/microbatch$/, "");
const params = new URLSearchParams(location.search);
const state = {
  pipelines: [], selected: params.get("dag_id"), batches: [], quarantine: null,
  reason: null, scope: null, scopeRow: null, open: new Set(), showRewound: false, quarantineAll: false, search: "", quarantineShown: 25,
};

const $ = (sel) => document.querySelector(sel);
// Quarantined records shown at a time.
const QUARANTINE_PAGE = 25;
// A number as the page shows it; nothing for a null, never "NaN".
const fmt = (n) => {
  if (n === null || n === undefined || n === "") return "";
  const x = Number(n);
  return Number.isFinite(x) ? x.toLocaleString("en-US") : String(n);
};

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

// -- Airflow's display settings -------------------------------------------------
// The UI keeps them in this origin's localStorage: the time zone under
// "timezone" (JSON, e.g. "\"Europe/Paris\""; none: the browser's), the colour
// mode under "theme" ("light", "dark" or "system"). Times show as Airflow
// shows them: YYYY-MM-DD HH:mm:ss, 24-hour.

function airflowTimeZone() {
  try {
    const zone = JSON.parse(localStorage.getItem("timezone"));
    if (zone) {
      new Intl.DateTimeFormat("en-US", { timeZone: zone });  // throws on an unknown zone
      return zone;
    }
  } catch (err) { /* unset or unreadable: the browser's */ }
  return Intl.DateTimeFormat().resolvedOptions().timeZone;
}

const TZ = airflowTimeZone();
const clock = new Intl.DateTimeFormat("en-CA", {
  timeZone: TZ, year: "numeric", month: "2-digit", day: "2-digit",
  hour: "2-digit", minute: "2-digit", second: "2-digit", hourCycle: "h23",
});

function when(iso) {
  if (!iso) return "";
  const parts = Object.fromEntries(clock.formatToParts(new Date(iso)).map((p) => [p.type, p.value]));
  return `${parts.year}-${parts.month}-${parts.day} ${parts.hour}:${parts.minute}:${parts.second}`;
}

function applyTheme() {
  let mode = localStorage.getItem("theme") || "system";
  try {
    // Inside Airflow's frame, its page's class is the truth (it follows the OS in "system").
    const parent = window.parent !== window && window.parent.document.documentElement.classList;
    if (parent && (parent.contains("dark") || parent.contains("light"))) mode = parent.contains("dark") ? "dark" : "light";
  } catch (err) { /* another origin: localStorage it is */ }
  const dark = mode === "dark" || (mode === "system" && matchMedia("(prefers-color-scheme: dark)").matches);
  document.documentElement.classList.toggle("dark", dark);
}

function ago(iso) {
  if (!iso) return "";
  return age((Date.now() - Date.parse(iso)) / 1000) + " ago";
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

const batchName = (r) => `${r.batch_id}` + (r.epoch ? ` (epoch ${r.epoch})` : "");
const runUrl = (dagId, runId) => `${AIRFLOW}/dags/${encodeURIComponent(dagId)}/runs/${encodeURIComponent(runId)}`;

// -- pipelines ---------------------------------------------------------------

function renderPipelines() {
  const body = $("#pipelines tbody");
  body.replaceChildren();
  for (const p of state.pipelines) {
    const lag = p.lag;
    const statusText = p.status === "probing" ? "probing…" : p.status;
    const checked = p.probing && p.probed_at ? `checking again; last answer ${age(p.probe_age_s)} old`
      : p.probing ? `probing for ${age(p.probing_for_s)}` : p.probed_at ? `checked ${age(p.probe_age_s)} ago` : "";
    body.append(el(
      "tr",
      { class: `pipeline${p.name === state.selected ? " selected" : ""}`, "data-name": p.name || "", onclick: () => p.dag_id && select(p.name) },
      // data-label: a phone shows each pipeline as a card of "label: value" lines.
      el("td", { class: "name" }, p.name || ""),
      el("td", { class: "status" }, el("span", { class: `badge ${String(p.status).replace(/ /g, "-")}`, title: checked }, statusText),
        ...(p.paused ? [" ", el("a", { class: "paused", href: `${AIRFLOW}/dags/${encodeURIComponent(p.dag_id)}`, target: "_top",
          title: "its DAG is paused: no run starts until it is unpaused (the switch on the DAG's page)", onclick: (e) => e.stopPropagation() }, "paused: unpause")] : []),
        // The answer's age, apart from the status: "up to date 6 s old" read as a lag.
        p.probing && p.probed_at ? el("span", { class: "muted small stale" }, ` (checked ${age(p.probe_age_s)} ago)`) : ""),
      el("td", { class: "mono", "data-label": "position" }, position(p)),
      el("td", { class: "num optional", "data-label": "state version" }, fmt(p.state_version)),
      el("td", { "data-label": "waiting" }, lag ? `${fmt(lag.count)} ${lag.count === 1 ? lag.unit.replace(/s$/, "") : lag.unit}` : ""),
      el("td", { class: "optional", "data-label": "oldest waiting" }, lag ? age(lag.oldest_age_s) : ""),
      el("td", { class: "num optional", "data-label": "quarantined" }, fmt(p.quarantined)),
      el("td", { title: when(p.last_committed_at), "data-label": "last commit" }, ago(p.last_committed_at)),
    ));
    if ((p.problems || []).length) {
      // A row of its own, under the pipeline: readable at any width.
      // What a pipeline waits for is not an error: said in the waiting badge's colour.
      body.append(el("tr", { class: "problems", "data-name": p.name || "" }, el("td", { colspan: "8", class: p.status === "waiting" ? "warning" : "error" }, p.problems.join("\n"))));
    }
  }
}

function position(p) {
  if (p.status === "probing" || p.status === "unreadable") return "";
  // A broken spec with a DAG (its last valid version) still has its position.
  if (p.status === "broken" && !p.dag_id) return "";
  if (!p.batch_id && !p.epoch) return "no batch yet";
  return `epoch ${p.epoch}, batch ${p.batch_id}`;
}

async function loadPipelines() {
  state.pipelines = await api("pipelines");
  if (!state.selected) {
    // The first pipeline with batches, else the first that has a DAG.
    const first = state.pipelines.find((p) => p.dag_id && p.batch_id) || state.pipelines.find((p) => p.dag_id) || {};
    state.selected = first.name || null;
  }
  renderPipelines();
  $("#updated").textContent = `updated ${when(new Date().toISOString())} (${TZ})`;
  // Probes still running: ask again soon, not in 30 s.
  clearTimeout(state.probeTimer);
  if (state.pipelines.some((p) => p.probing)) state.probeTimer = setTimeout(() => loadPipelines().catch(showError), 3000);
}

// -- one pipeline --------------------------------------------------------------

function phaseBadge(r) {
  if (r.phase === "committed" && r.live) return el("span", { class: "badge committed" }, "committed");
  if (r.phase === "committed") return el("span", { class: "badge dead" }, `rewound in epoch ${r.rewound_in_epoch}`);
  if (r.phase === "rewind") return el("span", { class: "badge rewound" }, `rewind to ${r.batch_id}`);
  if (r.phase === "abandoned") return el("span", { class: "badge dead" }, `abandoned (rewound in epoch ${r.rewound_in_epoch})`);
  // pending: planned after the head and not committed
  if (r.in_flight === true) return el("span", { class: "badge planned" }, "in flight");
  if (r.in_flight === false) return el("span", { class: "badge problem", title: "its run ended without committing; the next run replays exactly this range" }, "left by a crash");
  return el("span", { class: "badge planned", title: "in flight, or left by a crash: the next run replays exactly this range" }, "planned");
}

function details(pipeline, r) {
  const links = [];
  if (r.run_id) {
    links.push(el("a", { href: runUrl(pipeline.dag_id, r.run_id), target: "_top" }, "run"));
    if (r.attempt) links.push(el("a", { href: `${runUrl(pipeline.dag_id, r.run_id)}/tasks/run_batch?try_number=${r.attempt}`, target: "_top" }, `task log (try ${r.attempt})`));
  }
  for (const d of r.downstream_runs || []) {
    links.push(el("a", { href: runUrl(d.dag_id, d.run_id), target: "_top" }, `downstream: ${d.dag_id} ${d.run_id}` + (d.state ? ` (${d.state})` : "")));
  }
  const inputs = r.inputs || [];
  const more = (r.input_count || 0) - inputs.length;
  return el("tr", { class: "details", "data-details": `${r.epoch}.${r.batch_id}` },
    el("td", { colspan: "10" },
      el("div", { class: "links" }, ...links.flatMap((a) => [a, " "])),
      el("div", {}, `offsets ${offsets(r.start_offsets)} → ${offsets(r.end_offsets)}`,
        r.interval_end ? `; interval ${when(r.interval_start)} – ${when(r.interval_end)}` : "",
        r.planned_at ? `; planned ${when(r.planned_at)}` : "", r.committed_at ? `; committed ${when(r.committed_at)}` : "",
        r.oldest_arrival ? `; oldest input arrived ${when(r.oldest_arrival)}` : ""),
      r.records_late !== null && r.records_late !== undefined
        ? el("div", { class: "event-time" }, `event time: ${fmt(r.records_late)} late record(s); watermark after it ${r.watermark ? when(r.watermark) : "none yet"}`)
        : "",
      el("div", { class: "muted" }, `read ${fmt(r.input_count)} input(s)` + (inputs.length ? ":" : "")),
      el("ul", { class: "inputs mono" }, ...inputs.map((name) => el("li", {}, name)), more > 0 ? el("li", { class: "muted" }, `… and ${fmt(more)} more`) : ""),
    ));
}

function renderBatches(pipeline) {
  const body = $("#batches tbody");
  body.replaceChildren();
  const rows = state.batches.slice().reverse();
  const oldest = pipeline.oldest_rewindable;
  // A rewind to the newest batch would change nothing: not offered there.
  const newest = Math.max(-1, ...rows.filter((r) => r.phase === "committed" && r.live).map((r) => r.batch_id));
  const wanted = { run: params.get("run_id"), epoch: params.get("epoch"), batch: params.get("batch_id") };
  for (const r of rows) {
    const key = `${r.epoch}.${r.batch_id}`;
    const rewindable = r.phase === "committed" && r.live && oldest !== null && r.batch_id >= oldest && r.batch_id < newest;
    const highlight =
      (wanted.run && r.run_id === wanted.run) ||
      (wanted.batch !== null && String(r.batch_id) === wanted.batch && String(r.epoch) === (wanted.epoch || "0"));
    const quarantined = r.records_quarantined
      ? el("a", { href: "#quarantine", onclick: (e) => { e.stopPropagation(); loadQuarantine(pipeline, r); } }, fmt(r.records_quarantined))
      : fmt(r.records_quarantined);
    // Late records (event time), whatever became of them: beside the quarantined, which may hold them.
    const late = r.records_late ? el("span", { class: "muted late", title: "records older than the watermark" }, ` · ${fmt(r.records_late)} late`) : "";
    // Duplicates (dedup): dropped before the transform, counted here; never in the quarantine.
    const duplicate = r.records_duplicate
      ? el("span", { class: "muted duplicate", title: "records dropped as duplicates of an id already taken (dedup)" }, ` · ${fmt(r.records_duplicate)} duplicate`)
      : "";
    if (highlight && !state.openedLinked) {
      // The batch a link named (a task log's, the run's tab): opened once.
      state.openedLinked = true;
      state.open.add(key);
    }
    const toggle = () => { state.open.has(key) ? state.open.delete(key) : state.open.add(key); renderBatches(pipeline); };
    const live = r.live || r.phase === "pending" || r.phase === "rewind";
    body.append(el(
      "tr",
      { class: `batch${highlight ? " highlight" : ""}${live ? "" : " dead"}`, "data-batch": key, onclick: toggle, title: "click for what it read and its links" },
      el("td", { class: "mono nowrap" }, el("span", { class: "caret" }, state.open.has(key) ? "▾ " : "▸ "), batchName(r)),
      el("td", {}, phaseBadge(r)),
      el("td", { class: "num", "data-label": "read" }, fmt(r.records_in)),
      el("td", { class: "num", "data-label": "quarantined" }, quarantined, late, duplicate),
      // (A phone shows each batch as a card: every value with its label.)
      el("td", { class: "num optional", "data-label": "keys updated" }, fmt(r.keys_updated)),
      el("td", { class: "num narrow-hidden", "data-label": "took" }, r.duration_ms === null || r.duration_ms === undefined ? "" : `${(r.duration_ms / 1000).toFixed(1)} s`),
      el("td", { class: "num optional", "data-label": "arrival to commit" }, r.arrival_to_commit_s === null || r.arrival_to_commit_s === undefined ? "" : age(r.arrival_to_commit_s)),
      el("td", { class: "num optional", "data-label": "state version" }, fmt(r.state_version)),
      el("td", { class: "narrow-hidden", "data-label": r.committed_at ? "committed" : "planned", title: when(r.committed_at || r.planned_at) }, ago(r.committed_at || r.planned_at)),
      el("td", {}, rewindable ? el("button", { class: "rewind", onclick: (e) => { e.stopPropagation(); askRewind(pipeline, r.batch_id); } }, "Rewind here") : ""),
    ));
    if (state.open.has(key)) body.append(details(pipeline, r));
  }
  if (!state.scrolled) {
    state.scrolled = true;
    body.querySelector("tr.highlight")?.scrollIntoView({ block: "center" });
  }
  if (rows.length) {
    body.append(el("tr", {}, el("td", { colspan: "9", class: "muted" }, "Batch 0: the empty state before the first batch"),
      el("td", {}, el("button", { class: "rewind", onclick: () => askRewind(pipeline, 0) }, "Rewind to 0"))));
  }
}

function chart(svg, values, kind) {
  svg.replaceChildren();
  const width = svg.clientWidth || 320;
  const height = svg.clientHeight || 150;
  const pad = { l: 44, r: 8, t: 8, b: 20 };
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
  const cx = (i) => pad.l + i * w + w / 2;
  add("line", { x1: pad.l, y1: height - pad.b, x2: width - pad.r, y2: height - pad.b, class: "axis" });
  add("text", { x: 2, y: pad.t + 8 }, fmt(Math.round(max * 10) / 10));
  add("text", { x: 2, y: height - pad.b }, "0");
  // Batch labels under the axis: every batch when they fit, else evenly spaced (ends included).
  const fit = Math.max(1, Math.floor((width - pad.l - pad.r) / 34));
  const step = Math.ceil(values.length / fit);
  values.forEach((v, i) => {
    if (i % step === 0 || i === values.length - 1) add("text", { x: cx(i), y: height - 5, "text-anchor": "middle", class: "tick" }, String(v.x));
  });
  if (kind === "bars") {
    values.forEach((v, i) => {
      if (v.y === null || v.y === undefined) return;
      const bar = add("rect", { class: `bar${v.dead ? " dead" : ""}`, x: pad.l + i * w + w * 0.1, y: y(v.y), width: Math.max(w * 0.8, 1), height: height - pad.b - y(v.y) });
      bar.append(Object.assign(document.createElementNS(ns, "title"), { textContent: `batch ${v.x}: ${fmt(v.y)}` }));
    });
  } else {
    const xy = values.map((v, i) => (v.y === null || v.y === undefined ? null : [cx(i), y(v.y), v])).filter(Boolean);
    add("polyline", { class: "line", points: xy.map(([x, yy]) => `${x},${yy}`).join(" ") });
    xy.forEach(([x, yy, v]) => add("circle", { class: `dot${v.dead ? " dead" : ""}`, cx: x, cy: yy, r: 2.5 })
      .append(Object.assign(document.createElementNS(ns, "title"), { textContent: `batch ${v.x}: ${fmt(v.y)}` })));
  }
}

function renderCharts(pipeline) {
  // The live lineage by default; rewound batches only on request (greyed).
  const committed = state.batches.filter((r) => r.phase === "committed" && (r.live || state.showRewound));
  const point = (r, yv) => ({ x: r.epoch ? `${r.batch_id}/e${r.epoch}` : r.batch_id, y: yv, dead: !r.live });
  chart($("#chart-records"), committed.map((r) => point(r, r.records_in)), "bars");
  chart($("#chart-duration"), committed.map((r) => point(r, r.duration_ms === null ? null : r.duration_ms / 1000)), "line");
  chart($("#chart-lag"), committed.map((r) => point(r, r.waiting_after)), "line");
  $("#lag-unit").textContent = pipeline.lag ? pipeline.lag.unit : "source units";
  renderRates(state.batches.filter((r) => r.phase === "committed" && r.live));
}

function rate(n) {
  // Whole numbers from 100 up; below, two significant digits ("0.15", not "0").
  return n >= 100 ? fmt(Math.round(n)) : String(Number(n.toPrecision(2)));
}

function renderRates(live) {
  // Throughput: records per second of batch time, and per hour of wall-clock
  // time across the batches shown; time from a batch's oldest input's arrival to its commit.
  const records = live.reduce((n, r) => n + (r.records_in || 0), 0);
  const busy = live.reduce((n, r) => n + (r.duration_ms || 0), 0) / 1000;
  const times = live.map((r) => Date.parse(r.committed_at)).filter((t) => !Number.isNaN(t));
  const span = times.length > 1 ? (Math.max(...times) - Math.min(...times)) / 1000 : 0;
  const waits = live.map((r) => r.arrival_to_commit_s).filter((v) => v !== null && v !== undefined).sort((a, b) => a - b);
  const parts = [];
  if (busy > 0) parts.push(`${rate(records / busy)} records/s while running`);
  if (span > 0) parts.push(`${rate((records * 3600) / span)} records/h over the last ${live.length} batches`);
  if (waits.length) parts.push(`arrival to commit: median ${age(waits[Math.floor(waits.length / 2)])}, worst ${age(waits[waits.length - 1])}`);
  $("#rates").textContent = parts.join(" · ");
}

function renderQuarantine(pipeline) {
  const q = state.quarantine;
  const reasons = $("#reasons");
  reasons.replaceChildren();
  const body = $("#quarantine tbody");
  body.replaceChildren();
  if (!q) return;
  const where = state.scope || (q.lineage === "all" ? "in all batches, rewound ones included" : "in the live batches");
  $("#quarantine-scope").textContent = `${fmt(q.total)} record(s) ${where}; newest ${fmt(q.rows.length)} shown`;
  for (const [reason, count] of Object.entries(q.by_reason)) {
    // A reason asks the API for its own records: the newest 200 of them, not those of the 200 shown.
    reasons.append(el("button", { class: reason === state.reason ? "active" : "", onclick: () => { state.reason = state.reason === reason ? null : reason; loadQuarantine(pipeline, state.scopeRow, true).catch(showError); } }, `${reason} (${fmt(count)})`));
  }
  const csv = new URLSearchParams({ format: "csv", lineage: q.lineage });
  if (state.reason) csv.set("reason", state.reason);
  if (state.scopeRow) { csv.set("batch_id", state.scopeRow.batch_id); csv.set("epoch", state.scopeRow.epoch); }
  $("#quarantine-csv").href = `${BASE}/api/pipelines/${encodeURIComponent(pipeline.name)}/quarantine?${csv}`;
  const needle = state.search.toLowerCase();
  const matching = [];
  for (const r of q.rows) {
    if (state.reason && r.reason !== state.reason) continue;
    const where = r.file && r.file.startsWith("kafka://") ? `${r.file} offset ${r.line}` : `${r.file}:${r.line}`;
    if (needle && !`${where} ${r.reason} ${r.raw}`.toLowerCase().includes(needle)) continue;
    matching.push([r, where]);
  }
  // A page at a time: every record at once made the page 9,400 px tall.
  for (const [r, where] of matching.slice(0, state.quarantineShown)) {
    body.append(el("tr", {}, el("td", { class: "mono", "data-label": "batch" }, String(r.batch_id)), el("td", { class: "mono", "data-label": "epoch" }, String(r.epoch)),
      el("td", { class: "mono where" }, where), el("td", {}, r.reason), el("td", { class: "raw" }, r.raw)));
  }
  const more = matching.length - state.quarantineShown;
  if (more > 0) {
    body.append(el("tr", { class: "more" }, el("td", { colspan: "5" }, el("button", { class: "rewind", onclick: () => {
      state.quarantineShown += QUARANTINE_PAGE;
      renderQuarantine(pipeline);
    } }, `show ${Math.min(more, QUARANTINE_PAGE)} more (${fmt(more)} not shown)`))));
  }
}

async function loadQuarantine(pipeline, row, keepReason = false) {
  const query = new URLSearchParams({ limit: "200", lineage: state.quarantineAll ? "all" : "live" });
  if (row) { query.set("batch_id", row.batch_id); query.set("epoch", row.epoch); }
  const same = (state.scopeRow || null) === (row || null);
  if (!keepReason && !same) state.reason = null;  // a refresh keeps the reason chosen; another scope does not
  if (state.reason) query.set("reason", state.reason);
  state.scope = row ? `in batch ${batchName(row)}` : null;
  state.scopeRow = row || null;
  state.quarantine = await api(`pipelines/${encodeURIComponent(pipeline.name)}/quarantine?${query}`);
  state.quarantineShown = QUARANTINE_PAGE;
  renderQuarantine(pipeline);
}

async function select(name) {
  if (state.selected !== name) state.open.clear();
  state.selected = name;
  renderPipelines();
  const pipeline = state.pipelines.find((p) => p.name === name);
  if (!pipeline) return;
  $("#detail").hidden = false;
  $("#detail-name").textContent = name;
  const layout = pipeline.layout === "appended"
    ? "; state: appended layout (partial rows: read it with `microbatch query`, or the SQL `microbatch query --sql spark` prints)"
    : pipeline.merged_on_read
      ? "; state: merged on read (Delta deletion vectors: its readers need Delta 2.3 or later)"
      : "";
  const watermark = pipeline.late_policy
    ? `; event time: watermark ${pipeline.watermark ? when(pipeline.watermark) : "none yet"} (older records: ${pipeline.late_policy})`
    : "";
  const final = pipeline.final
    ? `; final windows: ${fmt(pipeline.final.rows)} rows in ${pipeline.final.path} (${pipeline.final.through ? `every window ended by ${when(pipeline.final.through)}` : "none final yet"})`
    : "";
  $("#detail-source").textContent = `${pipeline.source || ""}; spec ${pipeline.spec_path}${layout}${watermark}${final}`;
  $("#dag-link").href = `${AIRFLOW}/dags/${encodeURIComponent(pipeline.dag_id)}`;
  state.batches = await api(`pipelines/${encodeURIComponent(name)}/batches?limit=100&group=batch`);
  renderCharts(pipeline);
  renderBatches(pipeline);
  await loadQuarantine(pipeline, state.scopeRow);
}

// -- rewind ----------------------------------------------------------------------

function askRewind(pipeline, batchId) {
  const dialog = $("#rewind-dialog");
  $("#rewind-name").textContent = pipeline.name;
  $("#rewind-batch").textContent = batchId;
  // Said before the click: a paused DAG's run waits until someone unpauses it.
  $("#rewind-paused").hidden = !pipeline.paused;
  dialog.onclose = async () => {
    if (dialog.returnValue !== "confirm") return;
    try {
      const run = await api(`pipelines/${encodeURIComponent(pipeline.name)}/rewind`, {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ batch_id: batchId, rewind_only: $("#rewind-only").checked }),
      });
      showError(null);
      await followRewind(pipeline, batchId, run.dag_run_id);
    } catch (err) {
      showError(err);
    }
  };
  dialog.showModal();
}

// The run a rewind triggered: linked, its state until it ends, then what it did.
async function followRewind(pipeline, batchId, runId) {
  const before = { epoch: pipeline.epoch, batch: pipeline.batch_id };
  // A panel fixed to the bottom of the view: the feedback shows where the
  // user is, however far down the batch table (or the DAG's tab) they clicked.
  const box = $("#rewind-status");
  const badge = el("span", { class: "badge planned" }, "queued");
  const result = el("span", {});
  const paused = el("span", { class: "paused-note", hidden: "" },
    "its DAG is paused: this run waits until it is unpaused ",
    el("button", { class: "unpause", onclick: () => unpause(pipeline).catch(showError) }, "Unpause the DAG"));
  // Closable at any time: on a phone the panel covers the page's end (the run goes on; its row says how it ends).
  const close = el("button", { class: "close", title: "close", onclick: () => { box.hidden = true; document.body.classList.remove("with-panel"); } }, "×");
  document.body.classList.add("with-panel");
  box.hidden = false;
  box.replaceChildren(close, `Rewind of ${pipeline.name} to batch ${batchId}: run `,
    el("a", { href: runUrl(pipeline.dag_id, runId), target: "_top" }, runId), " ", badge, " ", paused, result);
  await refresh();
  for (;;) {
    const run = await api(`pipelines/${encodeURIComponent(pipeline.name)}/runs/${encodeURIComponent(runId)}`);
    badge.textContent = run.state || "queued";
    badge.className = `badge ${run.state === "success" ? "committed" : run.state === "failed" ? "problem" : "planned"}`;
    paused.hidden = !(run.dag_paused && (run.state === "queued" || !run.state));
    if (run.state === "success" || run.state === "failed") break;
    await new Promise((done) => setTimeout(done, 2000));
  }
  await refresh();
  // The ledger's rewind row this run wrote (the pipelines' summary may still be the last probe's).
  const now = (state.selected === pipeline.name && state.batches.find((r) => r.phase === "rewind" && r.run_id === runId)) || null;
  if (badge.textContent === "failed") {
    result.textContent = "the rewind failed: its task log says why; nothing changed";
  } else if (now) {
    const cut = before.batch > batchId + 1 ? `batches ${batchId + 1} to ${before.batch} of epoch ${before.epoch} left the state; `
      : before.batch === batchId + 1 ? `batch ${before.batch} of epoch ${before.epoch} left the state; ` : "";
    result.textContent = `done: ${cut}now epoch ${now.epoch}, at batch ${now.batch_id}`;
  } else {
    result.textContent = "done: nothing to rewind (the pipeline was at that batch already)";
  }
}

async function unpause(pipeline) {
  await api(`pipelines/${encodeURIComponent(pipeline.name)}/unpause`, { method: "POST" });
  await refresh();
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

function current() {
  return state.pipelines.find((p) => p.name === state.selected);
}

$("#show-rewound").addEventListener("change", (e) => { state.showRewound = e.target.checked; if (current()) renderCharts(current()); });
$("#quarantine-all").addEventListener("change", (e) => { state.quarantineAll = e.target.checked; if (current()) loadQuarantine(current(), state.scopeRow).catch(showError); });
$("#quarantine-search").addEventListener("input", (e) => { state.search = e.target.value; state.quarantineShown = QUARANTINE_PAGE; if (current()) renderQuarantine(current()); });
$("#quarantine-every").addEventListener("click", (e) => { e.preventDefault(); if (current()) loadQuarantine(current(), null).catch(showError); });
applyTheme();
matchMedia("(prefers-color-scheme: dark)").addEventListener("change", applyTheme);
window.addEventListener("storage", (e) => { if (e.key === "theme") applyTheme(); });
refresh();
setInterval(() => { applyTheme(); if (!$("#rewind-dialog").open) refresh(); }, 30000);
