// The llm_affinity status page: polls the upstreams JSON next to it and
// renders one row per upstream. Every request goes to this page's own
// origin, so Caddy's admin origin checks accept it.
"use strict";

const labels = ["upstream", "health", "drain", "in flight", "queued tokens", "KV used / capacity",
  "index fill", "engine prefix hits", "TTFT est. / observed", "recent TTFT", ""];

function fmtInt(n) { return (n ?? 0).toLocaleString("en-US"); }
function fmtSec(s) {
  if (s === undefined || s === null || s === 0) return "–";
  return s < 1 ? (s * 1000).toFixed(0) + " ms" : s.toFixed(2) + " s";
}
function pct(a, b) { return b > 0 ? (100 * a / b).toFixed(1) + "%" : "–"; }

function cell(tr, text, cls) {
  const td = document.createElement("td");
  td.dataset.label = labels[tr.children.length];
  if (text instanceof Node) td.append(text); else td.textContent = text;
  if (cls) td.className = cls;
  tr.append(td);
  return td;
}

// spark draws the observed TTFTs as a line and the estimates as dots.
function spark(observed, estimated) {
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("viewBox", "0 0 120 28");
  svg.setAttribute("role", "img");
  const obs = observed || [], est = estimated || [];
  svg.setAttribute("aria-label", obs.length + " recent TTFTs");
  if (obs.length === 0) return svg;
  const top = Math.max(...obs, ...est) || 1;
  const x = (i) => obs.length === 1 ? 60 : (i * 118) / (obs.length - 1) + 1;
  const y = (v) => 26 - (v / top) * 24;
  const line = document.createElementNS(ns, "polyline");
  // One sample is drawn as a flat line across the chart.
  const pts = obs.length === 1 ? [[1, obs[0]], [119, obs[0]]] : obs.map((v, i) => [x(i), v]);
  line.setAttribute("points", pts.map(([px, v]) => px.toFixed(1) + "," + y(v).toFixed(1)).join(" "));
  svg.append(line);
  est.forEach((v, i) => {
    const c = document.createElementNS(ns, "circle");
    c.setAttribute("cx", x(i).toFixed(1));
    c.setAttribute("cy", y(v).toFixed(1));
    c.setAttribute("r", "1.2");
    svg.append(c);
  });
  return svg;
}

async function act(dial, method) {
  const res = await fetch("upstreams/" + encodeURIComponent(dial) + "/drain", { method });
  if (!res.ok) throw new Error(method + " drain " + dial + ": " + res.status + " " + (await res.text()));
}

function row(u) {
  const tr = document.createElement("tr");
  tr.dataset.dial = u.dial;
  cell(tr, u.dial, "dial");
  const health = u.healthy === undefined ? ["unknown", "muted"] : u.healthy ? ["healthy", "ok"] : ["down", "bad"];
  // The engine's metrics not read now: the row's engine figures are old or missing.
  const failing = !!(u.engine && u.engine.last_error);
  const h = cell(tr, health[0], failing && health[1] !== "bad" ? "warn" : health[1]);
  if (failing) {
    h.append(document.createElement("br"), "scrape failing");
    h.title = u.engine.last_error + " (" + fmtInt(u.engine.scrape_errors) + " failed scrapes)";
  }
  const drainCls = u.drain === "active" ? "ok" : u.drain === "draining" ? "warn" : "bad";
  cell(tr, u.drain + (u.drain_cause ? " (" + u.drain_cause + ")" : ""), "drain " + drainCls);
  cell(tr, fmtInt(u.in_flight), "in-flight");
  cell(tr, fmtInt(u.queued_prefill_tokens + u.queued_decode_tokens), "queued");
  const cap = u.kv_capacity_tokens || (u.engine && u.engine.kv_capacity_tokens) || 0;
  let kv = fmtInt(u.kv_tokens_in_flight) + " / " + (cap ? fmtInt(cap) : "?");
  // A negative usage: the engine has not reported it.
  if (u.engine && u.engine.kv_usage >= 0) kv += " (engine " + (100 * u.engine.kv_usage).toFixed(1) + "%" + (failing ? ", last read" : "") + ")";
  cell(tr, kv, "kv");
  cell(tr, pct(u.index_blocks, u.index_capacity_blocks), "index");
  // A negative rate: the engine's prefix counters are not read yet.
  const hits = u.engine && u.engine.prefix_hit_rate >= 0 ? (100 * u.engine.prefix_hit_rate).toFixed(1) + "%" + (failing ? " (last read)" : "") : "–";
  cell(tr, hits, "hits");
  // The last streamed request's, when there is one (a non-streaming
  // response's "first token" is its headers, after the whole generation);
  // else the last request's.
  const obs = u.recent_ttft_seconds || [], est = u.recent_estimated_ttft_seconds || [];
  const last = obs.length ? [est[est.length - 1], obs[obs.length - 1]] : [u.last_estimated_ttft_seconds, u.last_ttft_seconds];
  cell(tr, fmtSec(last[0]) + " / " + fmtSec(last[1]), "ttft");
  cell(tr, spark(u.recent_ttft_seconds, u.recent_estimated_ttft_seconds), "chart");
  if (u.drain_cause === "removed") {
    // No config names it any more: there is nothing to drain or undrain.
    cell(tr, "", "actions");
    return tr;
  }
  const b = document.createElement("button");
  const draining = u.drain !== "active";
  b.textContent = draining ? "undrain" : "drain";
  b.className = draining ? "undrain" : "drain";
  b.onclick = async () => {
    b.disabled = true;
    try { await act(u.dial, draining ? "DELETE" : "POST"); } catch (e) { showError(e); }
    refresh();
  };
  cell(tr, b, "actions");
  return tr;
}

