// The status page: renders the document that /status/events pushes (see router/status_page.py).
// Everything is built with textContent: names and reasons from the node are never parsed as HTML.
"use strict";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(c == null ? "-" : String(c)));
  return node;
}

function bytes(n) {
  if (typeof n !== "number") return "-";
  if (n < 1 << 30) return (n / (1 << 20)).toFixed(1) + " MiB";
  return (n / (1 << 30)).toFixed(2) + " GiB";
}

function duration(s) {
  if (typeof s !== "number") return "-";
  s = Math.floor(s);
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s";
  return Math.floor(s / 3600) + "h" + String(Math.floor(s % 3600 / 60)).padStart(2, "0") + "m";
}

function ms(v) { return typeof v === "number" ? v.toFixed(1) + " ms" : "-"; }

function pool(inst) {
  const now = inst.kv_bytes, target = inst.kv_target_bytes;
  if (typeof now !== "number") return "-";
  return typeof target === "number" && target !== now ? bytes(now) + " \u2192 " + bytes(target) : bytes(now);
}

function batchLine(b) {
  const done = b.done || 0, total = b.total || 0;
  const fill = el("span");
  fill.style.width = (total ? Math.min(100, 100 * done / total) : 0).toFixed(1) + "%";
  const why = b.state === "preempted" && b.preempted_by ? " (" + b.preempted_by + ")" : "";
  return el("p", {class: "batch", "data-batch-state": b.state},
    "batch: " + b.state + why + "  ", el("span", {class: "progress"}, fill),
    "  " + done + "/" + total + " done" + (b.errors ? " (" + b.errors + " errors)" : "") +
    ", " + (b.tokens_per_s || 0).toFixed(1) + " tok/s, ETA " + (b.eta_s == null ? "-" : duration(b.eta_s)) +
    ", " + (b.preemptions || 0) + " preemptions");
}

function renderServices(doc) {
  const root = document.getElementById("services");
  const out = [];
  for (const svc of doc.services || []) {
    out.push(el("h2", {}, "Service " + svc.name + "  ",
      el("span", {class: "pill " + (svc.ready ? "on" : "off")}, svc.ready ? "serving" : "no ready primary"),
      svc.queued ? "  " + svc.queued + " queued" : ""));
    if (svc.state) out.push(el("p", {class: "warn"}, svc.state));
    if (svc.batch) out.push(batchLine(svc.batch));
    const head = el("tr", {}, ...["instance", "role", "ready", "pid", "node", "KV pool", "weights", "uptime",
      "in flight", "probe", "url"].map(h => el("th", {}, h)));
    const rows = (svc.instances || []).map(i => el("tr", {"data-instance": i.name, "data-role": i.role,
        "data-ready": String(!!i.ready), "data-pid": String(i.pid || "")},
      el("td", {}, i.name),
      el("td", {}, el("span", {class: "pill role-" + i.role}, i.role)),
      el("td", {}, el("span", {class: "pill ready-" + (i.ready ? "yes" : "no")}, i.ready ? "ready" : "not ready")),
      el("td", {}, i.pid || "-"), el("td", {}, i.node || doc.node), el("td", {}, pool(i)),
      el("td", {}, i.weights_source || "-"), el("td", {}, duration(i.uptime_s)),
      el("td", {}, i.inflight), el("td", {}, ms(i.probe_latency_ms)), el("td", {}, i.url)));
    out.push(el("table", {class: "instances", "data-service": svc.name}, el("thead", {}, head), el("tbody", {}, ...rows)));
  }
  root.replaceChildren(...out);
}

