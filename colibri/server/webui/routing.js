"use strict";
// The live routing view of the page at /: the counts of every (MoE layer, expert) pair over
// the generated tokens of the conversation, drawn as a layer x expert heat map and as the
// expert utilisation of one layer (plain SVG), and the colours tokens get from their experts.
// Input: per token, the server's routing extension: M arrays (one per MoE layer) of K expert ids.

const SVG_NS = "http://www.w3.org/2000/svg";

// expert e's hue: golden-angle steps, so neighbouring ids never look alike
function expertColour(e, lightness) {
  return `hsl(${((e * 137.508) % 360).toFixed(1)}, 62%, ${lightness}%)`;
}

// x in [0, 1] -> white .. deep blue (a sequential ramp: more tokens, darker cell)
const HEAT_STOPS = [[255, 255, 255], [222, 235, 247], [158, 202, 225], [66, 146, 198],
                    [8, 81, 156], [8, 38, 84]];
function heatColour(x) {
  if (!(x > 0)) return "rgb(255,255,255)";
  const f = Math.min(1, x) * (HEAT_STOPS.length - 1);
  const i = Math.min(HEAT_STOPS.length - 2, Math.floor(f));
  const t = f - i, a = HEAT_STOPS[i], b = HEAT_STOPS[i + 1];
  const c = a.map((v, k) => Math.round(v + (b[k] - v) * t));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

function svg(tag, attrs, parent) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  if (parent) parent.appendChild(el);
  return el;
}

class RoutingView {
  // els: {heatmap, utilisation, layer (select), heatTotal, utilNote, legend}
  constructor(els) {
    this.els = els;
    this.layers = []; this.E = 0; this.K = 0;
    this.counts = new Float64Array(0);   // (M * E): tokens routed to (layer m, expert e)
    this.tokens = 0;
    this.now = null;                     // the routing of the last token (outlined cells)
    this.pending = false;
    els.layer.addEventListener("change", () => { this.draw(); this.onLayer && this.onLayer(); });
    let resized = null;                  // the plots follow the pane's width
    window.addEventListener("resize", () => {
      clearTimeout(resized);
      resized = setTimeout(() => this.rebuild(), 150);
    });
  }

  rebuild() {
    if (!this.E) return;
    this.buildHeatmap();
    this.buildUtilisation();
    this.draw();
  }

  // moeLayers: the model's MoE layer indices; E experts per layer, K per token
  configure(moeLayers, E, K) {
    this.layers = moeLayers.slice(); this.E = E; this.K = K;
    this.counts = new Float64Array(this.layers.length * E);
    this.tokens = 0; this.now = null;
    const sel = this.els.layer;
    sel.textContent = "";
    this.layers.forEach((layer, m) => {
      const o = document.createElement("option");
      o.value = String(m); o.textContent = `layer ${layer}`;
      sel.appendChild(o);
    });
    sel.value = String(this.layers.length - 1);
    this.rebuild();
  }

  get layerIndex() { return Number(this.els.layer.value) || 0; }

  reset() {
    this.counts.fill(0); this.tokens = 0; this.now = null; this.draw();
  }

  // one generated token's routing: [M][K] expert ids
  add(routing) {
    const M = this.layers.length;
    if (!Array.isArray(routing) || routing.length !== M) return false;
    for (let m = 0; m < M; m++) {
      for (const e of routing[m]) {
        if (e >= 0 && e < this.E) this.counts[m * this.E + e] += 1;
      }
    }
    this.tokens += 1; this.now = routing;
    if (!this.pending) {             // draw at most once a frame, however fast tokens come
      this.pending = true;
      requestAnimationFrame(() => { if (this.pending) this.draw(); });
    }
    return true;
  }

  // draw now what add() left for the next frame (the end of a reply is drawn with it)
  flush() {
    if (this.pending) this.draw();
  }

  // a token span's background: one band per expert of the chosen layer, top to bottom in the
  // order the server lists them (by descending routing weight)
  paint(span) {
    const routing = span.routing && span.routing[span.routing.length - 1];
    if (!routing) return;
    const experts = routing[this.layerIndex] || [];
    const n = experts.length;
    const bands = experts.map((e, i) =>
      `${expertColour(e, 80)} ${(100 * i / n).toFixed(1)}% ${(100 * (i + 1) / n).toFixed(1)}%`);
    span.style.background = n ? `linear-gradient(180deg, ${bands.join(", ")})` : "";
    span.dataset.experts = experts.join(",");
  }

