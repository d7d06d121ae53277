// The live cluster page: reads this node's JSON routes every second (the
// load and events every two, the entity types every ten) and shows them. Every figure comes from those routes; nothing is fetched
// from anywhere else.
"use strict";

const EVERY_MS = 1000;
// The load asks every member: every two seconds is enough for a person
// and halves what the page costs the cluster. The events come with it.
const LOAD_EVERY_MS = 2000;
// A read that takes longer is given up, and the page says its data is old.
const READ_TIMEOUT_MS = 3000;
const MAX_CHANGES = 200;
const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"];

let previous = null;   // the last view read: members and shard owners
let lastRead = null;   // when the last full read succeeded
let shownKey = null;   // what the tables show now: drawn again only when it changes
let lastView = null;   // the last members and shards read (the load loop draws on it)
let loadStarted = false; // the load loop starts with the first members read
const colours = new Map();

function colour(node) {
  if (!colours.has(node)) colours.set(node, PALETTE[colours.size % PALETTE.length]);
  return colours.get(node);
}

// The endpoint's bearer token, if it has one: from `#token=…` in the
// page's address (a fragment is never sent to the server; it is taken out
// of the address bar at once), or typed into the form the page shows when
// a read is refused. Kept for this tab only.
const TOKEN_KEY = "datum-management-token";
(function takeTokenFromAddress() {
  const match = /(?:^#|&)token=([^&]*)/.exec(location.hash);
  if (match) {
    let token = match[1];
    try {
      token = decodeURIComponent(token);
    } catch (_) {
      // Not percent-encoded after all: taken as written.
    }
    sessionStorage.setItem(TOKEN_KEY, token);
    history.replaceState(null, "", location.pathname + location.search);
  }
})();

let refused = false; // the last read was refused for want of the token

function askForToken() {
  refused = true;
  const form = document.getElementById("token-form");
  if (!form.hidden) return;
  form.hidden = false;
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, document.getElementById("token").value.trim());
    form.hidden = true;
    document.getElementById("freshness").focus();
    tick(false); // read at once, not at the next second
  }, { once: true });
  document.getElementById("token").focus();
}

// RFC 6750's characters of a bearer token.
const TOKEN_CHARS = /^[A-Za-z0-9\-._~+/]+=*$/;

// Paths are relative, so the page also works behind a proxy's path prefix.
async function json(path) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token && !TOKEN_CHARS.test(token)) {
    sessionStorage.removeItem(TOKEN_KEY);
    askForToken();
    throw new Error("that token holds characters a token cannot");
  }
  const response = await fetch(path, {
    cache: "no-store",
    credentials: "same-origin",
    headers: token ? { Authorization: "Bearer " + token } : {},
    signal: AbortSignal.timeout(READ_TIMEOUT_MS),
  });
  if (response.status === 401) askForToken();
  else refused = false;
  if (!response.ok) {
    const error = new Error(path + " answered " + response.status);
    error.status = response.status;
    throw error;
  }
  return response.json();
}

// An element; `background` is set through the CSSOM (the page's policy
// allows no inline style attribute).
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null) continue;
    if (k === "background") node.style.background = v;
    else node.setAttribute(k, v);
  }
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

// A member's address, without its node id and incarnation.
function short(node) {
  return node.split("#")[0];
}

function clock(date) {
  return date.toLocaleTimeString([], { hour12: false });
}

// How long a member has been up, to the minute past its first minute.
function upFor(incarnationMicros) {
  const seconds = Math.max(0, Math.floor((Date.now() - incarnationMicros / 1000) / 1000));
  const d = Math.floor(seconds / 86400), h = Math.floor((seconds % 86400) / 3600), m = Math.floor((seconds % 3600) / 60);
  return d > 0 ? `${d} d ${h} h` : h > 0 ? `${h} h ${m} min` : m > 0 ? `${m} min` : `${seconds} s`;
}

// The entity types registered on the node change rarely: read again every
// ten seconds (a type registered since shows within that).
const TYPES_EVERY_MS = 10 * 1000;
let types = null;
let typesRead = 0;

