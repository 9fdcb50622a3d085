// Dataflow explorer page. All modelling happens in Python behind /api/*; this file only keeps
// the clicked path, asks the server what it costs and draws the answer.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const state = { path: [], result: null, step: -1, seq: 0, searchInfo: "" };

const $ = (id) => document.getElementById(id);

function fmtBytes(n) {
  const units = [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];
  for (const [u, s] of units) if (Math.abs(n) >= s) return (n / s).toFixed(2) + " " + u;
  return Math.round(n) + " B";
}

function readForm() {
  const num = (id) => Number($(id).value);
  return {
    shape: { M: num("M"), N: num("N"), K: num("K"), block_m: num("block_m"),
             block_n: num("block_n"), block_k: num("block_k"), elem_bytes: num("elem_bytes") },
    cache_bytes: Math.round(num("cache_kib") * 1024),
    num_sms: num("num_sms"),
    policy: $("policy").value,
  };
}

async function post(url, body) {
  const resp = await fetch(url, { method: "POST", headers: { "Content-Type": "application/json" },
                                  body: JSON.stringify(body) });
  const data = await resp.json();
  if (!resp.ok) throw new Error(data.error || resp.statusText);
  return data;
}

function showError(msg) { $("error").textContent = msg || ""; }

// Ask the model for the current path; only the latest answer is drawn (clicks can overtake).
async function refresh() {
  const seq = ++state.seq;
  $("traffic").dataset.pending = "1";
  try {
    const result = await post("/api/simulate", { ...readForm(), path: state.path });
    if (seq !== state.seq) return;
    state.result = result;
    state.path = result.path;
    state.step = result.steps.length - 1;
    showError("");
    render();
  } catch (e) {
    if (seq === state.seq) showError(e.message);
  } finally {
    if (seq === state.seq) delete $("traffic").dataset.pending;
  }
}

function el(name, attrs, parent) {
  const node = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (parent) parent.appendChild(node);
  return node;
}

function shade(fraction) {   // white (not cached) .. blue (every K-block cached)
  const f = Math.max(0, Math.min(1, fraction));
  const r = Math.round(255 - 180 * f), g = Math.round(255 - 120 * f);
  return `rgb(${r},${g},255)`;
}

function tileColor(index, count) {   // issue order: early yellow .. late green
  const t = count > 1 ? index / (count - 1) : 0;
  return `hsl(${50 + 90 * t}, 75%, ${80 - 25 * t}%)`;
}

