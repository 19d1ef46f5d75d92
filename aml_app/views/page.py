"""The operator web view without the worker: the page itself and the checking of query parameters.

The page is one self-contained HTML document (inline CSS and JS, no external URL of any kind, so it
works offline and under a `default-src 'none'` content security policy). It reads `watermarks.json`
every second and updates the tables in place; it shows "recovering" while the worker says so, and says
when the worker stops answering instead of showing old numbers as current. Every value is written with
`textContent`, never as HTML.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

#: Headers of the page: nothing may be loaded from anywhere but this worker.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


class BadQuery(ValueError):
    """A query parameter this view does not accept; the message is the sentence of the 400 answer."""


def check_query(query: Mapping[str, str], allowed: Collection[str], repeated: Sequence[str] = ()) -> None:
    """Refuse any parameter not in `allowed`, and any given more than once (`repeated` lists those)."""
    for name in query:
        if name not in allowed:
            accepts = f"accepts only {', '.join(sorted(allowed))}" if allowed else "takes no query parameter"
            raise BadQuery(f"unknown query parameter {name!r}: this view {accepts}.")
    for name in repeated:
        raise BadQuery(f"query parameter {name!r} is given more than once; give it once.")


def parse_partitions(raw: str, known: Collection[int]) -> list[int]:
    """`partition=0,2` -> [0, 2]: whole numbers, each a partition of the topic."""
    chosen: list[int] = []
    for item in raw.split(","):
        item = item.strip()
        if not (item.isascii() and item.isdigit()):
            raise BadQuery(
                f"partition={raw!r} is not a comma-separated list of partition numbers such as 0,2."
            )
        p = int(item)
        if known and p not in known:
            raise BadQuery(
                f"partition {p} is not a partition of the topic (it has {min(known)}..{max(known)})."
            )
        if p not in chosen:
            chosen.append(p)
    return chosen


PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Freshness gate</title>
<style>
  :root { --ok: #1b7f3b; --lag: #a65f00; --stall: #b3261e; --unk: #5b4a9e; --err: #7a1f1f;
          --line: #d8dce3; --muted: #5f6673; --bg: #f6f7f9; --held: #fff1c7; }
  * { box-sizing: border-box; }
  body { margin: 0; font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
         color: #1d2129; background: var(--bg); }
  header { display: flex; align-items: baseline; gap: 18px; padding: 10px 20px; background: #1f2a37;
           color: #fff; flex-wrap: wrap; }
  header h1 { font-size: 18px; margin: 0; font-weight: 600; }
  header .meta { color: #c9d1dc; }
  header .meta b { color: #fff; font-weight: 600; }
  header .live { margin-left: auto; color: #c9d1dc; }
  header .live.down { color: #ffb4ab; font-weight: 600; }
  main { padding: 12px 20px 20px; }
  .banner { padding: 10px 14px; border-radius: 6px; margin-bottom: 12px; font-size: 15px;
            border: 1px solid var(--line); background: #fff; }
  .banner.good { border-left: 6px solid var(--ok); }
  .banner.warn { border-left: 6px solid var(--lag); background: #fffaf0; }
  .banner.bad { border-left: 6px solid var(--stall); background: #fff5f4; }
  .banner.info { border-left: 6px solid #3a6ea5; background: #f3f8fd; }
  section { background: #fff; border: 1px solid var(--line); border-radius: 6px; margin-bottom: 12px; }
  section h2 { font-size: 14px; color: #2b3340; margin: 0; padding: 8px 12px;
               border-bottom: 1px solid var(--line); }
  section h2 .hint { font-weight: 400; color: var(--muted); font-size: 13px; margin-left: 8px; }
  table { border-collapse: collapse; width: 100%; }
  th, td { padding: 5px 10px; text-align: right; border-bottom: 1px solid #eef0f3; white-space: nowrap;
           font-variant-numeric: tabular-nums; }
  th { font-size: 12px; color: var(--muted); font-weight: 600; background: #fafbfc; white-space: normal;
       vertical-align: bottom; }
  th.l, td.l { text-align: left; }
  td.detail { white-space: normal; text-align: left; color: #333a45; }
  tr:last-child td { border-bottom: 0; }
  tr.held td { background: #fffdf3; }
  td.bn { background: var(--held) !important; font-weight: 700; box-shadow: inset 3px 0 0 var(--lag); }
  td.bn::after { content: " \\25C0"; color: var(--lag); font-size: 11px; }
  .muted { color: var(--muted); }
  .badge { display: inline-block; min-width: 92px; text-align: center; padding: 1px 8px; border-radius: 10px;
           font-weight: 600; font-size: 12px; color: #fff; }
  .s-ok { background: var(--ok); } .s-lagging { background: var(--lag); }
  .s-stalled { background: var(--stall); } .s-unknown-group { background: var(--unk); }
  .s-error { background: var(--err); }
  .grid { display: grid; grid-template-columns: repeat(4, minmax(0, 1fr)); }
  .grid div { padding: 8px 12px; border-right: 1px solid #eef0f3; }
  .grid div:last-child { border-right: 0; }
  .grid .k { font-size: 12px; color: var(--muted); display: block; }
  .grid .v { font-size: 15px; font-weight: 600; overflow-wrap: anywhere; }
  .stale { opacity: .45; }
  .hidden { display: none; }
  footer { color: var(--muted); font-size: 12px; }
  code { font-size: 12px; }
</style>
</head>
<body data-refreshes="0">
<header>
  <h1>Freshness gate</h1>
  <span class="meta">service <b id="service">…</b></span>
  <span class="meta">group <b id="app_id">…</b></span>
  <span class="meta">topic <b id="topic">…</b></span>
  <span class="meta">worker <b id="worker">…</b> <span id="role"></span></span>
  <span class="live" id="live">connecting…</span>
</header>
<main>
  <div class="banner info" id="banner" role="status" aria-live="polite">Loading the watermark table…</div>
  <div id="tables">
    <section id="retrying-section" class="hidden">
      <h2>Retrying<span class="hint">payments whose handler or decision keeps failing: retried with
        backoff, never skipped; nothing behind them on their partition is committed</span></h2>
      <table id="retrying">
        <thead><tr><th>Partition</th><th>Offset</th><th>Payments</th><th>Attempts</th>
          <th>Since</th><th class="l">Worker</th><th class="l">Last error</th></tr></thead>
        <tbody></tbody>
      </table>
    </section>
    <section>
      <h2>Dependencies<span class="hint">the consumer groups whose commits open the gate</span></h2>
      <table id="deps">
        <thead><tr><th class="l">Group</th><th class="l">Status</th><th>Lag (records)</th>
          <th>Last advance</th><th class="l">Stalled on</th><th class="l">Holding back</th>
          <th class="l">Why</th></tr></thead>
        <tbody></tbody>
      </table>
    </section>
    <section>
      <h2>Partitions<span class="hint">watermark W(p) = lowest committed offset of the dependencies;
        payment (p, o) waits while o &ge; W(p)</span></h2>
      <table id="parts">
        <thead><tr id="parts-head"></tr></thead>
        <tbody></tbody>
      </table>
    </section>
    <section>
      <h2>Gate</h2>
      <div class="grid" id="gate">
        <div><span class="k">Refresh age (newest row)</span>
          <span class="v" data-field="refresh_age_s">…</span></div>
        <div><span class="k">Last admin error</span>
          <span class="v" data-field="admin_error">…</span></div>
        <div><span class="k">Stall after / lag warning</span>
          <span class="v" data-field="limits">…</span></div>
        <div><span class="k">This worker: handled / dead-lettered</span>
          <span class="v" data-field="worker_counts">…</span></div>
        <div><span class="k">Event-time cut (payments before it pass)</span>
          <span class="v" data-field="cut">…</span></div>
      </div>
    </section>
  </div>
  <footer>Same data as <code>watermarks.json</code>; metrics at <code>/metrics</code>.
    Refreshed every second without reloading the page.</footer>
</main>
<script>
"use strict";
const view = { refreshes: 0, failures: 0, last: null, error: null, downSince: null };
window.gateView = view;
const $ = (id) => document.getElementById(id);
const text = (v) => (v === null || v === undefined ? "\\u2014" : String(v));

function el(tag, attrs, content) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else node.setAttribute(k, v);
  }
  if (content !== undefined) node.textContent = text(content);
  return node;
}

function clock(t) {
  return t === null || t === undefined ? "" : new Date(t * 1000).toLocaleTimeString();
}

function ago(t, now) {
  if (t === null || t === undefined) return "\\u2014";
  const s = Math.max(0, now - t);
  if (s < 10) return s.toFixed(1) + " s ago";
  if (s < 120) return Math.round(s) + " s ago";
  if (s < 7200) return Math.floor(s / 60) + " min " + Math.round(s % 60) + " s ago";
  return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min ago";
}

function badge(status) {
  return el("span", { class: "badge s-" + status.replace(/ /g, "-") }, status);
}

function setBanner(kind, message) {
  const b = $("banner");
  b.className = "banner " + kind;
  b.textContent = message;
}

function summary(data) {
  const parts = data.partitions, deps = data.dependencies, gate = data.gate;
  const failing = data.refresh && data.refresh.last_error;
  if (!parts.length) {
    return failing ? ["bad", "Offset refresh failing: " + failing + ". No watermark yet."]
      : ["info", "No watermark yet: waiting for the leader's first refresh."];
  }
  if (gate.admin_error) {
    return ["bad", "Offset refresh failing: " + gate.admin_error +
      ". Watermarks hold their last known values."];
  }
  // A row the gate distrusts closes it whatever the dependencies do: say so before blaming them.
  const cutNow = data.cut;
  if (data.gate_mode === "event-time" && cutNow && cutNow.untrusted) {
    return ["bad", "The gate admits nothing: its event-time cut is not trusted (" + cutNow.untrusted + ")."];
  }
  if (data.gate_mode === "event-time" && cutNow && cutNow.unread && cutNow.unread.length) {
    return ["bad", "The gate admits nothing: the event-time cut could not read partition" +
      (cutNow.unread.length > 1 ? "s " : " ") + cutNow.unread.join(", ") + "."];
  }
  const distrusted = parts.filter((p) => p.untrusted);
  if (distrusted.length) {
    return ["bad", "The gate stays closed on partition" + (distrusted.length > 1 ? "s " : " ") +
      distrusted.map((p) => p.partition).join(", ") + ", whatever its watermark: " +
      distrusted[0].untrusted + "."];
  }
  if (gate.breached_partitions && gate.breached_partitions.length) {
    return ["bad", "Breached: payments have waited longer than AML_MAX_WAIT (" + gate.max_wait_s +
      " s) on partition" + (gate.breached_partitions.length > 1 ? "s " : " ") +
      gate.breached_partitions.join(", ") + ", the longest " + Math.round(gate.longest_wait_s) + " s."];
  }
  const held = parts.filter((p) => p.waiting_offset !== null);
  const bad = deps.filter((d) => d.status !== "ok");
  const who = bad.map((d) => d.group + " (" + d.status + ")").join(", ");
  const cut = data.cut;
  const onCut = held.filter((p) => p.waiting_offset < p.watermark);
  if (data.gate_mode === "event-time" && cut && cut.held_by !== null && onCut.length) {
    return ["warn", "Waiting for partition " + cut.held_by + "'s dependencies to apply payments up to " +
      cut.frontier_at + " (event-time gate): payments wait on partition" + (onCut.length > 1 ? "s " : " ") +
      onCut.map((p) => p.partition).join(", ") + "."];
  }
  if (held.length) {
    const blocking = new Set();
    held.forEach((p) => p.bottleneck.forEach((g) => blocking.add(g)));
    const waits = gate.payments_waiting === null ? "" : ", " + gate.payments_waiting + " payments held back";
    const names = [...blocking].map((g) => {
      const d = deps.find((x) => x.group === g);
      return d ? g + " (" + d.status + ")" : g;
    }).join(", ");
    return [bad.some((d) => d.status === "stalled" || d.status === "unknown group") ? "bad" : "warn",
      "Waiting on " + names + ": payments wait on partition" + (held.length > 1 ? "s " : " ") +
      held.map((p) => p.partition).join(", ") + waits + "."];
  }
  if (bad.length) return ["warn", "Nothing waits right now, but: " + who + "."];
  return ["good", "Nothing waits: every partition's next payment is open. All dependencies ok."];
}

function renderDeps(data) {
  const now = data.generated_at;
  const rows = data.dependencies.map((d) => {
    const tr = el("tr", { "data-group": d.group });
    tr.append(el("td", { class: "l", "data-field": "group" }, d.group));
    const st = el("td", { class: "l", "data-field": "status" });
    st.append(badge(d.status));
    tr.append(st);
    tr.append(el("td", { "data-field": "lag" }, d.lag));
    tr.append(el("td", { "data-field": "last_advance", title: clock(d.last_advance) },
      ago(d.last_advance, now)));
    tr.append(el("td", { class: "l", "data-field": "stalled_partitions" },
      d.stalled_partitions.length ? d.stalled_partitions.join(", ") : "\\u2014"));
    tr.append(el("td", { class: "l", "data-field": "holding_back" },
      d.holding_back.length ? d.holding_back.join(", ") : "\\u2014"));
    tr.append(el("td", { class: "detail", "data-field": "detail" }, d.detail));
    return tr;
  });
  $("deps").tBodies[0].replaceChildren(...rows);
}

function renderParts(data) {
  const groups = data.depends_on;
  const head = [["Partition", ""], ["Owner", "l"], ["Log end", ""], [data.app_id + " committed", ""],
    ["In flight", ""]];
  groups.forEach((g) => head.push([g, ""]));
  head.push(["Watermark", ""], ["Payments waiting", ""], ["Waiting at offset", ""], ["Blocked since", ""],
    ["Bottleneck", "l"]);
  $("parts-head").replaceChildren(...head.map(([h, c]) => el("th", c ? { class: c } : {}, h)));
  const now = data.generated_at;
  const rows = data.partitions.map((p) => {
    const held = p.waiting_offset !== null || (p.payments_waiting || 0) > 0;
    const tr = el("tr", { "data-partition": String(p.partition), class: held ? "held" : "" });
    tr.append(el("td", { "data-field": "partition" }, p.partition));
    tr.append(el("td", { class: "l muted", "data-field": "local" }, p.local ? "this worker" : "other"));
    tr.append(el("td", { "data-field": "log_end" }, p.log_end));
    tr.append(el("td", { "data-field": "service_committed" }, p.service_committed));
    tr.append(el("td", { "data-field": "in_flight" }, p.in_flight));
    groups.forEach((g) => {
      const isBn = held && p.bottleneck.includes(g);
      const never = p.never_committed.includes(g);
      const cell = el("td", { "data-dep": g, class: isBn ? "bn" : "",
        title: never ? g + " never committed here" : "lag " + text(p.dependency_lag[g]) },
        p.dependencies[g]);
      tr.append(cell);
    });
    tr.append(el("td", { "data-field": "watermark", class: p.untrusted ? "bn" : "",
      title: p.untrusted ? "distrusted: " + p.untrusted : "" }, p.watermark));
    tr.append(el("td", { "data-field": "payments_waiting" }, p.payments_waiting));
    tr.append(el("td", { "data-field": "waiting_offset" }, p.waiting_offset));
    tr.append(el("td", { "data-field": "blocked_since", title: clock(p.blocked_since) },
      ago(p.blocked_since, now)));
    // Where nothing is held back, naming the lowest group would only be noise.
    tr.append(el("td", { class: "l", "data-field": "bottleneck",
      title: held ? "" : "nothing held back here; lowest: " + p.bottleneck.join(", ") },
      held ? p.bottleneck.join(", ") : "\\u2014"));
    return tr;
  });
  $("parts").tBodies[0].replaceChildren(...rows);
}

function renderRetrying(data) {
  const items = data.retrying || [];
  $("retrying-section").classList.toggle("hidden", items.length === 0);
  const now = data.generated_at;
  const rows = items.map((r) => {
    const tr = el("tr", { "data-partition": String(r.partition) });
    tr.append(el("td", { "data-field": "partition" }, r.partition));
    tr.append(el("td", { "data-field": "offset" }, r.offset));
    tr.append(el("td", { "data-field": "payments" }, r.payments));
    tr.append(el("td", { "data-field": "attempts" }, r.attempts));
    tr.append(el("td", { "data-field": "since", title: clock(r.since) }, ago(r.since, now)));
    tr.append(el("td", { class: "l", "data-field": "worker" }, r.worker));
    tr.append(el("td", { class: "detail", "data-field": "error" }, r.error));
    return tr;
  });
  $("retrying").tBodies[0].replaceChildren(...rows);
}

function renderGate(data) {
  const g = data.gate;
  const set = (f, v) => { document.querySelector('#gate [data-field="' + f + '"]').textContent = v; };
  set("refresh_age_s", g.refresh_age_s === null ? "\\u2014" : g.refresh_age_s.toFixed(1) + " s");
  set("admin_error", g.admin_error ? g.admin_error + " (" + clock(g.admin_error_at) + ")" : "none");
  set("limits", g.stall_after_s + " s / " + g.lag_warn + " records");
  set("worker_counts", data.payments_handled + " / " + data.dead_lettered);
  const cut = data.cut;
  let text = "per-partition gate";
  if (data.gate_mode === "event-time") {
    if (!cut) text = "not read yet";
    else if (cut.untrusted) text = "closed: " + cut.untrusted;
    else if (cut.frontier_at === null) text = "every partition applied to its end";
    else text = cut.frontier_at + " (partition " + cut.held_by + ")";
  }
  set("cut", text);
}

function render(data) {
  $("service").textContent = data.service;
  $("app_id").textContent = data.app_id;
  $("topic").textContent = data.topic;
  $("worker").textContent = data.worker;
  $("role").textContent = data.is_leader ? "(leader)" : "";
  $("tables").classList.remove("stale");
  if (data.recovering) {
    $("tables").classList.add("hidden");
    setBanner("info", "Recovering: this worker is still reading its tables, so it shows no numbers yet.");
    return;
  }
  $("tables").classList.remove("hidden");
  renderRetrying(data);
  renderDeps(data);
  renderParts(data);
  renderGate(data);
  const [kind, message] = summary(data);
  const retrying = data.retrying || [];
  if (retrying.length) {
    const where = retrying.map((r) => r.partition + ":" + r.offset).join(", ");
    setBanner("bad", "Retrying a failing payment at " + where + " (" + retrying[0].error + "). " + message);
  } else {
    setBanner(kind, message);
  }
}

async function tick() {
  try {
    // A deadline: a worker that takes the request and never answers must not leave old numbers live.
    const response = await fetch("../watermarks.json",
      { cache: "no-store", signal: AbortSignal.timeout(5000) });
    if (!response.ok) throw new Error("HTTP " + response.status);
    const data = await response.json();
    render(data);
    view.last = data;
    view.error = null;
    view.downSince = null;
    view.refreshes += 1;
    document.body.dataset.refreshes = String(view.refreshes);
    document.body.dataset.generatedAt = String(data.generated_at);
    $("live").className = "live";
    $("live").textContent = "live \\u00b7 updated " + clock(data.generated_at);
  } catch (err) {
    view.failures += 1;
    view.error = String(err);
    if (view.downSince === null) view.downSince = Date.now() / 1000;
    $("live").className = "live down";
    $("live").textContent = "worker not answering since " + clock(view.downSince);
    $("tables").classList.add("stale");
    setBanner("bad", "This worker does not answer (" + err + "): the numbers below are old.");
  } finally {
    setTimeout(tick, 1000);
  }
}
window.render = render;
tick();
</script>
</body>
</html>
"""