async function read() {
  const members = await json("cluster/members");
  if (types === null || Date.now() - typesRead >= TYPES_EVERY_MS) {
    try {
      types = (await json("cluster/shards")).types;
    } catch (error) {
      if (error.status !== 404) throw error;
      types = []; // a node without a sharded system
    }
    typesRead = Date.now();
  }
  const shards = {};
  for (const type of types) {
    shards[type] = await json("cluster/shards/" + encodeURIComponent(type));
  }
  return { members, shards };
}

// ---- Load: every member's counts by entity type, kept for the last five
// minutes as cumulative samples; the figures are the differences between
// two samples, summed over the types both have counts of.

const KEEP_MS = 5 * 60 * 1000;
const NOW_WINDOW_MS = 10 * 1000;
// node -> [{ t, bounds, types: { type: { answered: [..], failed: {kind: n}, entities } } }]
const samples = new Map();

// One member's sample from the types' answers: null when no type's answer
// has counts of it (it did not answer, has no region, or its build counts
// nothing).
function sampleOf(loads, node) {
  let sample = null;
  for (const [type, load] of Object.entries(loads)) {
    const m = load.members.find((x) => x.node === node);
    if (!m || !m.answered) continue;
    if (!sample) sample = { t: load.read_at_ms, bounds: load.bounds, types: {} };
    sample.types[type] = { answered: m.answered, failed: m.failed || {}, entities: m.live_entities || 0 };
  }
  return sample;
}

function keepSamples(loads) {
  const nodes = new Set();
  for (const load of Object.values(loads)) for (const m of load.members) nodes.add(m.node);
  for (const node of nodes) {
    const sample = sampleOf(loads, node);
    if (!sample) continue;
    const kept = samples.get(node) || [];
    kept.push(sample);
    while (kept.length && kept[0].t < sample.t - KEEP_MS) kept.shift();
    samples.set(node, kept);
  }
}

function sum(xs) {
  return xs.reduce((a, b) => a + b, 0);
}

function entitiesOf(sample) {
  return sum(Object.values(sample.types).map((c) => c.entities));
}

// What happened between samples `a` and `b`: the asks answered by latency
// bucket and failed by kind, over the types both have counts of. A type
// whose counts went down (its region restarted, counting from 0 again) is
// left out, as is one that came or went in between.
function diff(a, b) {
  const buckets = b.bounds.length + 1;
  const answered = new Array(buckets).fill(0);
  const failed = {};
  for (const [type, now] of Object.entries(b.types)) {
    const then = a.types[type];
    // (Counts of another shape, from another build, are left out.)
    if (!then || now.answered.length !== buckets || then.answered.length !== buckets) continue;
    const d = now.answered.map((n, i) => n - (then.answered[i] || 0));
    const df = Object.entries(now.failed).map(([kind, n]) => [kind, n - (then.failed[kind] || 0)]);
    const lost = Object.keys(then.failed).some((kind) => !(kind in now.failed));
    if (lost || d.some((n) => n < 0) || df.some(([, n]) => n < 0)) continue;
    d.forEach((n, i) => { answered[i] += n; });
    for (const [kind, n] of df) if (n > 0) failed[kind] = (failed[kind] || 0) + n;
  }
  return { answered, failed, bounds: b.bounds, seconds: (b.t - a.t) / 1000 };
}

function asksPerSecond(d) {
  return d.seconds > 0 ? (sum(d.answered) + sum(Object.values(d.failed))) / d.seconds : null;
}

// The latency below which fraction `q` of the asks of a difference fell:
// a bucket's upper bound (Infinity above the last); null with none.
function quantile(d, q) {
  const total = sum(d.answered);
  if (total <= 0) return null;
  let seen = 0;
  for (let i = 0; i < d.answered.length; i++) {
    seen += d.answered[i];
    if (seen >= q * total) return i < d.bounds.length ? d.bounds[i] : Infinity;
  }
  return Infinity;
}