function render() {
  const res = state.result;
  if (!res) return;
  const { tiles_m: tm, tiles_n: tn, k_steps: ks } = res.grid;
  const cell = Math.max(14, Math.min(56, Math.floor(560 / Math.max(tm, tn))));
  const margin = 46;
  const svg = $("grid");
  svg.innerHTML = "";
  svg.setAttribute("width", margin + tn * cell + 10);
  svg.setAttribute("height", margin + tm * cell + 10);
  const defs = el("defs", {}, svg);
  const marker = el("marker", { id: "arrowhead", viewBox: "0 0 10 10", refX: "9", refY: "5",
                                markerWidth: "6", markerHeight: "6", orient: "auto-start-reverse" },
                    defs);
  el("path", { d: "M 0 0 L 10 5 L 0 10 z", fill: "#d62" }, marker);

  const step = state.step >= 0 ? res.steps[state.step] : null;
  const cache = step ? step.cache : { A: new Array(tm).fill(0), B: new Array(tn).fill(0) };
  // A row-panels down the left, B column-panels along the top, shaded by K-blocks cached
  for (let m = 0; m < tm; m++) {
    el("rect", { class: "panel", x: 4, y: margin + m * cell + 1, width: margin - 10,
                 height: cell - 2, fill: shade(cache.A[m] / ks), "data-a": m }, svg);
    const t = el("text", { class: "panel-label", x: 4 + (margin - 10) / 2,
                           y: margin + m * cell + cell / 2 }, svg);
    t.textContent = cache.A[m] ? `A${m}:${cache.A[m]}` : `A${m}`;
  }
  for (let n = 0; n < tn; n++) {
    el("rect", { class: "panel", x: margin + n * cell + 1, y: 4, width: cell - 2,
                 height: margin - 10, fill: shade(cache.B[n] / ks), "data-b": n }, svg);
    const t = el("text", { class: "panel-label", x: margin + n * cell + cell / 2,
                           y: 4 + (margin - 10) / 2 }, svg);
    t.textContent = cache.B[n] ? `B${n}:${cache.B[n]}` : `B${n}`;
  }

  // tiles that have run by the selected step, and which ran in it
  const position = new Map(state.path.map(([m, n], i) => [m + "," + n, i]));
  const doneBy = new Set(), current = new Set();
  res.steps.forEach((s, i) => {
    for (const [m, n] of s.tiles) {
      if (i <= state.step) doneBy.add(m + "," + n);
      if (i === state.step) current.add(m + "," + n);
    }
  });
  for (let m = 0; m < tm; m++) {
    for (let n = 0; n < tn; n++) {
      const key = m + "," + n;
      const idx = position.get(key);
      const fill = idx === undefined ? "#f2f2f6"
        : doneBy.has(key) ? tileColor(idx, state.path.length) : "#e2e2ea";
      el("rect", { class: "tile" + (current.has(key) ? " current" : ""),
                                x: margin + n * cell, y: margin + m * cell, width: cell,
                                height: cell, fill, "data-m": m, "data-n": n }, svg);
      if (idx !== undefined && cell >= 18) {
        const t = el("text", { class: "tile-label", x: margin + n * cell + cell / 2,
                               y: margin + m * cell + cell / 2 }, svg);
        t.textContent = String(idx + 1);
      }
    }
  }
  // arrows from each tile to the next one in the path
  const centre = ([m, n]) => [margin + n * cell + cell / 2, margin + m * cell + cell / 2];
  for (let i = 0; i + 1 < state.path.length; i++) {
    const [x0, y0] = centre(state.path[i]), [x1, y1] = centre(state.path[i + 1]);
    const d = Math.hypot(x1 - x0, y1 - y0) || 1, pull = Math.min(cell * 0.3, d / 3);
    el("line", { class: "arrow", x1: x0 + (x1 - x0) * pull / d, y1: y0 + (y1 - y0) * pull / d,
                 x2: x1 - (x1 - x0) * pull / d, y2: y1 - (y1 - y0) * pull / d,
                 "marker-end": "url(#arrowhead)" }, svg);
  }
  renderReadout();
}

function renderReadout() {
  const res = state.result;
  const tot = res.totals, b = res.bounds;
  const traffic = $("traffic");
  traffic.dataset.readBytes = String(tot.read_bytes);
  traffic.dataset.dramBytes = String(tot.dram_bytes);
  traffic.dataset.pathLength = String(res.path.length);
  traffic.textContent = res.path.length
    ? `DRAM traffic: ${fmtBytes(tot.dram_bytes)} (read ${fmtBytes(tot.read_bytes)} + write ${fmtBytes(tot.write_bytes)})`
    : "no tiles yet: click a tile";
  $("stats").textContent = `${res.path.length} of ${res.grid.tiles_m * res.grid.tiles_n} tiles · `
    + `${tot.misses} block misses · hit rate ${(100 * tot.hit_rate).toFixed(1)}% · `
    + `${res.grid.k_steps} K-steps/tile · A block ${fmtBytes(res.a_block_bytes)}, B block ${fmtBytes(res.b_block_bytes)}`;
  $("bounds").textContent = `whole GEMM: compulsory read ${fmtBytes(b.compulsory_read_bytes)}, `
    + `write ${fmtBytes(b.compulsory_write_bytes)}; pebble bound ${fmtBytes(b.pebble_bytes)}`;
  $("search-info").textContent = state.searchInfo;

  const slider = $("step");
  slider.max = String(Math.max(0, res.steps.length - 1));
  slider.value = String(Math.max(0, state.step));
  slider.disabled = res.steps.length === 0;
  const step = state.step >= 0 ? res.steps[state.step] : null;
  $("step-value").textContent = step ? `${state.step + 1} / ${res.steps.length}` : "";
  $("cache-info").textContent = step
    ? `after step ${state.step + 1}: cache holds ${step.cache_blocks} blocks; `
      + `cumulative DRAM ${fmtBytes(step.cum_dram_bytes)}. Panel labels Ai:k / Bj:k `
      + `= k of the panel's ${res.grid.k_steps} K-blocks are cached.`
    : "";

  const body = $("steps").querySelector("tbody");
  body.innerHTML = "";
  res.steps.forEach((s, i) => {
    const row = document.createElement("tr");
    if (i === state.step) row.className = "selected";
    const names = s.tiles.map(([m, n]) => `(${m},${n})`);
    const shown = names.length > 6 ? names.slice(0, 4).join(" ") + ` … ${names.length} tiles`
                                   : names.join(" ");
    const cells = [i + 1, shown, s.misses,
                   fmtBytes(s.read_bytes), fmtBytes(s.cum_dram_bytes)];
    for (const c of cells) {
      const td = document.createElement("td");
      td.textContent = String(c);
      row.appendChild(td);
    }
    row.addEventListener("click", () => { state.step = i; render(); });
    body.appendChild(row);
  });
}

