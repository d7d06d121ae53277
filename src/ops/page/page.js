// The live cluster page: reads this node's JSON routes every second and
// shows them. Every figure comes from those routes; nothing is fetched
// from anywhere else.
"use strict";

const EVERY_MS = 1000;
// A read that takes longer is given up, and the page says its data is old.
const READ_TIMEOUT_MS = 3000;
const MAX_CHANGES = 200;
const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"];

let previous = null;   // the last view read: members and shard owners
let lastRead = null;   // when the last full read succeeded
let shownKey = null;   // what the tables show now: drawn again only when it changes
let lastView = null;   // the last members and shards read (the load loop draws on it)
let latestLoads = {};  // the last load answers, by type
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

async function read() {
  const members = await json("cluster/members");
  let types = [];
  try {
    types = (await json("cluster/shards")).types;
  } catch (error) {
    if (error.status !== 404) throw error;
    types = []; // a node without a sharded system
  }
  const shards = {};
  for (const type of types) {
    shards[type] = await json("cluster/shards/" + encodeURIComponent(type));
  }
  // (From the newest one shown: a repeat of it changes its count.)
  const after = events_seen.node === members.self_node ? Math.max(0, events_seen.last - 1) : 0;
  const events = await json("cluster/events?after=" + after);
  return { members, shards, events };
}

// ---- Load: every member's counts, summed over the entity types, kept
// for the last five minutes as cumulative samples; the figures are the
// differences between samples.

const KEEP_MS = 5 * 60 * 1000;
const NOW_WINDOW_MS = 10 * 1000;
const samples = new Map(); // node -> [{ t, answered: [..], failed: {kind: n}, entities }]

// One member's sample from every type's answer (null when a type's answer
// lacks it: it did not answer, or its build counts nothing).
function sampleOf(loads, node) {
  let sample = null;
  for (const load of Object.values(loads)) {
    const m = load.members.find((x) => x.node === node);
    if (!m || !m.answered) return null;
    if (!sample) sample = { t: load.read_at_ms, answered: m.answered.map(() => 0), failed: {}, entities: 0, bounds: load.bounds };
    m.answered.forEach((n, i) => { sample.answered[i] += n; });
    for (const [kind, n] of Object.entries(m.failed || {})) sample.failed[kind] = (sample.failed[kind] || 0) + n;
    sample.entities += m.live_entities || 0;
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
    const last = kept[kept.length - 1];
    // A restarted region counts from 0 again: its earlier samples go.
    if (last && sum(sample.answered) < sum(last.answered)) kept.length = 0;
    kept.push(sample);
    while (kept.length && kept[0].t < sample.t - KEEP_MS) kept.shift();
    samples.set(node, kept);
  }
}

function sum(xs) {
  return xs.reduce((a, b) => a + b, 0);
}

function failedTotal(sample) {
  return sum(Object.values(sample.failed));
}

// The latency below which fraction `q` of the asks between two samples
// fell: a bucket's upper bound ("> 10 s" above the last); null with none.
function quantile(before, after, q) {
  const delta = after.answered.map((n, i) => n - before.answered[i]);
  const total = sum(delta);
  if (total <= 0) return null;
  let seen = 0;
  for (let i = 0; i < delta.length; i++) {
    seen += delta[i];
    if (seen >= q * total) return i < after.bounds.length ? after.bounds[i] : Infinity;
  }
  return Infinity;
}

function seconds(s) {
  if (s === null) return "—";
  if (s === Infinity) return "> 10 s";
  if (s < 1e-3) return "≤ " + Math.round(s * 1e6) + " µs";
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
    const a = kept[i - 1], b = kept[i];
    const dt = (b.t - a.t) / 1000;
    if (dt <= 0) continue;
    points.push({
      t: b.t,
      asks: (sum(b.answered) - sum(a.answered) + failedTotal(b) - failedTotal(a)) / dt,
      p99: quantile(a, b, 0.99),
      failures: (failedTotal(b) - failedTotal(a)) / dt,
      entities: b.entities,
    });
  }
  return points;
}

// A small chart of `values` over the last five minutes, as an SVG image
// with its summary as its accessible name.
function sparkline(points, pick, label, format) {
  const width = 120, height = 28;
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("class", "spark");
  svg.setAttribute("role", "img");
  const values = points.map(pick).filter((v) => v !== null && Number.isFinite(v));
  const max = values.length ? Math.max(...values) : 0;
  svg.setAttribute("aria-label", values.length
    ? `${label} over the last ${Math.round((points[points.length - 1].t - points[0].t) / 1000)} s: from ${format(Math.min(...values))} to ${format(max)}`
    : `${label}: nothing read yet`);
  if (points.length > 1) {
    const t0 = points[0].t, span = Math.max(1, points[points.length - 1].t - t0);
    const coords = points.map((p) => {
      const v = pick(p);
      const y = v === null || !Number.isFinite(v) ? height - 1 : height - 1 - (max > 0 ? (v / max) * (height - 3) : 0);
      return `${((p.t - t0) / span * (width - 2) + 1).toFixed(1)},${y.toFixed(1)}`;
    });
    const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    line.setAttribute("points", coords.join(" "));
    svg.append(line);
  }
  return svg;
}