function seconds(s) {
  if (s === null) return "—";
  if (s === Infinity) return "> 10 s";
  if (s < 1e-3) return "≤ " + +(s * 1e6).toPrecision(3) + " µs";
  if (s < 1) return "≤ " + +(s * 1e3).toPrecision(3) + " ms";
  return "≤ " + +s.toPrecision(3) + " s";
}

// The sample at least `ms` before the newest (or the oldest kept).
function sampleBefore(kept, ms) {
  const newest = kept[kept.length - 1];
  for (let i = kept.length - 2; i >= 0; i--) if (kept[i].t <= newest.t - ms) return kept[i];
  return kept.length > 1 ? kept[0] : null;
}

// Per pair of consecutive samples: asks/s, p99 and failures/s.
function series(kept) {
  const points = [];
  for (let i = 1; i < kept.length; i++) {
    const d = diff(kept[i - 1], kept[i]);
    if (d.seconds <= 0) continue;
    points.push({
      t: kept[i].t,
      asks: asksPerSecond(d),
      p99: quantile(d, 0.99),
      failures: sum(Object.values(d.failed)) / d.seconds,
      entities: entitiesOf(kept[i]),
    });
  }
  return points;
}

// A small chart over the last five minutes: an SVG image whose accessible
// name says its range; drawn again in place (`drawSpark`).
const SPARK_WIDTH = 120, SPARK_HEIGHT = 28;

function sparkline() {
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("viewBox", `0 0 ${SPARK_WIDTH} ${SPARK_HEIGHT}`);
  svg.setAttribute("class", "spark");
  svg.setAttribute("role", "img");
  svg.append(document.createElementNS("http://www.w3.org/2000/svg", "path"));
  return svg;
}

// Draws `pick` of `points` into a chart made by `sparkline`: a point
// without a value leaves a gap; one off the scale (a latency above 10 s)
// is drawn at the top.
function drawSpark(svg, points, pick, label, format) {
  const values = points.map(pick).filter((v) => v !== null && Number.isFinite(v));
  const max = values.length ? Math.max(...values) : 0;
  const top = 1, bottom = SPARK_HEIGHT - 1;
  const offScale = points.some((p) => pick(p) === Infinity) ? " (some above the scale)" : "";
  svg.setAttribute("aria-label", offScale && !values.length
    ? `${label}: above the scale`
    : values.length
    ? `${label} over the last ${Math.round((points[points.length - 1].t - points[0].t) / 1000)} s: from ${format(Math.min(...values))} to ${format(max)}${offScale}`
    : `${label}: nothing read yet`);
  let d = "";
  if (points.length > 1) {
    const t0 = points[0].t, span = Math.max(1, points[points.length - 1].t - t0);
    let pen = "M";
    for (const p of points) {
      const v = pick(p);
      if (v === null || Number.isNaN(v)) { pen = "M"; continue; }
      const y = v === Infinity ? top : bottom - (max > 0 ? (v / max) * (bottom - top) : 0);
      const x = (p.t - t0) / span * (SPARK_WIDTH - 2) + 1;
      // (A point alone between gaps is drawn as a dot.)
      d += pen === "M" ? `M${x.toFixed(1)},${y.toFixed(1)} h0.01 ` : `L${x.toFixed(1)},${y.toFixed(1)} `;
      pen = "L";
    }
  }
  svg.firstChild.setAttribute("d", d.trim());
}

// Why a member's load row shows no figures, or null when it has them.
function noFigures(m, loads, silent) {
  if (sampleOf(loads, m.node)) return null;
  if (silent.has(m.node)) return "no answer to this read: unreachable or slow (no figure shown as current)";
  return ["Joining", "Up", "Leaving"].includes(m.status)
    ? "no counts: it has no region of these types, or its build counts no asks"
    : `not asked: it is ${m.status}`;
}

// The load table's rows: built again only when the members or which of
// them have figures change; their figures and charts are set in place.
let loadRowsKey = null;
const loadCells = new Map(); // node -> the cells and charts of its row