  describe(routings) {
    return routings.map((r) => r.map((ex, m) => `layer ${this.layers[m]}: ${ex.join(", ")}`)
      .join("\n")).join("\n--\n");
  }

  // -- drawing ---------------------------------------------------------------------------------
  // the pixels a plot may take across: the pane's width, less the axis labels
  width() { return Math.max(240, (this.els.heatmap.clientWidth || 480) - 60); }

  buildHeatmap() {
    const M = this.layers.length, E = this.E, left = 40, top = 16;
    const w = Math.max(4, Math.min(30, Math.floor(this.width() / Math.max(1, E))));
    const h = Math.max(w, M > 40 ? 6 : 10);     // rows stay tall enough to find a layer
    const root = svg("svg", {width: left + E * w + 4, height: top + M * h + 4,
                             viewBox: `0 0 ${left + E * w + 4} ${top + M * h + 4}`,
                             class: w < 12 || h < 12 ? "dense" : "",
                             role: "img", "aria-label": "tokens per layer and expert"});
    const step = Math.ceil(16 / w);           // label every step-th expert: labels never overlap
    for (let e = 0; e < E; e += step) {
      svg("text", {x: left + e * w + w / 2, y: top - 4, "text-anchor": "middle"}, root)
        .textContent = String(e);
    }
    const rowStep = Math.ceil(11 / h);
    this.cells = [];
    for (let m = 0; m < M; m++) {
      if (m % rowStep === 0 || m === M - 1) {
        svg("text", {x: left - 4, y: top + m * h + h / 2 + 3.5, "text-anchor": "end"}, root)
          .textContent = `L${this.layers[m]}`;
      }
      for (let e = 0; e < E; e++) {
        const r = svg("rect", {class: "cell", x: left + e * w, y: top + m * h, width: w,
                               height: h, fill: "#fff", "data-layer": this.layers[m],
                               "data-expert": e, "data-count": 0}, root);
        svg("title", {}, r);
        this.cells.push(r);
      }
    }
    this.rowMark = svg("rect", {class: "rowmark", x: left - 1, width: E * w + 2, height: h},
                       root);
    this.geometry = {left, top, s: h};
    this.drawn = new Float64Array(M * E).fill(-1);    // the count each cell shows
    this.drawnMax = -1;
    this.outlined = new Set();
    this.els.heatmap.textContent = "";
    this.els.heatmap.appendChild(root);
  }

  buildUtilisation() {
    const E = this.E, w = Math.max(4, Math.min(30, Math.floor(this.width() / Math.max(1, E))));
    const h = 120;
    const left = 34, top = 6, bottom = 16;
    const root = svg("svg", {width: left + E * w + 4, height: top + h + bottom,
                             viewBox: `0 0 ${left + E * w + 4} ${top + h + bottom}`,
                             role: "img", "aria-label": "expert utilisation"});
    this.axis = [0.5, 1].map((f) => ({
      line: svg("line", {x1: left - 3, x2: left, y1: top + h * (1 - f), y2: top + h * (1 - f),
                         stroke: "#999"}, root),
      label: svg("text", {x: left - 5, y: top + h * (1 - f) + 3, "text-anchor": "end"}, root),
      f}));
    svg("line", {x1: left, x2: left + E * w, y1: top + h, y2: top + h, stroke: "#999"}, root);
    this.bars = [];
    const step = Math.ceil(16 / w);
    for (let e = 0; e < E; e++) {
      const all = svg("rect", {class: "all", x: left + e * w + 1, width: w - 2, y: top + h,
                               height: 0}, root);
      const bar = svg("rect", {class: "bar", x: left + e * w + w * 0.25, width: w * 0.5,
                               y: top + h, height: 0, fill: expertColour(e, 55),
                               "data-expert": e}, root);
      svg("title", {}, bar);
      if (e % step === 0) {
        svg("text", {x: left + e * w + w / 2, y: top + h + 12, "text-anchor": "middle"}, root)
          .textContent = String(e);
      }
      this.bars.push({all, bar});
    }
    this.uniform = svg("line", {class: "uniform", x1: left, x2: left + E * w}, root);
    this.ugeom = {left, top, h, w};
    this.els.utilisation.textContent = "";
    this.els.utilisation.appendChild(root);
  }

