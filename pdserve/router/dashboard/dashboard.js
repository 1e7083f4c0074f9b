// The /dashboard page: polls /v1/status once per interval for the points it has not seen,
// keeps the last MAX_POINTS of them and redraws the worker table and the charts, and the
// adaptive planner's panel when the status has a `planner` section.
"use strict";

const MAX_POINTS = 600;
const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
  "#7f7f7f", "#bcbd22", "#17becf"];
const PCT = ["p50", "p90", "p99"];
const points = [];
const charts = {};
let lastT = 0;
let apiKey = sessionStorage.getItem("pdserve-key");

// Each chart: a title, a unit, and series named from the points seen so far.
const CHARTS = [
  ["ttft", "Time to first token", "s", (p) => pct(p.ttft_s)],
  ["tpot", "Time per output token", "s", (p) => pct(p.tpot_s)],
  ["itl", "Inter-token latency", "s", (p) => pct(p.itl_s)],
  ["rate", "Throughput (requests finished per interval)", "/s", (p) => ({
    "requests/s": p.requests_per_s, "output tokens/s": p.output_tokens_per_s })],
  ["queue", "Queue length (waiting)", "", (p) => Object.assign({ "router in flight": p.num_pending },
    mapValues(p.workers, (w) => w.num_waiting))],
  ["kv", "KV blocks used", "blocks", (p) => mapValues(p.workers, (w) => w.kv_blocks_used)],
  ["cache", "Prefix-cache hit rate per tier", "", (p) => mapValues(p.cache,
    (c) => (c.lookups ? c.hits / c.lookups : null))],
  ["transfer", "KV transfer", "bytes/s", (p) => ({ "sent": p.transfer_bytes_per_s })],
  ["parts", "TTFT breakdown (mean per interval)", "s", (p) => p.ttft_parts_s],
];
// Drawn only for an adaptive deployment: elsewhere a worker's threads never change.
const PLANNER_CHARTS = [
  ["cores", "Threads per worker (core groups)", "threads",
    (p) => mapValues(p.workers, (w) => w.threads)],
];
const NUM_DECISIONS = 12;

function pct(values) {
  const out = {};
  PCT.forEach((name, i) => { out[name] = values ? values[i] : null; });
  return out;
}

function mapValues(obj, fn) {
  const out = {};
  for (const key of Object.keys(obj || {})) out[key] = fn(obj[key]);
  return out;
}

function fmtBytes(n) {
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return n.toFixed(i ? 1 : 0) + " " + units[i];
}

function cell(text, cls) {
  const td = document.createElement("td");
  if (cls) td.className = cls;
  td.textContent = text;
  return td;
}

function renderWorkers(status) {
  const body = document.querySelector("#workers tbody");
  body.replaceChildren();
  for (const w of status.workers) {
    const tr = document.createElement("tr");
    tr.dataset.worker = w.worker;
    const l1 = (w.kv_tiers || {}).L1;
    const hit = l1 && l1.lookups ? (100 * l1.hits / l1.lookups).toFixed(1) + " %" : "–";
    const health = !w.ready ? "starting" : w.healthy ? "healthy" : "down";
    tr.append(cell(w.worker, "l"), cell(w.role, "l role"), cell(w.cpus.join(",") || "any", "l"),
      cell(w.threads || "–"), cell(health, "l" + (w.healthy ? "" : " down")),
      cell(w.num_waiting), cell(w.num_running), cell(w.active_requests));
    const kv = cell("", "l");
    const frac = w.num_total_blocks ? w.kv_blocks_used / w.num_total_blocks : 0;
    const bar = document.createElement("span");
    bar.className = "kv";
    bar.append(Object.assign(document.createElement("span"), {}));
    bar.firstChild.style.width = (100 * frac).toFixed(1) + "%";
    kv.append(bar, `${w.kv_blocks_used} / ${w.num_total_blocks}`);
    tr.append(kv, cell(hit), cell(fmtBytes(w.kv_bytes_sent)), cell(fmtBytes(w.kv_bytes_received)),
      ...["weight_bytes", "kv_pool_bytes", "rss_bytes", "pss_bytes"].map(
        (k) => cell(w[k] ? fmtBytes(w[k]) : "–")));
    body.append(tr);
  }
  const done = Object.entries(status.requests).map(([k, v]) => `${k} ${v}`).join(", ");
  const health = Object.assign(document.createElement("span"), status.health.ok
    ? { textContent: "healthy" }
    : { className: "bad", textContent: "unavailable: missing " + status.health.missing_roles.join(", ") });
  document.getElementById("model").textContent = status.model;
  document.getElementById("summary").replaceChildren(
    health, ` · ${status.num_pending} in flight · finished: ${done || "none"}`);
}

function row(...cells) {
  const tr = document.createElement("tr");
  tr.append(...cells);
  return tr;
}

// The targets the decisions aim at, each set or derived (the stall budget from the measured
// unloaded step: docs/adaptive.md, "Default targets").
function renderTargets(t) {
  const pool = t.pools[0] || {};
  const ms = (v, pending) => (v == null ? pending : `${v} ms`);
  document.getElementById("planner-targets").textContent =
    `stall budget ${ms(pool.max_gap_ms, "not yet (cost model unfitted)")} (${t.max_gap_source})` +
    ` · ITL ${ms(t.itl_ms, "none")} · TTFT ${ms(t.ttft_ms, t.ttft_source)} · unloaded step ` +
    `${ms(pool.unloaded_step_ms, "–")}, prefill ${pool.prefill_tokens_per_s ?? "–"} tokens/s`;
}