function renderLoad(view, loads) {
  const body = document.querySelector("#load tbody");
  const silent = new Set();
  for (const load of Object.values(loads)) for (const n of load.no_answer) silent.add(n);
  const none = Object.keys(loads).length === 0;
  const rows = view.members.members.map((m) => [m, none ? null : noFigures(m, loads, silent)]);
  const key = JSON.stringify([none, rows.map(([m, why]) => [m.node, m.addr, why])]);
  if (key !== loadRowsKey) {
    loadRowsKey = key;
    loadCells.clear();
    body.replaceChildren();
    if (none) {
      body.append(el("tr", {}, el("td", { colspan: "6" }, "No entity type is registered on this node.")));
      return;
    }
    for (const [m, why] of rows) {
      const head = el("th", { scope: "row", title: m.node }, el("span", { class: "cell swatch", background: colour(m.node), "aria-hidden": "true" }), " ", m.addr);
      if (why) {
        body.append(el("tr", { "data-node": m.node, "data-answered": "" }, head, el("td", { colspan: "5", class: silent.has(m.node) ? "bad" : "" }, why)));
        continue;
      }
      const cells = {
        entities: el("span"), rate: el("span"), p50: el("td"), p99: el("span"), failed: el("span"),
        entitiesChart: sparkline(), asksChart: sparkline(), p99Chart: sparkline(), failuresChart: sparkline(),
      };
      cells.failedCell = el("td", {}, cells.failed, " ", cells.failuresChart);
      cells.row = el("tr", { "data-node": m.node },
        head,
        el("td", {}, cells.entities, " ", cells.entitiesChart),
        el("td", {}, cells.rate, " ", cells.asksChart),
        cells.p50,
        el("td", {}, cells.p99, " ", cells.p99Chart),
        cells.failedCell);
      body.append(cells.row);
      loadCells.set(m.node, cells);
    }
  }
  const fmtRate = (v) => v === null ? "—" : v >= 100 ? Math.round(v).toString() : v.toFixed(1);
  for (const [node, cells] of loadCells) {
    const kept = samples.get(node) || [];
    const newest = kept[kept.length - 1];
    if (!newest) continue;
    const before = sampleBefore(kept, NOW_WINDOW_MS);
    const lately = before ? diff(before, newest) : null;
    const points = series(kept);
    const rate = lately ? asksPerSecond(lately) : null;
    const minuteAgo = sampleBefore(kept, 60 * 1000);
    const failedLately = minuteAgo
      ? Object.entries(diff(minuteAgo, newest).failed).map(([kind, n]) => `${kind} ${n}`)
      : [];
    const entities = entitiesOf(newest);
    cells.row.dataset.answered = String(sum(Object.values(newest.types).map((c) => sum(c.answered))));
    cells.row.dataset.rate = rate === null ? "" : String(rate);
    const median = lately ? quantile(lately, 0.5) : null;
    cells.row.dataset.p50 = median === null ? "" : String(median);
    cells.entities.textContent = String(entities);
    cells.rate.textContent = fmtRate(rate);
    cells.p50.textContent = seconds(median);
    cells.p99.textContent = seconds(lately ? quantile(lately, 0.99) : null);
    cells.failed.textContent = failedLately.length ? failedLately.join(", ") : (minuteAgo ? "none" : "—");
    cells.failedCell.className = failedLately.length ? "warn" : "";
    drawSpark(cells.entitiesChart, points, (p) => p.entities, "live entities", String);
    drawSpark(cells.asksChart, points, (p) => p.asks, "asks per second", fmtRate);
    drawSpark(cells.p99Chart, points, (p) => p.p99, "p99 latency", seconds);
    drawSpark(cells.failuresChart, points, (p) => p.failures, "failures per second", fmtRate);
  }
}

// ---- Events: this node's history, asking only for what changed since
// the last read (new events, and older ones others were folded into).

const MAX_EVENTS = 200;
const events_seen = { node: null, last: 0 };

