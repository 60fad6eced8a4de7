// The radix cache explorer: polls ./tree (GET /cache/tree) and draws the tree, the KV pool and the event log.
// Query parameters of the page: interval (ms between polls, default 500), max_nodes, max_tokens.
"use strict";

(function () {
  const params = new URLSearchParams(window.location.search);
  const interval = clamp(parseInt(params.get("interval") || "500", 10), 100, 60000);
  const limits = ["max_nodes", "max_tokens"].filter((k) => params.get(k)).map((k) => `&${k}=${encodeURIComponent(params.get(k))}`).join("");
  const KINDS = ["insert", "split", "match", "lock", "unlock", "evict", "reset"];
  const MAX_LOG = 400;
  const state = {
    since: 0, paused: false, busy: false, shown: new Set(KINDS), texts: new Map(), seen: new Set(),
    lastMatch: null, snapshot: null, flashUntil: 0,
  };
  const $ = (id) => document.getElementById(id);

  function clamp(value, lo, hi) {
    return Number.isFinite(value) ? Math.min(Math.max(value, lo), hi) : lo;
  }

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function nsLabel(snapshot, index) {
    const ns = snapshot.namespaces[index] || { kind: "?" };
    if (ns.hash === null || ns.hash === undefined) return ns.kind;
    return ns.value ? `${ns.kind}=${ns.value}` : `${ns.kind}#${ns.hash}`;
  }

  function nodeText(node) {
    if ($("show-ids").checked || node.text === undefined) {
      return "[" + node.tokens.join(", ") + (node.elided ? `, … +${node.elided}` : "") + "]";
    }
    return JSON.stringify(node.text) + (node.elided ? ` … +${node.elided} tok` : "");
  }

  function short(text, n) {
    return text.length > n ? text.slice(0, n - 1) + "…" : text;
  }

  // ------------------------------------------------------------------------------------------ drawing

  function drawPool(snapshot) {
    const pool = snapshot.pool;
    const parts = [["free", pool.available], ["evictable", pool.evictable], ["protected", pool.protected],
      ["in_requests", pool.in_requests]];
    const bar = $("pool-bar");
    bar.replaceChildren(...parts.map(([name, value]) => {
      const seg = el("div", "seg-" + name);
      seg.style.width = (100 * value / Math.max(pool.size, 1)).toFixed(2) + "%";
      seg.title = `${name.replace("_", " ")}: ${value} tokens`;
      return seg;
    }));
    $("pool-legend").replaceChildren(...parts.map(([name, value]) => {
      const item = el("span");
      const dot = el("i", "seg-" + name);
      item.append(dot, `${name.replace("_", " ")} ${value}`);
      return item;
    }), el("span", "", `pool ${pool.size} tokens`));
    const facts = [
      `page size ${snapshot.page_size}`, `eviction ${snapshot.eviction_policy}`,
      `${snapshot.nodes.length - 1} nodes${snapshot.truncated ? " (more not shown)" : ""}`,
      `${snapshot.requests.length} running, ${snapshot.waiting_requests} waiting`,
      `snapshot ${snapshot.took_ms} ms`,
    ];
    if (snapshot.is_eagle) facts.push("bigram keys (EAGLE)");
    if (snapshot.disabled) facts.push("radix cache disabled");
    if (snapshot.events_lost) facts.push(`${snapshot.events_lost} events missed`);
    $("facts").replaceChildren(...facts.map((f) => el("span", "", f)));
  }

  function bytes(n) {
    if (n === null || n === undefined) return "?";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return `${i ? n.toFixed(1) : n} ${units[i]}`;
  }

  // One row per tier: the device pool (tokens), and with the hierarchical cache the host and storage tiers (pages).
  function drawTiers(snapshot) {
    const tiers = snapshot.tiers;
    const table = $("tiers");
    if (!tiers) { table.replaceChildren(); return; }
    const d = tiers.device;
    const rows = [["device", `${d.cached} of ${d.tokens} tokens cached in the tree, ${d.free} free`, "", ""]];
    if (!tiers.hierarchical) {
      rows.push(["host / storage", "off (--enable-hierarchical-cache)", "", ""]);
    } else {
      const h = tiers.host;
      rows.push(h ? ["host", `${h.pages} pages, ${bytes(h.bytes)} of ${bytes(h.capacity_bytes)} (${h.dtype})`,
        `hits ${h.hits}, misses ${h.misses}, evicted ${h.evicted}`, `loaded ${h.loaded_tokens} tokens`]
        : ["host", "none (--hicache-size / --hicache-ratio)", "", ""]);
      const s = tiers.storage;
      const cap = s.capacity_bytes ? bytes(s.capacity_bytes) : "no cap";
      rows.push([`storage (${s.backend})`, `${s.pages === null ? "?" : s.pages} pages, ${bytes(s.bytes)} of ${cap}` +
        (s.enabled ? "" : " — turned off"), `hits ${s.hits}, misses ${s.misses}, corrupt ${s.corrupt}, ` +
        `written ${s.pages_written}, evicted ${s.evicted}`, `loaded ${s.loaded_tokens} tokens`]);
    }
    table.replaceChildren(...rows.map((cells) => {
      const tr = el("tr");
      tr.dataset.tier = cells[0].split(" ")[0];
      tr.append(el("th", "", cells[0]), ...cells.slice(1).map((c) => el("td", "", c)));
      return tr;
    }));
    if (tiers.hierarchical) {
      table.title = `${tiers.page_tokens}-token pages of ${bytes(tiers.page_bytes)}, ${tiers.write_policy}, ` +
        `${tiers.loads} loads`;
    }
  }

  function pathOf(byId, id) {
    const path = new Set();
    while (id !== null && id !== undefined && byId.has(id)) {
      path.add(id);
      id = byId.get(id).parent;
    }
    return path;
  }

  function drawTree(snapshot) {
    const byId = new Map(snapshot.nodes.map((n) => [n.id, n]));
    const children = new Map();
    for (const node of snapshot.nodes) {
      if (node.parent === null) continue;
      if (!children.has(node.parent)) children.set(node.parent, []);
      children.get(node.parent).push(node);
    }
    const held = new Set();
    for (const req of snapshot.requests) for (const id of pathOf(byId, req.node)) held.add(id);
    const matched = pathOf(byId, state.lastMatch);
    const root = snapshot.nodes.find((n) => n.parent === null);
    const top = el("ul");
    if (root) top.append(drawNode(snapshot, root, children, held, matched));
    const notes = [];
    if (snapshot.hidden_nodes) notes.push(el("div", "note", `${snapshot.hidden_nodes} nodes of other API keys are not shown`));
    if (snapshot.nodes.length <= 1) notes.push(el("div", "note", "The tree is empty: send a request."));
    $("tree").replaceChildren(top, ...notes);
    for (const node of snapshot.nodes) if (node.text !== undefined) state.texts.set(node.id, node.text);
  }

  function drawNode(snapshot, node, children, held, matched) {
    const item = el("li");
    const box = el("div", "node");
    box.dataset.nodeId = node.id;
    box.dataset.lockRef = node.lock_ref;
    box.dataset.evictable = node.evictable;
    if (node.parent === null) {
      box.classList.add("root");
      box.append(el("div", "", `root · lock ${node.lock_ref}`));
    } else {
      box.classList.add(node.evictable ? "evictable" : "protected");
      if (held.has(node.id)) box.classList.add("held");
      if (matched.has(node.id)) box.classList.add("matched");
      if (!state.seen.has(node.id)) box.classList.add("fresh");
      const text = nodeText(node);
      box.title = text;
      if (node.text !== undefined) box.dataset.text = node.text;
      box.append(el("div", "node-text", text));
      const badges = el("div", "badges");
      const lock = el("span", node.lock_ref ? "lock" : "lock zero", `lock ${node.lock_ref}`);
      badges.append(el("span", "ns", nsLabel(snapshot, node.ns)), el("span", "", `${node.len} tok`), lock,
        el("span", "", node.evictable ? "evictable" : "protected"), el("span", "", `hits ${node.hits}`),
        el("span", "", `${node.age_s.toFixed(1)} s`), el("span", "id", `#${node.id}`));
      box.append(badges);
    }
    state.seen.add(node.id);
    item.append(box);
    const kids = children.get(node.id);
    if (kids) {
      const list = el("ul");
      for (const kid of kids) list.append(drawNode(snapshot, kid, children, held, matched));
      item.append(list);
    }
    return item;
  }

  function describeEvent(snapshot, event) {
    const ns = nsLabel(snapshot, event.ns);
    const named = (id) => {
      const text = state.texts.get(id);
      return text === undefined ? `#${id}` : `#${id} ${JSON.stringify(short(text, 24))}`;
    };
    switch (event.kind) {
      case "evict":
        return `evict ${event.tokens} tok (asked ${event.asked}): ` +
          event.victims.map((v) => `${named(v.node)} (${v.tokens})`).join(", ");
      case "split": return `split ${named(event.lower)}: new upper #${event.node} of ${event.tokens} tok [${ns}]`;
      case "insert": return `insert ${event.tokens} new tok after ${event.cached} cached → #${event.node} [${ns}]`;
      case "match": return `match ${event.tokens} of ${event.asked} tok → ${named(event.node)} [${ns}]`;
      case "lock": case "unlock":
        return `${event.kind} ${named(event.node)} → lock ${event.lock_ref}` + (event.tokens ? ` (${event.tokens} tok ${event.kind === "lock" ? "protected" : "evictable"})` : "");
      case "reset": return "reset: the tree was emptied (flush_cache)";
      default: return event.kind;
    }
  }

  function addEvents(snapshot) {
    const list = $("events");
    const evictions = [];
    for (const event of snapshot.events) {
      if (event.kind === "match") state.lastMatch = event.node;
      if (event.kind === "evict") evictions.push(event);
      const item = el("li", event.kind);
      item.dataset.kind = event.kind;
      item.hidden = !state.shown.has(event.kind);
      item.append(el("span", "seq", String(event.seq)), describeEvent(snapshot, event));
      list.prepend(item);
    }
    while (list.children.length > MAX_LOG) list.lastElementChild.remove();
    if (evictions.length) {
      const freed = evictions.reduce((sum, e) => sum + e.tokens, 0);
      const victims = evictions.reduce((sum, e) => sum + e.victims.length, 0);
      const flash = $("flash");
      flash.textContent = `evicted ${freed} tokens (${victims} nodes)`;
      flash.hidden = false;
      state.flashUntil = Date.now() + 4000;
    } else if (Date.now() > state.flashUntil) {
      $("flash").hidden = true;
    }
  }

  function drawFilters() {
    $("filters").replaceChildren(...KINDS.map((kind) => {
      const label = el("label");
      const box = el("input");
      box.type = "checkbox";
      box.checked = state.shown.has(kind);
      box.addEventListener("change", () => {
        if (box.checked) state.shown.add(kind); else state.shown.delete(kind);
        for (const item of $("events").children) item.hidden = !state.shown.has(item.dataset.kind);
      });
      label.append(box, " " + kind);
      return label;
    }));
  }

  // ------------------------------------------------------------------------------------------ polling

  function setStatus(text, error) {
    const status = $("status");
    status.textContent = text;
    status.classList.toggle("error", Boolean(error));
  }

  async function poll() {
    if (state.paused || state.busy) return;
    state.busy = true;
    try {
      const response = await fetch(`tree?since=${state.since}${limits}`, { cache: "no-store" });
      if (!response.ok) {
        const body = await response.json().catch(() => ({}));
        setStatus(`error ${response.status}: ${(body.error && body.error.message) || response.statusText}`, true);
        return;
      }
      const snapshot = await response.json();
      state.since = snapshot.event_seq;
      state.snapshot = snapshot;
      addEvents(snapshot);
      drawPool(snapshot);
      drawTiers(snapshot);
      drawTree(snapshot);
      setStatus(`live · ${new Date().toLocaleTimeString()}`, false);
    } catch (err) {
      setStatus(`cannot reach the server (${err.message}); retrying`, true);
    } finally {
      state.busy = false;
    }
  }

  $("pause").addEventListener("click", () => {
    state.paused = !state.paused;
    $("pause").textContent = state.paused ? "Resume" : "Pause";
    setStatus(state.paused ? "paused" : "resuming…", false);
  });
  $("show-ids").addEventListener("change", () => { if (state.snapshot) drawTree(state.snapshot); });
  drawFilters();
  poll();
  window.setInterval(poll, interval);
})();
