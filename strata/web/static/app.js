// The page of `strata serve` / `strata router`: a chat playground and a live dashboard.
// Everything it shows comes from this server's own endpoints, called with the API key the user
// typed (kept in sessionStorage, never in the page): /v1/models, /v1/chat/completions,
// /get_server_info, /metrics (Prometheus text) and, on a router, /workers.
"use strict";

const KEY_STORAGE = "strata.apiKey";
const POLL_MS = 1000;
const RATE_WINDOW_S = 10; // tokens/s and requests/s: counter growth over the last 10 s
const LATENCY_WINDOW_S = 60; // latency percentiles: observations of the last minute
const HISTORY_S = 300; // what the sparkline shows

const $ = (id) => document.getElementById(id);

// ------------------------------------------------------------------ API calls and the key

class AuthError extends Error {}

function authHeaders() {
  const key = sessionStorage.getItem(KEY_STORAGE);
  return key ? { Authorization: "Bearer " + key } : {};
}

async function api(path, init = {}) {
  const resp = await fetch(path, { ...init, headers: { ...(init.headers || {}), ...authHeaders() } });
  if (resp.status === 401) {
    $("auth-banner").hidden = false;
    throw new AuthError(await errorMessage(resp));
  }
  return resp;
}

async function errorMessage(resp) {
  const text = await resp.text();
  try {
    return JSON.parse(text).error.message;
  } catch (e) {
    return `${resp.status} ${text.slice(0, 300)}`;
  }
}

function setUpKeyForm() {
  $("api-key").value = sessionStorage.getItem(KEY_STORAGE) || "";
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const key = $("api-key").value.trim();
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    else sessionStorage.removeItem(KEY_STORAGE);
    $("auth-banner").hidden = true;
    loadInfo();
  });
  $("forget-key").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORAGE);
    $("api-key").value = "";
  });
}

// ------------------------------------------------------------------ server identity

let isRouter = false;

async function loadInfo() {
  try {
    const info = await (await api("/get_server_info")).json();
    isRouter = info.role === "router";
    $("role").textContent = isRouter ? `router (${info.router_config.policy})` : "server";
    $("model-name").textContent = isRouter ? `${info.num_routable_workers}/${info.num_workers} workers` : info.model;
    $("workers-box").hidden = !isRouter;
    // the router counts requests, not tokens: token figures and cache tiers are on each worker's page
    for (const el of document.querySelectorAll(".server-only")) el.hidden = isRouter;
    $("stat-requests").previousElementSibling.textContent = isRouter ? "Requests sent" : "Requests done";
    const models = await (await api("/v1/models")).json();
    const select = $("model");
    const current = select.value;
    select.replaceChildren(
      ...(models.data || []).map((m) => {
        const opt = document.createElement("option");
        opt.value = opt.textContent = m.id;
        return opt;
      })
    );
    if (current) select.value = current;
  } catch (e) {
    $("role").textContent = e instanceof AuthError ? "API key needed" : "unreachable";
  }
}

// ------------------------------------------------------------------ playground

let history = []; // the conversation sent with every request: [{role, content}]
let controller = null; // aborts the answer being generated

function buildRequest() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...history);
  const body = {
    model: $("model").value || undefined,
    messages,
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
    stream: $("stream").checked,
  };
  if (body.stream) body.stream_options = { include_usage: true };
  const stop = $("stop").value.split("\n").filter((s) => s.length > 0);
  if (stop.length) body.stop = stop;
  const schemaText = $("schema").value.trim();
  if (schemaText) {
    let schema;
    try {
      schema = JSON.parse(schemaText);
    } catch (e) {
      throw new Error(`the JSON schema is not valid JSON: ${e.message}`);
    }
    body.response_format = { type: "json_schema", json_schema: { name: "answer", schema, strict: true } };
  }
  return body;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  div.append(content);
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function showStats(div, usage, timing) {
  const stats = document.createElement("div");
  stats.className = "stats";
  const parts = [];
  if (usage) {
    const cached = (usage.prompt_tokens_details || {}).cached_tokens ?? 0;
    div.dataset.cachedTokens = cached;
    div.dataset.promptTokens = usage.prompt_tokens;
    div.dataset.completionTokens = usage.completion_tokens;
    parts.push(`prompt <b>${usage.prompt_tokens}</b> tokens`, `cached <b class="cached">${cached}</b>`,
      `output <b>${usage.completion_tokens}</b>`);
  }
  if (timing.ttft !== null) parts.push(`first token <b>${fmtMs(timing.ttft)}</b>`);
  parts.push(`total <b>${fmtMs(timing.total)}</b>`);
  if (usage && timing.ttft !== null && usage.completion_tokens > 1 && timing.total > timing.ttft) {
    const rate = (usage.completion_tokens - 1) / ((timing.total - timing.ttft) / 1000);
    parts.push(`<b>${rate.toFixed(1)}</b> tokens/s`);
  }
  stats.innerHTML = parts.join(" · "); // numbers only
  if (timing.finish) stats.append(` · finish: ${timing.finish}`);
  div.append(stats);
}