function renderEvents(node, events) {
  const list = document.getElementById("events");
  if (events_seen.node !== node) {
    // A first read, or another incarnation of the node: from scratch.
    list.replaceChildren();
    events_seen.node = node;
    events_seen.last = 0;
  }
  for (const e of events.events) {
    events_seen.last = Math.max(events_seen.last, e.changed);
    const item = eventItem(e);
    const shown = list.querySelector(`li[data-seq="${e.seq}"]`);
    if (shown) {
      shown.replaceWith(item);
      continue;
    }
    // Newest first: before the first one shown that is older.
    const older = [...list.children].find((li) => Number(li.dataset.seq) < e.seq);
    list.insertBefore(item, older || null);
  }
  while (list.children.length > MAX_EVENTS) list.lastChild.remove();
}

function eventItem(e) {
  const at = new Date(e.at_ms);
  const shards = e.shards.length === 0 ? ""
    : ` (shard${e.shards.length === 1 ? "" : "s"} ${e.shards.slice(0, 12).join(", ")}${e.shards.length > 12 ? `, and ${e.shards.length - 12} more` : ""})`;
  return el("li", { "data-seq": String(e.seq), "data-kind": e.kind },
    el("time", { datetime: at.toISOString() }, clock(at)), " ",
    el("span", { class: "kind" }, e.kind.replaceAll("_", " ")), " ",
    e.text, shards, e.count > 1 ? ` ×${e.count}` : "");
}

// A member's roles, as it last answered a load read (null before it did).
const knownRoles = new Map();

function rolesOf(node) {
  return knownRoles.has(node) ? knownRoles.get(node) : null;
}

function renderMembers(view) {
  const { members } = view;
  document.getElementById("cluster-node").textContent = "as seen by " + members.self_node;
  const body = document.querySelector("#members tbody");
  body.replaceChildren();
  for (const m of members.members) {
    const roles = [];
    if (m.node === members.self_node) roles.push("this node");
    if (m.node === members.leader) roles.push("leader");
    if (m.node === members.oldest) roles.push("oldest");
    const statusClass = m.status === "Up" ? "ok" : (m.status === "Down" || m.status === "Removed") ? "bad" : "warn";
    const version = m.app_version ?? "";
    const memberRoles = rolesOf(m.node);
    const row = el("tr", { "data-node": m.node, "data-status": m.status, "data-reachable": String(m.reachable), "data-app-version": version },
      el("th", { scope: "row" }, el("span", { class: "cell swatch", background: colour(m.node), "aria-hidden": "true" }), " ", m.addr),
      el("td", { class: statusClass }, m.status),
      el("td", { class: m.reachable ? "ok" : "bad" }, m.reachable ? "reachable" : "unreachable from this node's view"),
      el("td", {}, upFor(m.incarnation)),
      el("td", {}, version || "not told yet"),
      el("td", { "data-roles": memberRoles === null ? null : memberRoles.join(",") }, memberRoles === null ? "not told yet" : memberRoles.length ? memberRoles.join(", ") : "none"),
      el("td", {}, roles.join(", ")));
    body.append(row);
  }
}

