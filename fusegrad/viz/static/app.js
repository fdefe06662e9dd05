// The VIZ page: asks the server (server.py) for the trace's parts and draws them. No libraries: graphs are laid
// out here in layers and drawn as SVG, the timeline too.
"use strict";

const state = { summary: null, cache: {} };
const main = document.getElementById("main");

function reportError(msg) {
  const box = document.getElementById("errors");
  box.hidden = false;
  box.textContent += msg + "\n";
}
window.addEventListener("error", (e) => reportError("error: " + e.message));
window.addEventListener("unhandledrejection", (e) => reportError("error: " + e.reason));

async function api(path) {
  if (path in state.cache) return state.cache[path];
  const res = await fetch("/api/" + path);
  if (!res.ok) throw new Error(path + ": " + res.status);
  return (state.cache[path] = await res.json());
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "onclick") e.addEventListener("click", v);
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function fmtUs(us) {
  if (us === null || us === undefined) return "";
  return us < 1000 ? us.toFixed(2) + " us" : (us / 1000).toFixed(2) + " ms";
}
function fmtMs(ms) { return ms === null || ms === undefined ? "" : ms.toFixed(2) + " ms"; }

// *** graphs ***

const FAMILIES = [
  ["#ffcc80", ["ADD", "MUL", "SUB", "NEG", "MAX", "IDIV", "MOD", "CMPLT", "CMPNE", "CMPEQ", "AND", "OR", "XOR", "SHL",
               "SHR", "WHERE", "MULACC", "EXP2", "LOG2", "SIN", "SQRT", "RECIP", "TRUNC", "NOT", "FDIV", "POW"]],
  ["#90caf9", ["LOAD", "STORE", "INDEX", "DEFINE_GLOBAL", "DEFINE_LOCAL", "DEFINE_REG", "BUFFER", "BUFFER_VIEW", "COPY",
               "ASSIGN", "DEVICE", "UNIQUE"]],
  ["#a5d6a7", ["RESHAPE", "PERMUTE", "EXPAND", "PAD", "SHRINK", "FLIP", "VIEW", "MULTI"]],
  ["#ef9a9a", ["REDUCE", "REDUCE_AXIS", "WMMA"]],
  ["#e0e0e0", ["CONST", "VCONST", "DEFINE_VAR", "BIND"]],
  ["#ce93d8", ["RANGE", "END", "ENDRANGE", "SINK", "KERNEL", "BARRIER", "IF", "ENDIF"]],
  ["#80deea", ["CAST", "BITCAST", "VECTORIZE", "GEP", "CONTIGUOUS", "DETACH", "CUSTOM_GRAD"]],
];
const COLOR = {};
for (const [c, ops] of FAMILIES) for (const op of ops) COLOR[op] = c;

const NODE_W = 130, NODE_H = 30, GAP_X = 14, GAP_Y = 34, MAX_SHOWN = 400;

// nodes: [[id, op, dtype, arg, [src ids]], ...] sources first. Lays out the nodes in layers (a node one below its
// deepest source) and orders each layer by the mean position of its sources.
function layout(nodes) {
  const depth = {}, pos = {};
  const layers = [];
  for (const [id, , , , src] of nodes) {
    let d = 0;
    for (const s of src) if (s in depth) d = Math.max(d, depth[s] + 1);
    depth[id] = d;
    (layers[d] = layers[d] || []).push(id);
  }
  const byId = Object.fromEntries(nodes.map((n) => [n[0], n]));
  layers.forEach((layer, d) => {
    if (d > 0) {
      const key = (id) => {
        const src = byId[id][4].filter((s) => s in pos);
        return src.length ? src.reduce((a, s) => a + pos[s], 0) / src.length : 0;
      };
      layer.sort((a, b) => key(a) - key(b));
    }
    layer.forEach((id, i) => { pos[id] = i; });
  });
  const width = Math.max(1, ...layers.map((l) => l.length));
  const xy = {};
  layers.forEach((layer, d) => {
    const offset = (width - layer.length) / 2;
    layer.forEach((id, i) => { xy[id] = [(offset + i) * (NODE_W + GAP_X) + 8, d * (NODE_H + GAP_Y) + 8]; });
  });
  return { xy, w: width * (NODE_W + GAP_X) + 16, h: layers.length * (NODE_H + GAP_Y) + 16 };
}