function showError(e) {
  const p = document.getElementById("error");
  p.textContent = String(e && e.message || e);
  p.hidden = false;
}

// syncLine says how this router shares its view with its peers (the sync
// option), "" without sync.
function syncLine(v) {
  const conns = (v && v.connections) || [];
  if (conns.length === 0) return ["", "", ""];
  const up = conns.filter((c) => c.connected).length;
  const peers = (v.peers || []).map((p) => p.name);
  let state = "NATS connected";
  if (up === 0) state = "NATS not connected, routing on this router's own view";
  else if (up < conns.length) state = up + " of " + conns.length + " NATS connections up; where one is down, routing on this router's own view";
  let text = "sync: " + state;
  text += ", " + peers.length + (peers.length === 1 ? " peer" : " peers") + (peers.length ? " (" + peers.join(", ") + ")" : "");
  const from = conns.map((c) => c.snapshot_from).filter(Boolean);
  if (from.length) text += ", started with " + from.join(", ") + "'s view";
  const dropped = conns.reduce((n, c) => n + c.events_dropped, 0);
  if (dropped) text += ", " + fmtInt(dropped) + " events dropped";
  // Why a connection is down, on hover.
  const why = conns.map((c) => c.last_error).filter(Boolean).join("; ");
  return [text, up === conns.length ? "" : "bad", why];
}

let timer;
async function refresh() {
  clearTimeout(timer);
  try {
    const [res, gw, sy] = await Promise.all([
      fetch("upstreams", { cache: "no-store" }),
      fetch("gateway", { cache: "no-store" }),
      fetch("sync", { cache: "no-store" }),
    ]);
    if (!res.ok) throw new Error("upstreams: " + res.status + " " + (await res.text()));
    if (!gw.ok) throw new Error("gateway: " + gw.status + " " + (await gw.text()));
    if (!sy.ok) throw new Error("sync: " + sy.status + " " + (await sy.text()));
    const ups = await res.json() || [];
    const gateway = await gw.json();
    const [syncText, syncCls, syncWhy] = syncLine(await sy.json());
    const line = document.getElementById("sync");
    line.textContent = syncText;
    line.className = syncCls;
    line.title = syncWhy;
    line.hidden = syncText === "";
    document.querySelector("#upstreams tbody").replaceChildren(...ups.map(row));
    const inFlight = ups.reduce((n, u) => n + u.in_flight, 0);
    document.getElementById("summary").textContent =
      ups.length + " upstreams, " + inFlight + " requests in flight, " + gateway.held +
      " waiting at the gateway, updated " + new Date().toLocaleTimeString();
    document.getElementById("error").hidden = true;
  } catch (e) {
    showError(e);
  }
  timer = setTimeout(refresh, 2000);
}
refresh();