function renderLoad(view, loads) {
  const body = document.querySelector("#load tbody");
  body.replaceChildren();
  const silent = new Set();
  for (const load of Object.values(loads)) for (const n of load.no_answer) silent.add(n);
  if (Object.keys(loads).length === 0) {
    body.append(el("tr", {}, el("td", { colspan: "6" }, "No entity type is registered on this node.")));
    return;
  }
  for (const m of view.members.members) {
    const kept = samples.get(m.node) || [];
    const newest = kept[kept.length - 1];
    const head = el("th", { scope: "row", title: m.node }, el("span", { class: "cell swatch", background: colour(m.node), "aria-hidden": "true" }), " ", m.addr);
    const answeredNow = sampleOf(loads, m.node);
    if (!answeredNow) {
      const why = silent.has(m.node)
        ? "no answer to this read: unreachable or slow (no figure shown as current)"
        : ["Joining", "Up", "Leaving"].includes(m.status)
          ? "no counts: it has no region of these types, or its build counts no asks"
          : `not asked: it is ${m.status}`;
      body.append(el("tr", { "data-node": m.node, "data-answered": "" }, head, el("td", { colspan: "5", class: silent.has(m.node) ? "bad" : "" }, why)));
      continue;
    }
    const before = sampleBefore(kept, NOW_WINDOW_MS);
    const points = series(kept);
    const rate = before ? (sum(newest.answered) - sum(before.answered) + failedTotal(newest) - failedTotal(before)) / ((newest.t - before.t) / 1000) : null;
    const minuteAgo = sampleBefore(kept, 60 * 1000);
    const failedLately = [];
    if (minuteAgo) {
      for (const [kind, n] of Object.entries(newest.failed)) {
        const d = n - (minuteAgo.failed[kind] || 0);
        if (d > 0) failedLately.push(`${kind} ${d}`);
      }
    }
    const fmtRate = (v) => v === null ? "—" : v >= 100 ? Math.round(v).toString() : v.toFixed(1);
    body.append(el("tr", { "data-node": m.node, "data-answered": String(sum(newest.answered)), "data-entities": String(newest.entities) },
      head,
      el("td", {}, String(newest.entities), " ", sparkline(points, (p) => p.entities, "live entities", String)),
      el("td", {}, fmtRate(rate), " ", sparkline(points, (p) => p.asks, "asks per second", fmtRate)),
      el("td", {}, seconds(before ? quantile(before, newest, 0.5) : null)),
      el("td", {}, seconds(before ? quantile(before, newest, 0.99) : null), " ", sparkline(points, (p) => p.p99, "p99 latency", seconds)),
      el("td", { class: failedLately.length ? "warn" : "" }, failedLately.length ? failedLately.join(", ") : (minuteAgo ? "none" : "—"), " ",
        sparkline(points, (p) => p.failures, "failures per second", fmtRate))));
  }
}

// ---- Events: this node's history, read after the last one seen.

const MAX_EVENTS = 200;
const events_seen = { node: null, last: 0 };

function renderEvents(view) {
  const list = document.getElementById("events");
  if (events_seen.node !== view.members.self_node) {
    // A first read, or another incarnation of the node: from scratch.
    list.replaceChildren();
    events_seen.node = view.members.self_node;
    events_seen.last = 0;
  }
  // Newest first in the answer: the oldest new one goes on first.
  for (const e of [...view.events.events].reverse()) {
    if (e.seq <= events_seen.last) {
      // A repeat of the newest shown: its count and time change.
      const shown = list.querySelector(`li[data-seq="${e.seq}"]`);
      if (shown) shown.replaceWith(eventItem(e));
      continue;
    }
    list.prepend(eventItem(e));
    events_seen.last = e.seq;
  }
  while (list.children.length > MAX_EVENTS) list.lastChild.remove();
}

function eventItem(e) {
  const at = new Date(e.at_ms);
  return el("li", { "data-seq": String(e.seq), "data-kind": e.kind },
    el("time", { datetime: at.toISOString() }, clock(at)), " ",
    el("span", { class: "kind" }, e.kind.replaceAll("_", " ")), " ",
    e.text, e.count > 1 ? ` (×${e.count})` : "");
}

// A member's roles, as it answered the last load read (null when it did
// not answer one).
function rolesOf(node) {
  for (const load of Object.values(latestLoads)) {
    const m = load.members.find((x) => x.node === node);
    if (m && m.roles) return m.roles;
  }
  return null;
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
    renderEvents(view);
    lastView = view;
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

// The load is read on its own loop: asking every member takes up to the
// route's two seconds when one is silent, and must not hold back the
// members and shards above, read every second.
async function loadTick() {
  try {
    if (lastView && !refused) {
      const types = Object.keys(lastView.shards);
      const answers = await Promise.all(types.map((type) => json("cluster/load/" + encodeURIComponent(type))));
      const loads = {};
      types.forEach((type, i) => { loads[type] = answers[i]; });
      latestLoads = loads;
      keepSamples(loads);
      renderLoad(lastView, loads);
      // The members' roles came with it: drawn at once if they changed.
      const key = JSON.stringify(shownOf(lastView));
      if (key !== shownKey) {
        renderMembers(lastView);
        shownKey = key;
      }
    }
  } catch (_) {
    // The main loop says when reads fail; the load waits for the next one.
  } finally {
    setTimeout(loadTick, EVERY_MS);
  }
}

tick();
loadTick();