function renderShards(view) {
  const container = document.getElementById("types");
  container.replaceChildren();
  const names = Object.keys(view.shards).sort();
  if (names.length === 0) {
    container.append(el("p", { class: "note" }, "No entity type is registered on this node."));
    return;
  }
  let coordinatorShown = false;
  document.getElementById("coordinator").textContent = "";
  for (const name of names) {
    const t = view.shards[name];
    if (!coordinatorShown && t.coordinator) {
      const c = t.coordinator;
      document.getElementById("coordinator").textContent =
        "Acting coordinator: " + (c.acting || "none yet") + " · epoch " + c.epoch;
      coordinatorShown = true;
    }
    const owners = new Map();
    const byShard = new Map();
    for (const s of t.shards) {
      byShard.set(s.shard, s);
      const o = owners.get(s.owner) || { shards: 0, handingOff: 0 };
      o.shards += 1;
      if (s.handing_off) o.handingOff += 1;
      owners.set(s.owner, o);
    }
    const placed = t.shards.length;
    const section = el("section", { "data-type": t.type, "aria-label": "entity type " + t.type });
    section.append(el("h3", {}, t.type));
    section.append(el("p", { class: "note" },
      `${t.num_shards} shards, ${placed} placed; here: ${t.hosted_shards} hosted, ${t.entities} live entities, ${t.buffered} messages buffered` +
      (t.handing_off.length ? `, handing off ${t.handing_off.length}` : "")));
    const table = el("table", { class: "owners" },
      el("caption", { class: "hidden" }, "Shards of " + t.type + " by node"),
      el("thead", {}, el("tr", {}, el("th", { scope: "col" }, "Node"), el("th", { scope: "col" }, "Shards"), el("th", { scope: "col" }, "Handing off"))));
    const body = el("tbody");
    for (const [owner, o] of [...owners.entries()].sort()) {
      body.append(el("tr", { "data-owner": owner, "data-shards": String(o.shards) },
        el("th", { scope: "row", title: owner }, el("span", { class: "cell swatch", background: colour(owner), "aria-hidden": "true" }), " ", short(owner)),
        el("td", {}, o.shards),
        el("td", {}, o.handingOff)));
    }
    if (placed < t.num_shards) {
      body.append(el("tr", { "data-owner": "", "data-shards": String(t.num_shards - placed) },
        el("th", { scope: "row" }, "not placed yet"), el("td", {}, t.num_shards - placed), el("td", {}, 0)));
    }
    table.append(body);
    section.append(el("div", { class: "scroll" }, table));
    const grid = el("div", { class: "grid", role: "img", "aria-label": `a map of the ${t.num_shards} shards of ${t.type}, coloured by node; the table above lists the same` });
    for (let i = 0; i < t.num_shards; i++) {
      const s = byShard.get(i);
      const title = s ? `shard ${i}: ${short(s.owner)}${s.handing_off ? " (handing off)" : ""}` : `shard ${i}: not placed`;
      grid.append(el("span", { class: "cell", title, background: s ? colour(s.owner) : null }));
    }
    section.append(grid);
    container.append(section);
  }
}

function change(text, at) {
  const list = document.getElementById("changes");
  list.prepend(el("li", {}, el("time", { datetime: at.toISOString() }, clock(at)), " ", text));
  while (list.children.length > MAX_CHANGES) list.lastChild.remove();
}

function compare(before, now, at) {
  const old = new Map(before.members.members.map((m) => [m.node, m]));
  for (const m of now.members.members) {
    const o = old.get(m.node);
    if (!o) change(`${m.addr} joined (${m.status})`, at);
    else {
      if (o.status !== m.status) change(`${m.addr}: ${o.status} → ${m.status}`, at);
      if (o.reachable !== m.reachable) change(`${m.addr} became ${m.reachable ? "reachable" : "unreachable"}`, at);
    }
    old.delete(m.node);
  }
  for (const gone of old.values()) change(`${gone.addr} is gone from the view (removed)`, at);
  for (const [type, t] of Object.entries(now.shards)) {
    const b = before.shards[type];
    if (!b) continue;
    const owner = new Map(b.shards.map((s) => [s.shard, s.owner]));
    const counts = new Map();
    const count = (key) => counts.set(key, (counts.get(key) || 0) + 1);
    for (const s of t.shards) {
      const from = owner.get(s.shard);
      if (from === undefined) count(`placed on ${short(s.owner)}`);
      else if (from !== s.owner) count(`moved ${short(from)} → ${short(s.owner)}`);
      owner.delete(s.shard);
    }
    for (const from of owner.values()) count(`lost their home on ${short(from)}, waiting for a new one`);
    for (const [key, n] of counts) change(`${type}: ${n} shard${n === 1 ? "" : "s"} ${key}`, at);
  }
}

// What the tables show of a view: they are drawn again only when it changes.
function shownOf(view) {
  const m = view.members;
  return {
    self: m.self_node, leader: m.leader, oldest: m.oldest,
    members: m.members.map((x) => [x.node, x.status, x.reachable, upFor(x.incarnation), x.app_version, rolesOf(x.node)]),
    types: Object.values(view.shards).map((t) => [
      t.type, t.num_shards, t.hosted_shards, t.entities, t.buffered, t.handing_off,
      t.coordinator && [t.coordinator.acting, t.coordinator.epoch],
      t.shards.map((s) => [s.shard, s.owner, s.handing_off]),
    ]),
  };
}