function renderPlanner(planner, workers) {
  const panel = document.getElementById("planner");
  panel.hidden = !planner;
  if (!planner) return;
  const round = (v) => (v ? `${v.num}, mean ${(1000 * v.mean).toFixed(0)} ms` : "none");
  document.getElementById("planner-summary").textContent =
    `split ${planner.split.prefill} prefill : ${planner.split.decode} decode · ` +
    `core switches ${planner.num_core_switches} (round trip ${round(planner.core_switch_round_trip_s)})` +
    ` · role switches ${planner.num_role_switches} · prefill asked ` +
    `${Math.round(planner.prefill_demand_tokens_per_s)} tokens/s`;
  renderTargets(planner.targets);
  document.getElementById("planner-targets").textContent += workers
    .filter((w) => w.stall_cap_tokens != null)
    .map((w) => ` · ${w.worker} guard: cap ${w.stall_cap_tokens} tokens a step, ` +
      `${w.num_stall_capped_steps} steps capped`).join("");
  const roles = Object.fromEntries(workers.map((w) => [w.worker, w.role]));
  const groups = document.querySelector("#core-groups tbody");
  groups.replaceChildren();
  planner.core_groups.forEach((g, i) => {
    for (const [worker, c] of Object.entries(g.workers)) {
      const tr = row(cell(`${i}: ${g.pool.join(",")}`, "l"), cell(worker, "l"),
        cell(roles[worker] || "", "l"), cell(c.cpus ? c.cpus.join(",") || "parked" : "?", "l"),
        cell(c.threads ?? "?"), cell(c.target_threads ?? "–"),
        cell(c.pending ? c.pending.join(",") || "park" : "", "l"));
      tr.dataset.worker = worker;
      groups.append(tr);
    }
  });
  const counts = document.querySelector("#decision-counts tbody");
  counts.replaceChildren(...Object.entries(planner.decisions).map(([key, n]) => {
    const [kind, reason] = key.split("/");
    return row(cell(kind, "l"), cell(reason, "l"), cell(n));
  }));
  const recent = document.querySelector("#decisions tbody");
  recent.replaceChildren(...planner.recent_decisions.slice(-NUM_DECISIONS).reverse().map((d) => {
    const predicted = Object.entries(d.predictions).map(([k, v]) => `${k} ${v}`).join(", ");
    return row(cell(new Date(d.t * 1000).toLocaleTimeString(), "l"), cell(d.request, "l"),
      cell(d.kind, "l"), cell(d.reason, "l"), cell(d.kind === "remote" ? d.prefill : d.decode, "l"),
      cell(d.num_prefill_tokens), cell(predicted, "l"));
  }));
}

function seriesNames(extract) {
  const names = [];
  for (const p of points) {
    for (const name of Object.keys(extract(p) || {})) if (!names.includes(name)) names.push(name);
  }
  return names;
}

function drawChart(key, title, unit, extract) {
  const names = seriesNames(extract);
  const data = [points.map((p) => p.t)];
  for (const name of names) data.push(points.map((p) => (extract(p) || {})[name] ?? null));
  let chart = charts[key];
  if (chart && chart.names.join() !== names.join()) {
    chart.plot.destroy();
    chart.box.remove();
    chart = null;
  }
  if (!chart) {
    const box = document.createElement("div");
    box.className = "chart";
    box.id = "chart-" + key;
    box.append(Object.assign(document.createElement("h2"), { textContent: title }));
    document.getElementById("charts").append(box);
    const opts = {
      width: 430, height: 200,
      series: [{}, ...names.map((name, i) => ({ label: name, stroke: PALETTE[i % PALETTE.length],
        width: 1.5, spanGaps: true }))],
      axes: [{}, { label: unit, size: 70,
        values: unit === "bytes/s" ? (u, ticks) => ticks.map((v) => fmtBytes(v) + "/s") : undefined }],
      legend: { live: false },
    };
    chart = charts[key] = { names, box, plot: new uPlot(opts, data, box) };
  } else {
    chart.plot.setData(data);
  }
}

async function poll() {
  const headers = apiKey ? { Authorization: "Bearer " + apiKey } : {};
  const resp = await fetch(`/v1/status?since=${lastT}`, { headers });
  if (resp.status === 401) {
    apiKey = window.prompt("API key for this router");
    if (apiKey) sessionStorage.setItem("pdserve-key", apiKey);
    return;
  }
  const status = await resp.json();
  for (const p of status.history) points.push(p);
  points.splice(0, Math.max(0, points.length - MAX_POINTS));
  if (points.length) lastT = points[points.length - 1].t;
  renderWorkers(status);
  renderPlanner(status.planner, status.workers);
  const shown = status.planner ? CHARTS.concat(PLANNER_CHARTS) : CHARTS;
  for (const [key, title, unit, extract] of shown) drawChart(key, title, unit, extract);
  return status.interval_s;
}

async function loop() {
  let interval_s = 1;
  try {
    interval_s = (await poll()) || interval_s;
  } catch (err) {
    const summary = document.getElementById("summary");
    summary.replaceChildren(Object.assign(document.createElement("span"),
      { className: "bad", textContent: `router unreachable: ${err}` }));
  }
  setTimeout(loop, interval_s * 1000);
}

loop();
