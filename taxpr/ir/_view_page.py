"""The viewer page's template: its style and script, the project's own (no
library, nothing loaded from the network). ``%TITLE%`` and ``%DATA%`` (the
JSON of ``_view.page_data``) are filled in by ``_view.render_page``.

The script draws a container's children only when it is opened, a few
hundred at a time, so that a page of 50,000 equations opens as fast as a
small one; ``window.taxprView`` exposes its state to tests."""

PAGE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>%TITLE%</title>
<style>
:root{--fg:#1d2329;--dim:#6a737d;--bg:#fff;--line:#e4e7eb;--hl:#fff3b0;--prod:#cde8ff;--cons:#d9f5d6;
--rm:#ffd7d5;--add:#d4f7d4;--rw:#ffe9bf;--tag:#f3e3ff;--acc:#0b63c5}
*{box-sizing:border-box}
body{margin:0;font:13px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;color:var(--fg);background:var(--bg);
display:flex;flex-direction:column;height:100vh}
header{display:flex;gap:12px;align-items:center;padding:6px 10px;border-bottom:1px solid var(--line);flex-wrap:wrap}
header h1{font-size:15px;margin:0;font-weight:600}
header .stats{color:var(--dim)}
#q{width:320px;padding:4px 8px;border:1px solid #c8ccd1;border-radius:4px;font:inherit}
button{font:inherit;padding:2px 8px;border:1px solid #c8ccd1;background:#f6f8fa;border-radius:4px;cursor:pointer}
#main{flex:1;display:flex;min-height:0}
.panes{flex:1;display:flex;min-width:0}
.pane{flex:1;overflow:auto;padding:6px 8px;border-right:1px solid var(--line);min-width:0}
.pane>.title{font-weight:600;margin-bottom:4px;position:sticky;top:-6px;background:var(--bg);padding:2px 0;z-index:1}
#side{width:360px;overflow:auto;padding:8px 10px;border-left:1px solid var(--line);background:#fafbfc}
#side h2{font-size:13px;margin:10px 0 4px}
.mono,.e,.h,.r{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px}
.e{white-space:nowrap;padding:0 4px;border-radius:3px;cursor:default}
.e:hover,.h:hover{background:#f1f3f5}
.c>.h{white-space:nowrap;cursor:pointer;padding:0 4px;border-radius:3px}
.kids{margin-left:16px;border-left:1px dotted #c8ccd1;padding-left:4px}
.tw{display:inline-block;width:12px;color:var(--dim)}
.k{font-weight:600;color:#8a3ffc}.k.scope{color:#0b7a75}.k.sub{color:#b3541e}
.cnt{color:var(--dim);margin-left:6px}
.badge{margin-left:6px;padding:0 5px;border-radius:8px;background:var(--rw);font-size:11px}
.prim{font-weight:600}
.v{cursor:pointer;border-radius:2px}.v:hover{text-decoration:underline}
.v i{font-style:normal;color:var(--dim)}
.lit{color:#9a6700}
.par{color:var(--dim)}
.src{color:var(--dim);margin-left:10px}
.site{color:var(--acc);margin-left:10px}
.tagged{background:var(--tag)}
.tg{background:#8a3ffc;color:#fff;border-radius:3px;padding:0 4px;margin-right:4px;font-size:11px}
.m-r{background:var(--rm)}.m-a{background:var(--add)}.m-w{background:var(--rw)}
.prod{outline:2px solid #2f81f7;background:var(--prod)}
.cons{outline:2px solid #2da44e;background:var(--cons)}
.v.selv{background:var(--hl);outline:1px solid #d4a72c}
.sel{box-shadow:inset 3px 0 0 #d4a72c;background:var(--hl)}
.more{margin:2px 0 2px 4px}
.r{padding:1px 4px;cursor:pointer;border-radius:3px;white-space:nowrap;overflow:hidden;text-overflow:ellipsis}
.r:hover{background:#eef2f6}
.copy{font-size:11px;padding:0 5px;margin-left:4px}
.kv{color:var(--dim)}
</style></head>
<body>
<header><h1>%TITLE%</h1><input id="q" type="search" placeholder="search: site name, primitive, file:line, scope" autocomplete="off">
<span class="stats" id="stats"></span><span id="changes"></span></header>
<div id="main"><div class="panes" id="panes"></div><div id="side">
<div id="detail"><p class="kv">Click an equation or a value: where a value comes from is outlined blue,
where it goes green.</p></div>
<div id="results"></div><div id="tags"></div></div></div>
<script type="application/json" id="data">%DATA%</script>
<script>
"use strict";
(function () {
const D = JSON.parse(document.getElementById("data").textContent);
const CHUNK = 300;
const esc = s => String(s).replace(/[&<>"]/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));
function vname(i) { let s = ""; i += 1; while (i > 0) { i -= 1; s = String.fromCharCode(97 + i % 26) + s; i = Math.floor(i / 26); } return s; }

class Pane {
  constructor(d, k) {
    Object.assign(this, d); this.k = k;
    const N = this.N, E = this.E;
    this.count = new Int32Array(N.length); this.marks = new Int32Array(N.length);
    for (let e = 0; e < E.length; e++) {
      const m = E[e][6] !== "";
      for (let n = E[e][5]; n >= 0; n = N[n][2]) { this.count[n]++; if (m) this.marks[n]++; }
    }
    this.cons = null; this.outsOf = null; this.hay = null;
    this.subOf = new Map();  // an equation with sub-jaxprs -> its first container
    N.forEach((n, i) => { if (n[0] === "sub" && !this.subOf.has(n[4])) this.subOf.set(n[4], i); });
  }
  item(it) { return it >= 0 && this.subOf.has(it) ? -this.subOf.get(it) - 1 : it; }
  el(it) {  // the element standing for an equation or container (a container's header), drawn
    it = this.item(it);
    const x = this.reveal(it);
    return x && it < 0 ? x.firstElementChild : x;
  }
  consumers() {  // value id -> the equations using it, and the containers returning it
    if (this.cons) return this.cons;
    const cons = this.cons = new Map(), outsOf = this.outsOf = new Map();
    this.E.forEach((q, e) => { for (const a of q[1]) if (typeof a === "number") { if (!cons.has(a)) cons.set(a, []); cons.get(a).push(e); } });
    this.N.forEach((n, i) => { for (const a of n[6]) if (typeof a === "number") { if (!outsOf.has(a)) outsOf.set(a, []); outsOf.get(a).push(i); } });
    return cons;
  }
  val(v) { return `<span class="v" data-p="${this.k}" data-v="${v}">${vname(v)}<i>:${esc(this.T[this.V[v][0]])}</i></span>`; }
  atom(a) { return typeof a === "number" ? this.val(a) : `<span class="lit">${esc(a)}</span>`; }
  line(e) {
    const q = this.E[e];
    const outs = q[2].map(o => o < 0 ? "_" : this.val(o)).join(", ");
    const tg = q[7] ? `<span class="tg">${esc(q[7][0])}</span>` : "";
    return `${tg}${outs}${outs ? " = " : ""}<span class="prim">${esc(this.P[q[0]])}</span> ${q[1].map(a => this.atom(a)).join(" ")}`;
  }
  par(e) {  // the params, cut short (the detail panel shows them whole)
    const i = this.E[e][8]; if (i < 0) return "";
    const t = this.Q[i];
    return ` <span class="par">[${esc(t.length > 60 ? t.slice(0, 57) + "..." : t)}]</span>`;
  }
  eqnHTML(e) {
    const q = this.E[e];
    const cls = "e" + (q[6] ? " m-" + q[6] : "") + (q[7] ? " tagged" : "");
    const src = q[3] >= 0 ? `<span class="src">${esc(this.S[q[3]])}</span>` : "";
    const site = q[4].length ? `<span class="site">${esc(q[4][0])}${q[4].length > 1 ? " +" + (q[4].length - 1) : ""}</span>` : "";
    return `<div class="${cls}" id="p${this.k}e${e}" data-p="${this.k}" data-e="${e}">${this.line(e)}${src}${site}${this.par(e)}</div>`;
  }
  nodeHTML(n) {
    const nd = this.N[n], kind = nd[0];
    const head = kind === "sub" ? ` <span class="eqline">${this.line(nd[4])}</span>` : "";
    const badge = this.marks[n] ? `<span class="badge">${this.marks[n]} changed</span>` : "";
    const cls = "c" + (kind === "sub" && this.E[nd[4]][6] ? " m-" + this.E[nd[4]][6] : "");
    return `<div class="${cls}" id="p${this.k}n${n}" data-p="${this.k}" data-n="${n}"><div class="h"><span class="tw">&#9656;</span>` +
      `<span class="k ${kind}">${esc(nd[1])}</span>${head}<span class="cnt">${this.count[n]} eqns</span>${badge}</div>` +
      `<div class="kids" hidden></div></div>`;
  }
  kidsEl(n) { return n === 0 ? this.root : document.getElementById(`p${this.k}n${n}`).lastElementChild; }
  drawMore(n, upto) {  // draw container n's children up to index upto (a chunk at least)
    const el = this.kidsEl(n), kids = this.N[n][3];
    let done = +(el.dataset.drawn || 0);
    const end = Math.min(kids.length, Math.max(done + CHUNK, upto + 1));
    if (done >= end) return;
    const old = el.querySelector(":scope > .more"); if (old) old.remove();
    let html = "";
    for (let i = done; i < end; i++) { const c = kids[i]; html += c >= 0 ? this.eqnHTML(c) : this.nodeHTML(-c - 1); }
    el.insertAdjacentHTML("beforeend", html);
    el.dataset.drawn = end;
    if (end < kids.length) el.insertAdjacentHTML("beforeend", `<button class="more" data-p="${this.k}" data-n="${n}">show ${Math.min(CHUNK, kids.length - end)} more of ${kids.length - end}</button>`);
  }
  open(n, yes = true) {
    if (n === 0) return;
    const c = document.getElementById(`p${this.k}n${n}`);
    const kids = c.lastElementChild;
    if (yes && !kids.dataset.drawn) this.drawMore(n, 0);
    kids.hidden = !yes; c.classList.toggle("open", yes);
    c.firstElementChild.firstElementChild.innerHTML = yes ? "&#9662;" : "&#9656;";
  }
  reveal(item) {  // item: an equation e (>= 0) or a container -n-1; returns its element
    item = this.item(item);
    const chain = [];
    let parent = item >= 0 ? this.E[item][5] : this.N[-item - 1][2];
    let child = item;
    while (parent >= 0) { chain.push([parent, child]); child = -parent - 1; parent = this.N[parent][2]; }
    for (let i = chain.length - 1; i >= 0; i--) {
      const [n, c] = chain[i];
      this.open(n);
      this.drawMore(n, this.N[n][3].indexOf(c));
    }
    return document.getElementById(item >= 0 ? `p${this.k}e${item}` : `p${this.k}n${-item - 1}`);
  }
  producers(v) {  // [element ids], following a body's inputs to the operands bound to them
    const out = [], seen = new Set();
    while (v !== undefined && !seen.has(v)) {
      seen.add(v);
      const p = this.V[v][1];
      if (p === null) break;
      if (p >= 0) { out.push(p); break; }
      out.push(p);  // the container whose input it is
      v = this.B[v];
    }
    return out;
  }
}

const panes = D.panes.map((d, k) => new Pane(d, k));
const host = document.getElementById("panes");
for (const p of panes) {
  const el = document.createElement("div"); el.className = "pane"; el.id = "pane" + p.k;
  el.innerHTML = `<div class="title">${esc(p.label)} <span class="cnt">${p.E.length} equations, ${p.N.length - 1} containers</span></div><div class="kids root"></div>`;
  host.appendChild(el); p.root = el.lastElementChild; p.drawMore(0, 0);
}
const nE = panes.reduce((s, p) => s + p.E.length, 0);
document.getElementById("stats").textContent = `${nE} equations` + (panes.length > 1 ? " in two programs" : "");
const detail = document.getElementById("detail"), results = document.getElementById("results");

let marked = [];
function clearMarks() { for (const el of marked) el.classList.remove("prod", "cons", "selv", "sel"); marked = []; }
function mark(el, cls) { if (el) { el.classList.add(cls); marked.push(el); } }
function itemEl(p, it) { return p.el(it); }
function headOf(p, n) { return p.el(-n - 1); }
function link(p, it, text) { return `<div class="r" data-p="${p.k}" data-i="${it}">${text}</div>`; }
function describe(p, it) {
  if (it >= 0) { const q = p.E[it]; return `${esc(p.P[q[0]])} <span class="kv">${q[3] >= 0 ? esc(p.S[q[3]]) : ""}</span>`; }
  const n = -it - 1; return `${p.N[n][0] === "sub" ? "input of" : ""} ${esc(p.N[n][1])}`;
}

function selectValue(p, v) {
  clearMarks();
  const prods = p.producers(v), cons = (p.consumers().get(v) || []), outs = p.outsOf.get(v) || [];
  for (const it of prods) mark(it >= 0 ? itemEl(p, it) : headOf(p, -it - 1), "prod");
  for (const e of cons.slice(0, 500)) mark(itemEl(p, e), "cons");
  for (const n of outs) if (n > 0) mark(headOf(p, n), "cons");
  document.querySelectorAll(`.v[data-p="${p.k}"][data-v="${v}"]`).forEach(el => mark(el, "selv"));
  const first = prods.length ? itemEl(p, prods[prods.length - 1]) : null;
  if (first) first.scrollIntoView({block: "center"});
  detail.innerHTML = `<h2>value <span class="mono">${vname(v)}:${esc(p.T[p.V[v][0]])}</span></h2>` +
    `<h2>comes from</h2>${prods.length ? prods.map(it => link(p, it, describe(p, it))).join("") : '<p class="kv">an input or constant of the program</p>'}` +
    `<h2>goes to (${cons.length + outs.length})</h2>${cons.slice(0, 200).map(e => link(p, e, describe(p, e))).join("")}` +
    outs.map(n => link(p, -n - 1, "returned by " + esc(p.N[n][1]))).join("");
  window.taxprView.selected = {pane: p.k, value: v, producers: prods, consumers: cons};
}

function copy(text, btn) {
  const done = () => { if (btn) { btn.textContent = "copied"; setTimeout(() => btn.textContent = "copy", 900); } };
  if (navigator.clipboard && window.isSecureContext) { navigator.clipboard.writeText(text).then(done, () => fallback()); } else fallback();
  function fallback() { const t = document.createElement("textarea"); t.value = text; document.body.appendChild(t); t.select(); try { document.execCommand("copy"); } catch (_) {} t.remove(); done(); }
}

function selectEqn(p, e) {
  clearMarks();
  const el = itemEl(p, e); mark(el, "sel"); if (el) el.scrollIntoView({block: "nearest"});
  const q = p.E[e];
  const sites = q[4].map(s => `<div class="mono">${esc(s)} <button class="copy" data-copy="${esc(JSON.stringify(s))}">copy</button></div>`).join("");
  detail.innerHTML = `<h2>equation</h2><div class="mono">${p.line(e)}</div>` +
    (q[8] >= 0 ? `<h2>params</h2><div class="mono kv">${esc(p.Q[q[8]])}</div>` : "") +
    `<h2>source</h2><div class="mono">${q[3] >= 0 ? esc(p.S[q[3]]) : "unknown"}</div>` +
    (q[7] ? `<h2>taxpr ${esc(q[7][0])}</h2><div class="mono">${esc(q[7][1])}</div>` : "") +
    (sites ? `<h2>site (tx.capture / tx.patch selector)</h2>${sites}` : "") +
    `<h2>in</h2><div class="kv">${esc(p.N[q[5]][1])}</div>`;
  window.taxprView.selected = {pane: p.k, eqn: e};
}

function goto(p, it) {
  const el = itemEl(p, it);
  if (!el) return;
  clearMarks(); mark(el, "sel"); el.scrollIntoView({block: "center"});
}

// ---- search
let timer = 0;
function search(text) {
  const q = text.trim().toLowerCase();
  if (!q) { results.innerHTML = ""; return []; }
  const found = [];
  for (const p of panes) {
    if (!p.hay) p.hay = p.E.map(x => (x[4].join(" ") + " " + p.P[x[0]] + " " + (x[3] >= 0 ? p.S[x[3]] : "") + (x[7] ? " " + x[7].join(" ") : "")).toLowerCase());
    p.N.forEach((n, i) => { if (i > 0 && (n[1].toLowerCase().includes(q) || (n[0] === "scope" && n[7].toLowerCase().includes(q)))) found.push([p, -i - 1]); });
    p.hay.forEach((h, e) => { if (h.includes(q)) found.push([p, e]); });
  }
  results.innerHTML = `<h2>${found.length} found</h2>` + found.slice(0, 300).map(([p, it]) => {
    if (it < 0) return link(p, it, `<span class="k">${esc(p.N[-it - 1][0])}</span> ${esc(p.N[-it - 1][7] || p.N[-it - 1][1])}`);
    const x = p.E[it];
    return link(p, it, `${x[4].length ? esc(x[4][0]) : esc(p.P[x[0]])} <span class="kv">${x[3] >= 0 ? esc(p.S[x[3]]) : ""}</span>`);
  }).join("");
  window.taxprView.found = found.map(([p, it]) => [p.k, it]);
  return found;
}
const box = document.getElementById("q");
box.addEventListener("input", ev => { clearTimeout(timer); timer = setTimeout(() => search(ev.target.value), 120); });
box.addEventListener("keydown", ev => {  // Enter: the first match; Escape: clear
  if (ev.key === "Enter") { clearTimeout(timer); const f = search(box.value); if (f.length) { goto(f[0][0], f[0][1]); if (f[0][1] >= 0) selectEqn(f[0][0], f[0][1]); } }
  else if (ev.key === "Escape") { box.value = ""; search(""); }
});

// ---- tags, states, sows, keys
const tagItems = [];
for (const p of panes) p.E.forEach((q, e) => { if (q[7]) tagItems.push([p, e]); });
document.getElementById("tags").innerHTML = tagItems.length ? `<h2>taxpr tags (${tagItems.length})</h2>` + tagItems.slice(0, 1000).map(([p, e]) => link(p, e, `<span class="tg">${esc(p.E[e][7][0])}</span>${esc(p.E[e][7][1])} <span class="kv">${p.E[e][3] >= 0 ? esc(p.S[p.E[e][3]]) : ""}</span>`)).join("") : "";

// ---- compare
if (D.compare) {
  const c = D.compare;
  document.getElementById("changes").innerHTML = `<span class="m-r">&nbsp;${c.removed} removed&nbsp;</span> <span class="m-a">&nbsp;${c.added} added&nbsp;</span> <span class="m-w">&nbsp;${c.rewritten} rewritten&nbsp;</span> <button id="next">next change</button>`;
  let at = -1;
  const changes = [];
  panes.forEach(p => p.E.forEach((q, e) => { if (q[6]) changes.push([p, e]); }));
  document.getElementById("next").addEventListener("click", () => { if (!changes.length) return; at = (at + 1) % changes.length; goto(changes[at][0], changes[at][1]); });
}

// ---- clicks
document.addEventListener("click", ev => {
  const t = ev.target;
  const v = t.closest(".v"); if (v) { ev.stopPropagation(); selectValue(panes[+v.dataset.p], +v.dataset.v); return; }
  const cp = t.closest(".copy"); if (cp) { copy(JSON.parse(cp.dataset.copy), cp); return; }
  const more = t.closest(".more"); if (more) { const p = panes[+more.dataset.p], n = +more.dataset.n; p.drawMore(n, +(p.kidsEl(n).dataset.drawn || 0)); return; }
  const r = t.closest(".r"); if (r) { goto(panes[+r.dataset.p], +r.dataset.i); if (+r.dataset.i >= 0) selectEqn(panes[+r.dataset.p], +r.dataset.i); return; }
  const h = t.closest(".h"); if (h) { const c = h.parentElement, p = panes[+c.dataset.p]; p.open(+c.dataset.n, c.lastElementChild.hidden); return; }
  const e = t.closest(".e"); if (e) { selectEqn(panes[+e.dataset.p], +e.dataset.e); }
});

window.taxprView = {data: D, panes, search, selectValue: (k, v) => selectValue(panes[k], v),
  selectEqn: (k, e) => selectEqn(panes[k], e), reveal: (k, it) => panes[k].reveal(it),
  open: (k, n) => panes[k].open(n), readyMs: performance.now(), selected: null, found: []};
})();
</script></body></html>
"""