// The live line changes only between live and stale (a screen reader
// announces it); the time of the last read is beside it, not announced.
function showFreshness(isStale, text) {
  const status = document.getElementById("freshness");
  const line = isStale ? "Stale:" : "Live.";
  if (status.textContent !== line) status.textContent = line;
  status.className = isStale ? "stale" : "";
  document.getElementById("read-at").textContent = text;
}

// One read and drawing; `again` schedules the next one a second later.
async function tick(again = true) {
  try {
    const view = await read();
    const at = new Date();
    if (previous) compare(previous, view, at);
    // Drawn again only when something shown changed (the browser then
    // lays out nothing most seconds).
    const key = JSON.stringify(shownOf(view));
    if (key !== shownKey) {
      renderMembers(view);
      renderShards(view);
      shownKey = key;
    }
    lastView = view;
    if (!loadStarted) {
      loadStarted = true;
      loadTick(); // at once, with the first members read
    }
    previous = view;
    lastRead = at;
    showFreshness(false, " Read at " + clock(at) + ", every second.");
    document.body.dataset.read = String(at.getTime());
  } catch (error) {
    const why = error.status !== 401
      ? error.message
      : sessionStorage.getItem(TOKEN_KEY)
        ? "the endpoint refused the token"
        : "the endpoint asks for its bearer token";
    stale(why);
  } finally {
    if (again) setTimeout(tick, EVERY_MS);
  }
}

function stale(why) {
  showFreshness(true, lastRead
    ? ` nothing read since ${clock(lastRead)}: what is shown is from then (${why}).`
    : ` nothing read yet (${why}).`);
}

// A read that hangs (a paused or cut-off node) is caught here too, before
// its own timeout ends it: no read for longer than a slow read and two
// pauses between reads.
const STALE_AFTER_MS = READ_TIMEOUT_MS + 2 * EVERY_MS;
setInterval(() => {
  if (!refused && lastRead && Date.now() - lastRead.getTime() > STALE_AFTER_MS) {
    stale(`no answer for over ${STALE_AFTER_MS / 1000} s`);
  }
}, EVERY_MS);

// The load and the events are read on a loop of their own, every two
// seconds: asking every member for its load takes up to the route's two
// seconds when one is silent, and must not hold back the members and
// shards above, read every second.
async function loadTick() {
  try {
    if (refused) {
      showLoadFreshness("the endpoint asks for its bearer token");
    } else if (lastView) {
      const types = Object.keys(lastView.shards);
      const node = lastView.members.self_node;
      const after = events_seen.node === node ? events_seen.last : 0;
      const [answers, events] = await Promise.all([
        Promise.all(types.map((type) => json("cluster/load/" + encodeURIComponent(type)))),
        json("cluster/events?after=" + after),
      ]);
      renderEvents(node, events);
      const loads = {};
      types.forEach((type, i) => { loads[type] = answers[i]; });
      for (const load of answers) for (const m of load.members) if (m.roles) knownRoles.set(m.node, m.roles);
      keepSamples(loads);
      renderLoad(lastView, loads);
      loadRead = Date.now();
      showLoadFreshness(null);
      // The members' roles came with it: drawn at once if they changed.
      const key = JSON.stringify(shownOf(lastView));
      if (key !== shownKey) {
        renderMembers(lastView);
        shownKey = key;
      }
    }
  } catch (error) {
    showLoadFreshness(error.message);
  } finally {
    setTimeout(loadTick, LOAD_EVERY_MS);
  }
}

// The load's own freshness line: empty while its reads succeed; else what
// is shown is marked as from the last read that did (the table's figures
// are left as they were, not passed off as current).
let loadRead = null;

function showLoadFreshness(why) {
  const line = document.getElementById("load-freshness");
  const table = document.getElementById("load");
  if (why === null) {
    line.textContent = "";
    table.classList.remove("stale");
    return;
  }
  line.textContent = loadRead
    ? `Stale: the load and events were last read at ${clock(new Date(loadRead))} (${why}).`
    : `The load and events have not been read yet (${why}).`;
  table.classList.add("stale");
}

tick();