async function readStream(resp, onDelta) {
  // Server-sent events: "data: {json}\n\n" ... "data: [DONE]\n\n"
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let usage = null;
  let finish = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return { usage, finish };
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const delta = choice.delta || {};
          if (delta.content) onDelta(delta.content);
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
    }
  }
  return { usage, finish };
}

async function send() {
  const prompt = $("prompt").value;
  if (!prompt.trim() || controller) return;
  $("chat-error").textContent = "";
  history.push({ role: "user", content: prompt });
  let body;
  try {
    body = buildRequest();
  } catch (e) {
    history.pop();
    $("chat-error").textContent = e.message;
    return;
  }
  $("prompt").value = "";
  addMessage("user", prompt);
  const div = addMessage("assistant", "");
  const content = div.querySelector(".content");
  div.classList.add("pending");
  controller = new AbortController();
  $("send").disabled = true;
  $("stop-gen").disabled = false;
  const started = performance.now();
  let ttft = null;
  let text = "";
  try {
    const resp = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!resp.ok) throw new Error(await errorMessage(resp));
    let result;
    if (body.stream) {
      result = await readStream(resp, (delta) => {
        if (ttft === null) ttft = performance.now() - started;
        text += delta;
        content.textContent = text;
        div.scrollIntoView({ block: "end" });
      });
    } else {
      const out = await resp.json();
      ttft = null;
      text = out.choices[0].message.content || "";
      content.textContent = text;
      result = { usage: out.usage, finish: out.choices[0].finish_reason };
    }
    history.push({ role: "assistant", content: text });
    showStats(div, result.usage, { ttft, total: performance.now() - started, finish: result.finish });
    div.classList.add("done");
  } catch (e) {
    const aborted = e.name === "AbortError";
    if (text) history.push({ role: "assistant", content: text });
    else history.pop(); // drop the unanswered question
    if (!aborted) div.classList.add("failed");
    content.textContent = text + (aborted ? " [stopped]" : (text ? "\n" : "") + `error: ${e.message}`);
  } finally {
    div.classList.remove("pending");
    controller = null;
    $("send").disabled = false;
    $("stop-gen").disabled = true;
  }
}

function setUpPlayground() {
  $("chat-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) {
      ev.preventDefault();
      send();
    }
  });
  $("stop-gen").addEventListener("click", () => controller && controller.abort());
  $("reset").addEventListener("click", () => {
    if (controller) controller.abort();
    history = [];
    $("messages").replaceChildren();
    $("chat-error").textContent = "";
  });
}

// ------------------------------------------------------------------ Prometheus text

function parseMetrics(text) {
  // [{name, labels, value}] from the text exposition format (comments and blank lines skipped)
  const samples = [];
  const lineRe = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
  const labelRe = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(lineRe);
    if (!m) continue;
    const labels = {};
    for (const l of (m[2] || "").matchAll(labelRe)) labels[l[1]] = l[2].replace(/\\(.)/g, "$1");
    samples.push({ name: m[1], labels, value: toNumber(m[3]) });
  }
  return samples;
}

function toNumber(s) {
  if (s === "+Inf") return Infinity;
  if (s === "-Inf") return -Infinity;
  return Number(s);
}

function total(samples, name) {
  // summed over labels; 0 where no sample is exported yet (a labelled counter before its first count)
  let sum = 0;
  for (const s of samples) if (s.name === name) sum += s.value;
  return sum;
}

function buckets(samples, histogram) {
  // cumulative counts by upper bound, summed over every other label: [[le, count], ...] sorted
  const byLe = new Map();
  for (const s of samples) {
    if (s.name !== histogram + "_bucket") continue;
    const le = toNumber(s.labels.le);
    byLe.set(le, (byLe.get(le) || 0) + s.value);
  }
  return [...byLe.entries()].sort((a, b) => a[0] - b[0]);
}

function quantile(q, cumulative) {
  // as Prometheus' histogram_quantile: linear interpolation inside the bucket holding the rank
  if (!cumulative.length) return null;
  const count = cumulative[cumulative.length - 1][1];
  if (!(count > 0)) return null;
  const rank = q * count;
  let prevLe = 0;
  let prevCount = 0;
  for (const [le, c] of cumulative) {
    if (c >= rank) {
      if (le === Infinity) return prevLe;
      return prevLe + ((le - prevLe) * (rank - prevCount)) / Math.max(c - prevCount, 1e-12);
    }
    prevLe = le;
    prevCount = c;
  }
  return prevLe;
}