function clickTile(m, n) {
  if (state.path.some(([a, b]) => a === m && b === n)) return;   // each tile runs once
  state.path = [...state.path, [m, n]];
  state.searchInfo = "";
  refresh();
}

async function loadOrder() {
  try {
    const spec = $("order-select").value;
    const data = await post("/api/order", { ...readForm(), spec });
    state.path = data.path;
    state.searchInfo = `loaded ${spec}`;
    await refresh();
  } catch (e) { showError(e.message); }
}

async function searchBest() {
  $("search-info").textContent = "searching…";
  try {
    const data = await post("/api/search", readForm());
    state.path = data.path;
    state.searchInfo = data.method === "exhaustive"
      ? `exhaustive (LRU): best ${fmtBytes(data.read_bytes)} read, worst ${fmtBytes(data.worst_read_bytes)}; `
        + `${data.explored} nodes explored of ${data.total_orders} orders`
      : `annealing (seed ${data.seed}, ${data.iterations} iterations): ${data.start} `
        + `${fmtBytes(data.start_read_bytes)} → ${fmtBytes(data.read_bytes)} read`;
    await refresh();
  } catch (e) { showError(e.message); $("search-info").textContent = ""; }
}

async function init() {
  try {
    const resp = await fetch("/api/orders");
    const { orders } = await resp.json();
    const select = $("order-select");
    for (const o of orders) {
      const specs = o.param ? [1, 2, 4, 8].map((g) => `${o.name}:${g}`) : [o.name];
      for (const s of specs) {
        const opt = document.createElement("option");
        opt.value = opt.textContent = s;
        select.appendChild(opt);
      }
    }
  } catch (e) { showError(e.message); }
  $("undo").addEventListener("click", () => {
    state.path = state.path.slice(0, -1);
    refresh();
  });
  $("reset").addEventListener("click", () => { state.path = []; state.searchInfo = ""; refresh(); });
  $("load-order").addEventListener("click", loadOrder);
  $("search").addEventListener("click", searchBest);
  // A tile is taken on the primary button's press, through one listener on the SVG: a
  // "click" needs press and release on the same element, and a render landing in between
  // (say, the answer to the change event that the press's blur of a form field fired)
  // replaces every tile, so the click would be lost.
  $("grid").addEventListener("pointerdown", (e) => {
    if (e.button !== 0) return;
    const tile = e.target.closest("rect.tile");
    if (tile) clickTile(Number(tile.dataset.m), Number(tile.dataset.n));
  });
  $("step").addEventListener("input", (e) => { state.step = Number(e.target.value); render(); });
  // a new shape keeps the tiles of the path that still exist
  $("shape-form").addEventListener("change", () => {
    const f = readForm().shape;
    const tm = Math.ceil(f.M / f.block_m), tn = Math.ceil(f.N / f.block_n);
    state.path = state.path.filter(([m, n]) => m < tm && n < tn);
    refresh();
  });
  refresh();
}

init();