// the nodes within `radius` edges of the marked ones (and the root): what a big graph shows until asked for all
function neighbourhood(nodes, marked, root, radius) {
  const adj = {};
  for (const [id, , , , src] of nodes) for (const s of src) {
    (adj[id] = adj[id] || []).push(s);
    (adj[s] = adj[s] || []).push(id);
  }
  const keep = new Set();
  let frontier = [...marked, root];
  for (let r = 0; r <= radius && frontier.length; r++) {
    const next = [];
    for (const id of frontier) if (!keep.has(id)) { keep.add(id); next.push(...(adj[id] || [])); }
    frontier = next;
  }
  return nodes.filter((n) => keep.has(n[0]));
}

const SVGNS = "http://www.w3.org/2000/svg";
function svgEl(tag, attrs) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}

// a graph {root, marked, nodes} drawn into a new element; `colorOf` overrides the fill per node
function drawGraph(graph, label, colorOf) {
  const box = el("div", { class: "graph-box" });
  const marked = new Set(graph.marked || []);
  const all = graph.nodes;
  const render = (showAll) => {
    box.textContent = "";
    let nodes = all;
    if (!showAll && all.length > MAX_SHOWN) nodes = neighbourhood(all, marked, graph.root, 3);
    const head = el("div", { class: "note" }, label + ": ",
                    el("span", { class: "node-count", "data-count": all.length }, all.length), " nodes");
    if (nodes.length < all.length) {
      head.append(` (showing ${nodes.length} around the change) `,
                  el("button", { onclick: () => render(true) }, "show all"));
    }
    box.append(head);
    const { xy, w, h } = layout(nodes);
    const svg = svgEl("svg", { width: w, height: h, class: "graph-svg", "data-nodes": nodes.length });
    for (const [id, , , , src] of nodes) for (const s of src) {
      if (!(s in xy)) continue;
      const [x1, y1] = xy[s], [x2, y2] = xy[id];
      const a = [x1 + NODE_W / 2, y1 + NODE_H], b = [x2 + NODE_W / 2, y2];
      svg.append(svgEl("path", { d: `M${a[0]},${a[1]} C${a[0]},${a[1] + 20} ${b[0]},${b[1] - 20} ${b[0]},${b[1]}` }));
    }
    for (const [id, op, dtype, arg] of nodes) {
      const [x, y] = xy[id];
      const g = svgEl("g", { class: "gnode", "data-id": id });
      const r = svgEl("rect", { x, y, width: NODE_W, height: NODE_H, rx: 4,
                                class: "node" + (marked.has(id) ? " changed" : ""),
                                fill: (colorOf && colorOf(id)) || COLOR[op] || "#fff59d" });
      const title = svgEl("title", {});
      title.textContent = `${op} ${dtype} ${arg}`;
      g.append(r, title);
      const t1 = svgEl("text", { x: x + 4, y: y + 12 });
      t1.textContent = op.slice(0, 20);
      const t2 = svgEl("text", { x: x + 4, y: y + 25 });
      t2.textContent = (arg || dtype.replace("dtypes.", "")).slice(0, 22);
      g.append(t1, t2);
      svg.append(g);
    }
    box.append(el("div", { class: "graph" }, svg));
  };
  render(false);
  return box;
}

// a recorded node table {sink, nodes: [[op, dtype, arg, [src rows]]]} as a graph of the nodes reachable from sink
function tableGraph(table, marked) {
  return { root: table.sink, marked: marked || [], nodes: table.nodes.map((r, i) => [i, ...r]) };
}

// *** source highlighting ***