function renderNode(doc) {
  const sup = doc.supervisor;
  const rows = [["node", doc.node]];
  if (!sup) rows.push(["supervisor", "none: a standalone router (it did not start the engines)"]);
  else {
    const d = sup.daemon || {}, z = sup.zygote || {};
    rows.push(["supervisor", "pid " + sup.pid + ", up " + duration(sup.uptime_s) + ", launch " + sup.launch]);
    rows.push(["cache daemon", (d.ready ? "ready (weights resident)" : "NOT READY") + ", " +
      (d.managed ? "managed" : "external") + ", pid " + (d.pid || "-") + ", " + (d.restarts || 0) + " restarts"]);
    rows.push(["zygote", (z.pid ? "running, pid " + z.pid : "not running") + ", " + (z.restarts || 0) + " restarts"]);
    for (const [svc, why] of Object.entries(sup.failed || {})) rows.push(["FAILED " + svc, why]);
    for (const s of sup.slots || []) {
      rows.push(["slot " + s.slot, s.state + ", " + s.launches + " launches" +
        (s.last_relaunch_ms != null ? ", last relaunch " + ms(s.last_relaunch_ms) : "")]);
    }
  }
  document.querySelector("#node-table tbody").replaceChildren(
    ...rows.map(([k, v]) => el("tr", {"data-key": k}, el("th", {}, k), el("td", {}, v))));
}

function bar(f) {
  // from the old primary's last good response (-detect_ms) to the latest point known
  const points = [f.switch_ms, f.first_ok_ms, f.relaunch_ready_ms].filter(v => typeof v === "number");
  const start = -f.detect_ms, end = Math.max(0, ...points), span = Math.max(end - start, 1);
  const seg = (cls, a, b) => {
    const s = el("span", {class: cls});
    s.style.left = (100 * (a - start) / span).toFixed(2) + "%";
    s.style.width = Math.max(0.5, 100 * (b - a) / span).toFixed(2) + "%";
    return s;
  };
  const parts = [seg("b-detect", start, 0)];
  if (typeof f.switch_ms === "number") parts.push(seg("b-switch", 0, f.switch_ms));
  if (typeof f.first_ok_ms === "number") parts.push(seg("b-first", f.switch_ms || 0, f.first_ok_ms));
  if (typeof f.relaunch_ready_ms === "number") parts.push(seg("b-relaunch", Math.max(f.first_ok_ms || 0, 0), f.relaunch_ready_ms));
  return el("div", {class: "bar", title: "red: detect, amber: switch, blue: first good response, green: relaunch"}, ...parts);
}

function renderTimeline(doc) {
  const rows = (doc.timeline || []).map(f => el("tr", {"data-old": f.old, "data-new": f.new || ""},
    el("td", {}, new Date(f.at * 1000).toLocaleTimeString()), el("td", {}, f.service),
    el("td", {}, f.old + " \u2192 " + (f.new || "?")), el("td", {}, f.reason),
    el("td", {}, ms(f.detect_ms)), el("td", {}, ms(f.switch_ms)), el("td", {}, ms(f.first_ok_ms)),
    el("td", {}, ms(f.blackout_ms)), el("td", {}, ms(f.relaunch_ready_ms)), el("td", {}, bar(f))));
  document.querySelector("#timeline tbody").replaceChildren(...rows);
}

function render(doc) {
  document.getElementById("node").textContent = doc.node ? "on " + doc.node : "";
  renderServices(doc);
  renderNode(doc);
  renderTimeline(doc);
  document.getElementById("updated").textContent = "updated " + new Date(doc.now * 1000).toLocaleTimeString();
  document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
}

function connect() {
  const live = document.getElementById("live");
  const source = new EventSource("/status/events");
  source.addEventListener("status", e => {
    live.textContent = "live";
    live.className = "pill on";
    render(JSON.parse(e.data));
  });
  source.onerror = () => {
    live.textContent = "disconnected, retrying";
    live.className = "pill off";
    if (source.readyState === EventSource.CLOSED) {
      // refused (logged out, router restarted with a new token): back to the login form
      setTimeout(() => location.reload(), 2000);
    }
  };
}

document.addEventListener("DOMContentLoaded", connect);