  draw() {
    this.pending = false;
    if (!this.cells) return;
    const E = this.E, M = this.layers.length, m0 = this.layerIndex;
    let max = 0;
    for (const c of this.counts) max = Math.max(max, c);
    const now = new Set();
    if (this.now) this.now.forEach((ex, m) => ex.forEach((e) => now.add(m * E + e)));
    // touch only the cells whose count changed (all of them when the darkest one did): a
    // model of 48 layers x 128 experts has 6144 cells, redrawn up to once a frame
    const all = max !== this.drawnMax;
    for (let i = 0; i < this.cells.length; i++) {
      const c = this.counts[i], r = this.cells[i];
      if (all || c !== this.drawn[i]) {
        r.setAttribute("fill", heatColour(max ? c / max : 0));
        r.setAttribute("data-count", c);
        r.firstChild.textContent =
          `layer ${this.layers[Math.floor(i / E)]}, expert ${i % E}: ${c} tokens`;
        this.drawn[i] = c;
      }
      if (now.has(i) !== this.outlined.has(i)) r.classList.toggle("now", now.has(i));
    }
    this.drawnMax = max;
    this.outlined = now;
    const g = this.geometry;
    this.rowMark.setAttribute("y", g.top + m0 * g.s);
    this.els.heatTotal.textContent = this.tokens
      ? `${this.tokens} tokens × ${M} layers × top-${this.K}; darkest: ${max}` : "no tokens yet";
    this.els.heatmap.dataset.tokens = String(this.tokens);
    this.drawUtilisation(m0);
  }

  // the share of tokens each expert of layer m0 took (coloured), and the mean over all MoE
  // layers (grey); the dashed line is the uniform share K / E
  drawUtilisation(m0) {
    const E = this.E, M = this.layers.length, T = this.tokens, u = this.ugeom;
    const shares = [], means = [];
    for (let e = 0; e < E; e++) {
      let sum = 0;
      for (let m = 0; m < M; m++) sum += this.counts[m * E + e];
      shares.push(T ? this.counts[m0 * E + e] / T : 0);
      means.push(T ? sum / (M * T) : 0);
    }
    const uniform = this.K / E;
    const top = Math.max(uniform * 1.5, ...shares, ...means) * 1.05;
    const y = (v) => u.top + u.h * (1 - v / top);
    for (let e = 0; e < E; e++) {
      const {all, bar} = this.bars[e];
      all.setAttribute("y", y(means[e])); all.setAttribute("height", u.top + u.h - y(means[e]));
      bar.setAttribute("y", y(shares[e])); bar.setAttribute("height", u.top + u.h - y(shares[e]));
      bar.setAttribute("data-share", shares[e].toFixed(4));
      bar.firstChild.textContent = `expert ${e}: ${(100 * shares[e]).toFixed(1)}% of tokens in ` +
        `layer ${this.layers[m0]}, ${(100 * means[e]).toFixed(1)}% over all MoE layers`;
    }
    this.uniform.setAttribute("y1", y(uniform)); this.uniform.setAttribute("y2", y(uniform));
    for (const a of this.axis) a.label.textContent = `${Math.round(100 * top * a.f)}%`;
    if (!T) {
      this.els.utilNote.textContent = "";
    } else {
      let busiest = 0;
      shares.forEach((s, e) => { if (s > shares[busiest]) busiest = e; });
      const idle = shares.filter((s) => s === 0).length;
      this.els.utilNote.textContent = `layer ${this.layers[m0]}: expert ${busiest} takes ` +
        `${(100 * shares[busiest]).toFixed(0)}% of tokens (uniform ${(100 * uniform).toFixed(0)}%)` +
        (idle ? `, ${idle} idle` : "");
    }
    this.els.legend.textContent = `bars: share of the tokens routed to each expert in the ` +
      `chosen layer (its colour is the tokens' colour); grey: the mean over all ${M} MoE ` +
      `layers; dashed: the uniform share top-${this.K} / ${E} experts.`;
  }
}

window.RoutingView = RoutingView;