function minus(now, then) {
  // bucket counts observed between two snapshots (then may be missing)
  if (!then) return now;
  const before = new Map(then);
  return now.map(([le, c]) => [le, c - (before.get(le) || 0)]);
}

// ------------------------------------------------------------------ dashboard

const snapshots = []; // [{t, values: {...counters}, hist: {name: buckets}}], oldest first
const SERVER_LATENCIES = [
  ["time to first token", "strata:time_to_first_token_seconds"],
  ["inter-token latency", "strata:inter_token_latency_seconds"],
  ["end to end", "strata:e2e_request_latency_seconds"],
];
const ROUTER_LATENCIES = [["time to first byte", "strata:router_time_to_first_byte_seconds"]];

function fmt(n, digits = 0) {
  if (n === null || n === undefined || Number.isNaN(n)) return "–";
  return n.toLocaleString(undefined, { maximumFractionDigits: digits, minimumFractionDigits: digits });
}
function fmtMs(ms) {
  if (ms === null || ms === undefined) return "–";
  return ms < 1000 ? `${ms.toFixed(0)} ms` : `${(ms / 1000).toFixed(2)} s`;
}
function fmtPct(x) {
  return x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)}%`;
}
function setText(id, text) {
  $(id).textContent = text;
}

function snapshotAgo(seconds, now) {
  // the oldest snapshot at most `seconds` old (null if there is only the newest)
  for (const s of snapshots) if (now - s.t <= seconds * 1000) return s === snapshots[snapshots.length - 1] ? null : s;
  return null;
}

function rate(key, now) {
  const last = snapshots[snapshots.length - 1];
  const first = snapshotAgo(RATE_WINDOW_S, now);
  if (!first || last.values[key] === null || first.values[key] === null) return null;
  return (last.values[key] - first.values[key]) / ((last.t - first.t) / 1000);
}

function cell(row, text) {
  const td = document.createElement("td");
  td.textContent = text;
  row.append(td);
}

function renderLatency(latencies, now) {
  const last = snapshots[snapshots.length - 1];
  const first = snapshotAgo(LATENCY_WINDOW_S, now);
  let windowed = true;
  const rows = latencies.map(([label, name]) => {
    let b = minus(last.hist[name], first && first.hist[name]);
    if (!b.length || !(b[b.length - 1][1] > 0)) {
      b = last.hist[name]; // nothing in the last minute: since start
      windowed = false;
    }
    const tr = document.createElement("tr");
    tr.dataset.metric = name;
    cell(tr, label);
    for (const q of [0.5, 0.9, 0.99]) {
      const v = quantile(q, b);
      cell(tr, v === null ? "–" : fmtMs(v * 1000));
    }
    cell(tr, fmt(b.length ? b[b.length - 1][1] : 0));
    return tr;
  });
  $("latency").tBodies[0].replaceChildren(...rows);
  setText("latency-window", windowed ? "last minute" : "since start where the last minute saw none");
}

function renderTiers(samples, info) {
  const rows = [];
  const tiers = new Map();
  for (const s of samples) {
    if (s.name === "strata:hicache_hit_tokens") tiers.set(s.labels.tier, { tokens: s.value });
  }
  for (const s of samples) {
    if (s.name === "strata:hicache_hit_rate" && tiers.has(s.labels.tier)) tiers.get(s.labels.tier).rate = s.value;
  }
  if (!tiers.size && info && !isRouter) {
    // one tier (the device's radix cache): the server's own counters
    tiers.set("device", { tokens: total(samples, "strata:cached_tokens_total"), rate: info.cache_hit_rate });
  }
  for (const [tier, t] of tiers) {
    const tr = document.createElement("tr");
    cell(tr, tier);
    cell(tr, fmt(t.tokens));
    cell(tr, fmtPct(t.rate));
    rows.push(tr);
  }
  $("tiers").tBodies[0].replaceChildren(...rows);
}

function renderWorkers(listing) {
  const rows = listing.workers.map((w) => {
    const info = w.server_info || {};
    const tr = document.createElement("tr");
    cell(tr, w.url);
    cell(tr, w.status);
    cell(tr, fmt(w.load));
    cell(tr, fmt(w.in_flight));
    cell(tr, fmt(info.num_running_reqs));
    cell(tr, fmt(info.num_queue_reqs));
    cell(tr, fmtPct(info.token_usage));
    cell(tr, fmtPct(info.cache_hit_rate));
    cell(tr, fmt(w.num_requests));
    return tr;
  });
  $("workers").tBodies[0].replaceChildren(...rows);
}

function drawSparkline(now) {
  // tokens out/s (server) or requests/s (router) between consecutive polls, over up to HISTORY_S
  const key = isRouter ? "requests" : "tokensOut";
  const points = [];
  for (let i = 1; i < snapshots.length; i++) {
    const a = snapshots[i - 1];
    const b = snapshots[i];
    if (a.values[key] === null || b.values[key] === null) continue;
    points.push([b.t, (b.values[key] - a.values[key]) / ((b.t - a.t) / 1000)]);
  }
  const spanMs = Math.min(HISTORY_S * 1000, Math.max(30_000, now - snapshots[0].t));
  const top = Math.max(1, ...points.map((p) => p[1]));
  const coords = points.map(([t, v]) => {
    const x = 300 - ((now - t) / spanMs) * 300;
    return `${x.toFixed(1)},${(48 - (v / top) * 46).toFixed(1)}`;
  });
  $("spark").querySelector("polyline").setAttribute("points", coords.join(" "));
  setText("spark-label", `${isRouter ? "requests/s" : "tokens out/s"}, last ${Math.round(spanMs / 1000)} s (peak ${fmt(top, 1)})`);
}

async function poll() {
  const now = Date.now();
  try {
    const [metricsResp, infoResp, workersResp] = await Promise.all([
      api("/metrics"),
      api("/get_server_info"),
      isRouter ? api("/workers") : Promise.resolve(null),
    ]);
    const samples = parseMetrics(await metricsResp.text());
    const info = await infoResp.json();
    const values = isRouter
      ? {
          requests: total(samples, "strata:router_requests_total"),
          tokensIn: null, // the router does not count tokens: each worker's own page does
          tokensOut: null,
        }
      : {
          requests: total(samples, "strata:num_requests_total"),
          tokensIn: total(samples, "strata:prompt_tokens_total"),
          tokensOut: total(samples, "strata:generation_tokens_total"),
        };
    const hist = {};
    for (const [, name] of isRouter ? ROUTER_LATENCIES : SERVER_LATENCIES) hist[name] = buckets(samples, name);
    snapshots.push({ t: now, values, hist });
    while (snapshots.length > 2 && now - snapshots[0].t > HISTORY_S * 1000) snapshots.shift();

    setText("stat-running", fmt(info.num_running_reqs));
    setText("stat-queued", fmt(info.num_queue_reqs));
    setText("stat-requests", fmt(values.requests));
    setText("stat-req-rate", fmt(rate("requests", now), 2));
    setText("stat-tokens-in-rate", fmt(rate("tokensIn", now), 1));
    setText("stat-tokens-out-rate", fmt(rate("tokensOut", now), 1));
    setText("stat-prompt-tokens", fmt(values.tokensIn));
    setText("stat-output-tokens", fmt(values.tokensOut));
    if (isRouter) {
      const ws = (workersResp ? await workersResp.json() : { workers: [] });
      renderWorkers(ws);
      const usage = ws.workers.map((w) => (w.server_info || {}).token_usage).filter((u) => u !== undefined && u !== null);
      const hits = ws.workers.map((w) => (w.server_info || {}).cache_hit_rate).filter((u) => u !== undefined && u !== null);
      setText("stat-kv", usage.length ? fmtPct(usage.reduce((a, b) => a + b, 0) / usage.length) : "–");
      setText("stat-kv-pages", "mean over routable workers");
      setText("stat-hit-rate", hits.length ? fmtPct(hits.reduce((a, b) => a + b, 0) / hits.length) : "–");
      $("model-name").textContent = `${info.num_routable_workers}/${info.num_workers} workers`;
    } else {
      const kv = info.kv_cache || {};
      setText("stat-kv", fmtPct(kv.token_usage));
      setText("stat-kv-pages", `of ${fmt(kv.total_pages)} pages; ${fmt(kv.cached_pages)} hold cached prefixes`);
      setText("stat-hit-rate", fmtPct(info.cache_hit_rate));
      const b = info.batches || { unfinished: 0, lines: 0, lines_done: 0 };
      setText("stat-batches", fmt(b.unfinished));
      setText("stat-batch-lines", b.unfinished ? `${fmt(b.lines_done)} of ${fmt(b.lines)} lines answered` : "none running");
    }
    renderLatency(isRouter ? ROUTER_LATENCIES : SERVER_LATENCIES, now);
    renderTiers(samples, info);
    drawSparkline(now);
    setText("dash-updated", `updated ${new Date(now).toLocaleTimeString()}`);
    setText("dash-error", "");
  } catch (e) {
    setText("dash-error", e instanceof AuthError ? "API key needed" : `cannot read the server's metrics: ${e.message}`);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

setUpKeyForm();
setUpPlayground();
loadInfo().then(poll);