const C_KEYWORDS = new Set(["void", "for", "if", "else", "return", "while", "const", "restrict", "static", "inline",
                            "struct", "typedef", "unsigned", "signed", "sizeof", "define", "include", "__restrict__",
                            "__attribute__"]);
const C_TYPES = /^(float|double|int|long|short|char|bool|half|size_t|u?int\d+_t|__m\d+\w*|\w+_t)$/;

function highlight(src) {
  const pre = el("pre", { id: "kernel-src" });
  const re = /(\/\/[^\n]*|\/\*[\s\S]*?\*\/)|(^\s*#[^\n]*)|(\b\d+(?:\.\d+)?(?:e[+-]?\d+)?[fFuUlL]*\b|\b0x[0-9a-fA-F]+\b)|([A-Za-z_]\w*)/gm;
  let last = 0, m;
  while ((m = re.exec(src)) !== null) {
    pre.append(src.slice(last, m.index));
    let cls = null;
    if (m[1]) cls = "tok-com";
    else if (m[2]) cls = "tok-pp";
    else if (m[3]) cls = "tok-num";
    else if (C_KEYWORDS.has(m[4])) cls = "tok-kw";
    else if (C_TYPES.test(m[4])) cls = "tok-type";
    pre.append(cls ? el("span", { class: cls }, m[0]) : m[0]);
    last = m.index + m[0].length;
  }
  pre.append(src.slice(last));
  return pre;
}

// *** views ***

function kernelName(i) { return state.summary.kernels[i] ? state.summary.kernels[i].name : `kernel ${i}`; }

function fmtBytes(n) {
  if (n === null || n === undefined) return "";
  return n < 1024 ? n + " B" : n < 1048576 ? (n / 1024).toFixed(1) + " KiB" : (n / 1048576).toFixed(1) + " MiB";
}
function fmtCount(n) {
  if (n === null || n === undefined) return "";
  return n < 1e4 ? String(n) : n < 1e7 ? (n / 1e3).toFixed(1) + "k" : n < 1e10 ? (n / 1e6).toFixed(1) + "M" : (n / 1e9).toFixed(1) + "G";
}
function fmtSeconds(s) { return s === null || s === undefined ? "(no roofline measured yet)" : fmtUs(s * 1e6); }

function viewSchedules() {
  const rows = state.summary.schedules.map((s, i) => el("tr", { class: "clickable schedule-row",
    onclick: () => { location.hash = `#schedule/${i}`; } },
    el("td", {}, i), el("td", { class: "num" }, s.items.length), el("td", { class: "num" }, s.size),
    el("td", { class: "num" }, s.estimate ? fmtCount(s.estimate.flops) : ""),
    el("td", { class: "num" }, s.estimate ? fmtBytes(s.estimate.peak_memory) : ""),
    el("td", { class: "num" }, s.estimate && s.estimate.predicted_s !== null ? fmtSeconds(s.estimate.predicted_s) : ""),
    el("td", {}, s.replayed ? "replayed from its plan" : "scheduled"),
    el("td", {}, s.items.slice(0, 6).map((it) => kernelName(it.kernel)).join(", ") + (s.items.length > 6 ? ", ..." : ""))));
  main.append(el("h2", {}, `${rows.length} schedules`),
              el("table", { id: "schedule-list", "data-count": rows.length },
                 el("tr", {}, ...["#", "items", "tensor nodes", "FLOPs", "peak memory", "predicted", "", "kernels"]
                   .map((h) => el("th", {}, h))), ...rows));
}

// the estimate recorded with a schedule: totals, then what is new in memory at the peak
function estimateTable(est) {
  const rows = [["kernels", est.kernels], ["FLOPs", est.flops], ["bytes moved", est.bytes],
                ["peak memory", `${est.peak_memory} bytes (${fmtBytes(est.peak_memory)})`],
                ["predicted time", fmtSeconds(est.predicted_s)]];
  const box = el("div", { id: "schedule-estimate" },
    el("table", {}, ...rows.map(([a, b]) => el("tr", {}, el("th", {}, a), el("td", { "data-key": a }, b)))));
  if (est.live_at_peak && est.live_at_peak.length) {
    box.append(el("p", { class: "note" }, "new in memory at the peak:"),
               el("table", { class: "live-at-peak" }, ...est.live_at_peak.map(([n, what]) =>
                 el("tr", {}, el("td", { class: "num" }, fmtBytes(n)), el("td", {}, what)))));
  }
  return box;
}

// why a kernel of the explanation exists: each output with the reason the graph was cut there
function whyCell(k) {
  if (!k) return el("td", { class: "item-why" }, "");
  const td = el("td", { class: "item-why" });
  if (k.merged) td.append(el("div", { class: "note" }, `${k.outputs.length} outputs merged into one kernel`));
  for (const [desc, reason, fix, src] of k.outputs) {
    td.append(el("div", { class: "why" }, el("b", {}, desc), src ? ` (made by ${src})` : "", ": ",
                 el("span", { class: "reason" }, reason), el("span", { class: "fix" }, ` - to fuse: ${fix}`)));
  }
  return td;
}

async function viewSchedule(i) {
  const s = await api(`schedule/${i}`);
  main.append(el("h2", {}, `Schedule ${i}: ${s.items.length} items` + (s.replayed ? " (replayed from its plan)" : "")));
  if (s.notes_error) main.append(el("p", { id: "notes-error" }, "no explanation: " + s.notes_error));
  if (s.estimate) main.append(el("h3", {}, "Estimate (before running)"), estimateTable(s.estimate));
  // the explanation's kernels are this schedule's when the counts agree (the same kernelization, in the same order)
  const ex = s.explain ? s.explain.kernels : [];
  const paired = ex.length === s.items.length;
  const per = s.estimate && s.estimate.per_kernel && s.estimate.per_kernel.length === s.items.length ? s.estimate.per_kernel : null;
  const meanUs = (k) => {
    const runs = (state.summary.kernels[k] || {}).runs || [];
    return runs.length ? runs.reduce((a, b) => a + b, 0) / runs.length : null;
  };
  const items = s.items.map((it, j) => el("tr", { class: "clickable item-row",
    onclick: () => { location.hash = `#kernel/${it.kernel}`; } },
    el("td", {}, j), el("td", {}, kernelName(it.kernel)),
    el("td", {}, it.bufs.map((b) => b === null ? "-" : `buf${b[0]} ${b[1].replace("dtypes.", "")}[${b[2]}] ${b[3]}`).join(", ")),
    el("td", {}, Object.entries(it.fixedvars).map(([k, v]) => `${k}=${v}`).join(" ")),
    el("td", { class: "num" }, per && per[j][3] !== null ? fmtUs(per[j][3] * 1e6) : ""),
    el("td", { class: "num" }, fmtUs(meanUs(it.kernel))),
    whyCell(paired ? ex[j] : null)));
  main.append(el("h3", {}, "Kernels in run order"),
              el("table", { id: "item-list", "data-count": s.items.length },
                 el("tr", {}, ...["#", "kernel", "buffers", "parameters", "predicted", "measured (mean)",
                                  "why a kernel of its own"].map((h) => el("th", {}, h))), ...items));
  if (s.explain && !paired) {
    main.append(el("h3", {}, `Kernel boundaries (${ex.length} kernels explained)`),
                el("table", { id: "explain-list" }, ...ex.map((k, j) => el("tr", {}, el("td", {}, j), el("td", {}, k.kind), whyCell(k)))));
  }
  if (s.explain && !s.explain.tracked) {
    main.append(el("p", { class: "note" }, "(source lines: set TRACK_SOURCES=1 or use fusegrad.track_sources() while building)"));
  }
  // the tensor graph, each node coloured by the (first) kernel it is computed in
  const palette = ["#ffab91", "#80cbc4", "#9fa8da", "#e6ee9c", "#f48fb1", "#b39ddb", "#81d4fa", "#ffe082"];
  const colorOf = (id) => (s.owner[id] ? palette[s.owner[id][0] % palette.length] : null);
  main.append(el("h3", {}, "Tensor graph (colour: the kernel computing the node)"),
              drawGraph(tableGraph(s), "tensor graph", s.replayed ? null : colorOf));
}

function viewKernels() {
  const ks = state.summary.kernels;
  const rows = ks.map((k, i) => {
    const runs = k.runs || [];
    const total = runs.reduce((a, b) => a + b, 0);
    return el("tr", { class: "clickable kernel-row", onclick: () => { location.hash = `#kernel/${i}`; } },
      el("td", {}, i), el("td", {}, k.name), el("td", {}, k.device), el("td", { class: "num" }, runs.length),
      el("td", { class: "num" }, runs.length ? fmtUs(total / runs.length) : ""),
      el("td", { class: "num" }, k.ops ?? ""), el("td", { class: "num" }, k.mem ?? ""),
      el("td", { class: "num" }, fmtMs(k.codegen_ms)), el("td", { class: "num" }, fmtMs(k.compile_ms)),
      el("td", {}, (k.opts || []).join(" ")));
  });
  main.append(el("h2", {}, `${ks.length} kernels`),
              el("table", { id: "kernel-list", "data-count": ks.length },
                 el("tr", {}, ...["#", "name", "device", "runs", "mean time", "FLOPs", "bytes", "codegen", "compile",
                                  "opts"].map((h) => el("th", {}, h))), ...rows));
}

async function viewKernel(i) {
  const k = await api(`kernel/${i}`);
  const runs = k.runs || [];
  const info = el("table", {},
    ...[["device", k.device], ["runs", runs.length],
        ["run times", runs.slice(0, 20).map(fmtUs).join(", ") + (runs.length > 20 ? ", ..." : "")],
        ["FLOPs", k.ops ?? ""], ["bytes", k.mem ?? ""], ["codegen", fmtMs(k.codegen_ms)],
        ["compile", fmtMs(k.compile_ms)], ["opts", (k.opts || []).join(" ") || "none"]]
      .map(([a, b]) => el("tr", {}, el("th", {}, a), el("td", {}, b))));
  main.append(el("h2", { id: "kernel-name" }, k.name), info);
  const cols = el("div", { class: "cols" });
  cols.append(el("div", {}, el("h3", {}, "Source"), k.src ? highlight(k.src) : el("p", {}, "(not compiled)")));
  cols.append(el("div", {}, el("h3", {}, `UOps (${(k.uops || []).length})`),
                 el("pre", { id: "kernel-uops" }, (k.uops || []).map((u, j) => `${String(j).padStart(4)} ${u}`).join("\n"))));
  main.append(cols);
  if (k.ast) main.append(el("h3", {}, "AST"), drawGraph(tableGraph(k.ast), "AST"));
}

function viewRewrites() {
  const groups = {};
  state.summary.rewrites.forEach((r, i) => { (groups[r.matcher] = groups[r.matcher] || []).push([r, i]); });
  main.append(el("h2", {}, `${state.summary.rewrites.length} graph rewrites`));
  const list = el("div", { id: "rewrite-list" });
  // a big program has thousands of rewrites per stage: a stage's rows are made when it is opened, the first
  // REWRITE_ROWS of them until asked for all
  const REWRITE_ROWS = 300;
  for (const [matcher, rs] of Object.entries(groups)) {
    const changed = rs.filter(([r]) => r.steps > 0).length;
    const det = el("details", { "data-matcher": matcher },
                   el("summary", {}, `${matcher}: ${rs.length} calls, ${changed} changed a graph`));
    const fill = (all) => {
      const shown = all ? rs : rs.slice(0, REWRITE_ROWS);
      const rows = shown.map(([r, i]) => el("tr", { class: "clickable rewrite-row", "data-index": i,
        onclick: () => { location.hash = `#rewrite/${i}/0`; } },
        el("td", {}, i), el("td", {}, r.name), el("td", {}, el("code", { class: "loc" }, r.caller)),
        el("td", { class: "num" }, r.steps), el("td", { class: "num" }, r.size), el("td", { class: "num" }, fmtMs(r.ms))));
      for (const old of det.querySelectorAll("table, button.more")) old.remove();
      det.append(el("table", {}, el("tr", {}, ...["#", "name", "called from", "steps", "nodes", "time"]
        .map((h) => el("th", {}, h))), ...rows));
      if (shown.length < rs.length) {
        det.append(el("button", { class: "more", onclick: () => fill(true) }, `show all ${rs.length}`));
      }
    };
    det.addEventListener("toggle", () => { if (det.open && !det.querySelector("table")) fill(false); });
    list.append(det);
    if (rs.length <= REWRITE_ROWS) { det.open = true; fill(false); }
  }
  main.append(list);
}

async function viewRewrite(i, k) {
  const r = state.summary.rewrites[i];
  main.append(el("h2", {}, `Rewrite ${i}: ${r.matcher} ${r.name}`),
              el("p", { class: "note" }, "called from ", el("code", { class: "loc" }, r.caller),
                 `; ${r.steps} steps, ${fmtMs(r.ms)}`));
  if (!r.steps) { main.append(el("p", {}, `No rule applied: the graph of ${r.size} nodes stayed as it was.`)); return; }
  const steps = el("ol", { class: "steps", start: 0, id: "step-list" });
  const data = await api(`rewrite/${i}/${k}`);
  for (let j = 0; j < r.steps; j++) {
    steps.append(el("li", { class: "step" + (j === k ? " selected" : ""), "data-step": j,
                            onclick: () => { location.hash = `#rewrite/${i}/${j}`; } }, `step ${j}`));
  }
  main.append(steps);
  const [loc, line] = state.summary.rules[data.rule];
  main.append(el("p", { id: "rule" }, `step ${k}: rule at `, el("code", { class: "loc" }, loc), " ", el("code", {}, line)));
  if (!data.in_graph) main.append(el("p", { class: "note" }, "(the node this rule replaced is not in the graph here)"));
  const cols = el("div", { class: "cols" });
  cols.append(el("div", { id: "graph-before" }, drawGraph(data.before, "before")),
              el("div", { id: "graph-after" }, drawGraph(data.after, "after")));
  main.append(cols);
  const sel = steps.querySelector(".selected");
  if (sel) sel.scrollIntoView({ block: "nearest" });
}

function viewFindings() {
  const fs = state.summary.findings;
  main.append(el("h2", {}, `${fs.length} findings`));
  if (!fs.length) { main.append(el("p", {}, "No check found a problem (JIT_VERIFY and DEBUG_NANS record theirs here).")); return; }
  main.append(el("table", { id: "findings-list", "data-count": fs.length },
    el("tr", {}, ...["#", "check", "at", "what it found"].map((h) => el("th", {}, h))),
    ...fs.map((f, i) => el("tr", { class: "finding-row", "data-kind": f.kind },
      el("td", {}, i), el("td", {}, f.kind), el("td", { class: "num" }, fmtUs(f.ts)),
      el("td", {}, el("pre", { class: "finding" }, f.message))))));
}

// *** the timeline ***

// tracks (one per process and thread) with nested spans stacked downwards, laid out once per trace
function timelineLayout(events) {
  const tracks = [], trackOf = {};
  for (const e of events) {
    const key = `${e.pid} / ${e.tid}`;
    if (!(key in trackOf)) { trackOf[key] = tracks.length; tracks.push({ key, depthEnds: [], rows: 1 }); }
  }
  const sorted = events.filter((e) => e.ph === "X").sort((a, b) => a.ts - b.ts || (b.dur || 0) - (a.dur || 0));
  const placed = sorted.map((e) => {
    const ti = trackOf[`${e.pid} / ${e.tid}`], t = tracks[ti];
    let d = 0;
    while (d < t.depthEnds.length && t.depthEnds[d] > e.ts + 1e-6) d++;
    t.depthEnds[d] = e.ts + (e.dur || 0);
    t.depthEnds.length = d + 1;
    t.rows = Math.max(t.rows, d + 1);
    return [e, ti, d];
  });
  const marks = events.filter((e) => e.ph === "i" || e.ph === "I").map((e) => [e, trackOf[`${e.pid} / ${e.tid}`]]);
  let t0 = Infinity, t1 = -Infinity;
  for (const e of events) { t0 = Math.min(t0, e.ts); t1 = Math.max(t1, e.ts + (e.dur || 0)); }
  return { tracks, placed, marks, t0, t1 };
}

const TIMELINE_COLORS = { kernel: "#42a5f5", copy: "#ffa726", compile: "#ab47bc", realize: "#78909c",
                          schedule: "#26a69a", run: "#8d6e63", jit: "#ef5350", collective: "#d4e157", view: "#bdbdbd",
                          chunk: "#90caf9" };

function viewTimeline() {
  const events = state.summary.profile.filter((e) => e.ph === "X" || e.ph === "i" || e.ph === "I");
  main.append(el("h2", {}, `Timeline: ${events.length} events`));
  if (!events.length) { main.append(el("p", {}, "No profile in this trace (run with PROFILE=1)."));  return; }
  const lay = state.timeline || (state.timeline = timelineLayout(events));
  const win = state.window || (state.window = [lay.t0, Math.max(lay.t1, lay.t0 + 1e-3)]);
  const width = Math.max(900, main.clientWidth - 40), LABEL = 160, ROW = 16;
  let y = 20;
  for (const t of lay.tracks) { t.y = y; y += t.rows * ROW + 10; }
  const box = el("div", { class: "timeline" });
  const zoom = (f, at) => {
    // zoom by f around time `at` (the window's middle by default), within the trace's span
    const [a, b] = state.window, mid = at === undefined ? (a + b) / 2 : at;
    const span = Math.min(lay.t1 - lay.t0 || 1e-3, Math.max(0.01, (b - a) * f));
    let na = mid - (mid - a) * span / (b - a);
    na = Math.max(lay.t0, Math.min(na, lay.t1 - span));
    state.window = [na, na + span];
    draw();
  };
  const pan = (f) => {
    const [a, b] = state.window, w = b - a;
    const na = Math.max(lay.t0, Math.min(a + f * w, lay.t1 - w));
    state.window = [na, na + w];
    draw();
  };
  const tools = el("div", { class: "timeline-tools" },
    el("button", { id: "zoom-in", onclick: () => zoom(0.5) }, "zoom in"),
    el("button", { id: "zoom-out", onclick: () => zoom(2) }, "zoom out"),
    el("button", { id: "zoom-fit", onclick: () => { state.window = [lay.t0, Math.max(lay.t1, lay.t0 + 1e-3)]; draw(); } }, "fit"),
    el("button", { id: "pan-left", onclick: () => pan(-0.5) }, "<"),
    el("button", { id: "pan-right", onclick: () => pan(0.5) }, ">"),
    el("span", { class: "note" }, " (wheel: zoom at the pointer; drag: move)"));
  const draw = () => {
    const [v0, v1] = state.window;
    const scale = (width - LABEL - 10) / Math.max(1e-9, v1 - v0);
    const svg = svgEl("svg", { width, height: y + 10, id: "timeline-svg", "data-t0": v0, "data-t1": v1 });
    const axis = svgEl("text", { x: LABEL, y: 12, id: "timeline-axis" });
    axis.textContent = `${fmtUs(v0 - lay.t0)} .. ${fmtUs(v1 - lay.t0)} of ${fmtUs(lay.t1 - lay.t0)}`;
    svg.append(axis);
    for (const t of lay.tracks) {
      const lab = svgEl("text", { x: 4, y: t.y + 11 });
      lab.textContent = t.key;
      svg.append(lab);
    }
    // only what is in the window is drawn: a big trace zoomed in stays light
    for (const [e, ti, d] of lay.placed) {
      const end = e.ts + (e.dur || 0);
      if (end < v0 || e.ts > v1) continue;
      const x0 = Math.max(e.ts, v0), x1 = Math.min(end, v1);
      const rect = svgEl("rect", { x: LABEL + (x0 - v0) * scale, y: lay.tracks[ti].y + d * ROW,
                                   width: Math.max(1, (x1 - x0) * scale), height: ROW - 2,
                                   class: "bar", "data-cat": e.cat || "", fill: TIMELINE_COLORS[e.cat] || "#9e9e9e" });
      const title = svgEl("title", {});
      title.textContent = `${e.name} (${e.cat}) ${fmtUs(e.dur)}` + (e.args ? " " + JSON.stringify(e.args) : "");
      rect.append(title);
      svg.append(rect);
    }
    for (const [e, ti] of lay.marks) {
      if (e.ts < v0 || e.ts > v1) continue;
      const x = LABEL + (e.ts - v0) * scale, ty = lay.tracks[ti].y;
      const m = svgEl("path", { d: `M${x},${ty} l5,${ROW - 2} l-10,0 z`, class: "marker", "data-cat": e.cat || "" });
      const title = svgEl("title", {});
      title.textContent = `${e.name}: ${(e.args && e.args.message) || ""}`;
      m.append(title);
      svg.append(m);
    }
    svg.addEventListener("wheel", (ev) => {
      ev.preventDefault();
      const at = v0 + (ev.offsetX - LABEL) / scale;
      zoom(ev.deltaY < 0 ? 0.8 : 1.25, Math.max(v0, Math.min(v1, at)));
    });
    svg.addEventListener("mousedown", (ev) => {
      const startX = ev.clientX, [a, b] = state.window;
      const move = (mv) => {
        const w = b - a, na = Math.max(lay.t0, Math.min(a - (mv.clientX - startX) / scale, lay.t1 - w));
        state.window = [na, na + w];
      };
      const up = () => { window.removeEventListener("mousemove", move); window.removeEventListener("mouseup", up); draw(); };
      window.addEventListener("mousemove", move);
      window.addEventListener("mouseup", up);
    });
    box.textContent = "";
    box.append(svg);
  };
  main.append(tools, box);
  draw();
}

// *** routing ***

async function route() {
  const parts = (location.hash || "#kernels").slice(1).split("/");
  const tab = { schedule: "schedules", kernel: "kernels", rewrite: "rewrites" }[parts[0]] || parts[0];
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.tab === tab);
  main.textContent = "";
  document.body.dataset.view = parts[0];
  const n = parts.slice(1).map(Number);
  if (parts[0] === "schedules") viewSchedules();
  else if (parts[0] === "schedule") await viewSchedule(n[0]);
  else if (parts[0] === "kernel") await viewKernel(n[0]);
  else if (parts[0] === "rewrites") viewRewrites();
  else if (parts[0] === "rewrite") await viewRewrite(n[0], n[1] || 0);
  else if (parts[0] === "timeline") viewTimeline();
  else if (parts[0] === "findings") viewFindings();
  else viewKernels();
  document.body.dataset.ready = location.hash;
}

async function start() {
  try {
    state.summary = await api("summary");
    const s = state.summary;
    document.getElementById("status").textContent =
      `${s.schedules.length} schedules, ${s.kernels.length} kernels, ${s.rewrites.length} rewrites, ${s.profile.length} profile events` +
      (s.findings.length ? `, ${s.findings.length} findings` : "");
    window.addEventListener("hashchange", () => route().catch((e) => reportError("error: " + e.message)));
    await route();
  } catch (e) {
    reportError("error: " + e.message);
  }
}
start();
