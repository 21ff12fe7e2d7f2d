/* The script of one report (see fragment.html.j2, which calls this function with the report's root id and
   the script element running it). It draws inside that report's shadow root only. */
(function draw(rootId, script, decoded) {
  "use strict";
  /* This report's root: the element holding this script, else the first element of that id not drawn yet. */
  function withId(id) { return document.querySelectorAll('[id="' + id + '"]'); }
  var root = script && script.parentNode;
  if (!root || root.id !== rootId || root.shadowRoot) {
    root = null;
    Array.prototype.forEach.call(withId(rootId), function (node) { if (!root && !node.shadowRoot) root = node; });
  }
  if (!root || !root.attachShadow) return;
  var markup = root.querySelector(":scope > .mh-markup > template").content;
  /* report: Inspection.to_dict(), as in inspect.json; view: what only the page needs. */
  var payload = decoded || JSON.parse(markup.getElementById("report-data").textContent);
  /* A long report's weights come compact (report.py's COMPACT_WEIGHTS: a byte each, zlib, base64): inflated
     first, then drawn as if they had come as lists, a pruned head's cell empty. */
  if (!Array.isArray(payload.report.weights)) {
    var packed = payload.report.weights, shape = packed.shape;
    var bytes = Uint8Array.from(atob(packed.data), function (c) { return c.charCodeAt(0); });
    var inflating = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
    new Response(inflating).arrayBuffer().then(function (buffer) {
      var all = new Uint8Array(buffer), i = shape[2], j = shape[3];
      payload.report.weights = packed.present.map(function (row, li) {
        return row.map(function (present, hi) {
          if (!present) return [];
          var rows = [];
          for (var q = 0; q < i; q++) {
            var start = ((li * shape[1] + hi) * i + q) * j, values = new Float32Array(j);
            for (var k = 0; k < j; k++) values[k] = all[start + k] / 255;
            rows.push(values);
          }
          return rows;
        });
      });
      draw(rootId, root.querySelector(":scope > script") || script, payload);
    });
    return;
  }
  /* The same report shown twice in one page: the later copies get ids of their own (mh-...-2, -3, ...). */
  if (withId(rootId).length > 1 && withId(rootId)[0] !== root) {
    for (var copy = 2; withId(rootId + "-" + copy).length > 0; copy++) continue;
    root.id = rootId + "-" + copy;
  }
  var shadow = root.attachShadow({ mode: "open" });
  shadow.appendChild(markup.cloneNode(true));
  function byId(id) { return shadow.getElementById(id); }
  var report = payload.report, view = payload.view, corpus = report.corpus_stats;
  /* Rows are the query pieces (tokens), columns the key pieces (key_tokens): the same in self-attention,
     the source text in cross-attention. */
  var n = report.tokens.length, keys = report.key_tokens, nk = keys.length;
  var sameAxes = report.part !== "cross" && nk === n &&
    keys.every(function (token, k) { return token === report.tokens[k]; });
  /* A causal part masks the keys after the query (aligned bottom-right when the lengths differ). */
  function masked(q, k) { return report.causal && k - q > nk - n; }
  /* The one colour scale (multihead.lab.inspect.colours, the PNG's too), received as data: stops evenly spaced
     along sqrt(weight), the ticks and label of the legend, and the grey of masked cells. */
  var SCALE = view.scale, STOPS = SCALE.stops, MASKED = SCALE.masked;
  /* Heads go by their checkpoint numbers; a head pruned from a layer has no weights there (an empty list). */
  function kept(li, hi) { return report.weights[li][hi].length > 0; }
  function firstKept() {
    for (var li = 0; li < report.layers.length; li++) for (var hi = 0; hi < report.heads.length; hi++) {
      if (kept(li, hi)) return { li: li, hi: hi };
    }
    return { li: 0, hi: 0 };
  }
  var start = kept(0, 0) ? { li: 0, hi: 0 } : firstKept();
  var state = { li: start.li, hi: start.hi, q: report.token, words: false, allBars: false };

  /* Create an element; text (user data included) goes in through textContent only. */
  function el(tag, className, text) {
    var node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  /* Python's round(): half to even, so every channel equals colours.weight_rgb's. */
  function roundEven(x) {
    var r = Math.round(x);
    return Math.abs(x - Math.floor(x) - 0.5) < 1e-9 && r % 2 !== 0 ? r - 1 : r;
  }
  function rgb(w) {
    var t = Math.sqrt(Math.min(1, Math.max(0, w))) * (STOPS.length - 1);
    var i = Math.min(STOPS.length - 2, Math.floor(t)), f = t - i, a = STOPS[i], b = STOPS[i + 1];
    return [0, 1, 2].map(function (c) { return roundEven(a[c] + f * (b[c] - a[c])); });
  }
  function css(w) { return "rgb(" + rgb(w).join(",") + ")"; }
  function pct(w) { return (100 * w).toFixed(1) + "%"; }
  /* A role's strength as the reports print it ("61%"), and its caption: "[CLS] 61%", "?" when its
     confidence is low (multihead.lab.inspect.roles.Role.short). A pruned head's role has no strength. */
  function strengthText(r) {
    return r.strength === null || r.strength === undefined ? "" : roundEven(100 * r.strength) + "%";
  }
  function roleTip(r) {
    var parts = [r.text || r.label];
    if (r.confidence) parts.push(r.confidence + " confidence");
    if (r.relation) parts.push("relation " + r.relation.name + " " + fmt(r.relation.score));
    return parts.join("; ") + " \u2014 " + r.summary;
  }
  function roleCaption(r) {
    var caption = el("figcaption", "caption" + (r.confidence ? " confidence-" + r.confidence : ""));
    caption.appendChild(el("span", "role-label", r.label));
    var strength = strengthText(r);
    if (strength) caption.appendChild(el("span", "role-strength", " " + strength));
    if (r.confidence === "low") caption.appendChild(el("span", "role-doubt", "?"));
    return caption;
  }
  function fmt(x) {
    if (x === null || x === undefined) return "\u2014";
    if (Number.isInteger(x)) return String(x);
    var a = Math.abs(x);
    return x.toFixed(a >= 100 ? 0 : a >= 10 ? 1 : 3);
  }
  function role() { return report.roles[state.li][state.hi]; }

  /* ---------------------------------------------------------------- header and controls */
  byId("report-title").textContent = view.title;
  byId("report-model").textContent = report.model;
  /* A long text: the heatmap gets the whole width, below the bars. */
  byId("focus").classList.toggle("long", Math.max(n, nk) > 24);
  byId("report-ntokens").textContent = sameAxes ? String(n) : n + " queries \u00b7 " + nk + " keys";
  if (report.part !== "self") {
    byId("report-part").textContent = report.part;
    byId("report-part-meta").hidden = false;
  }
  view.notes.forEach(function (note) { byId("report-notes").appendChild(el("p", "", note)); });
  byId("report-notes").hidden = view.notes.length === 0;
  byId("legend-masked").hidden = !report.causal;
  byId("report-roles-source").textContent = report.roles_from;
  byId("report-text").textContent = report.text;
  if (corpus) {
    byId("report-corpus").textContent = corpus.source;
    byId("report-corpus-meta").hidden = false;
  }
  /* The legend: the scale's label, its ramp (linear in sqrt(weight), as the stops are) and the ticks there. */
  byId("legend-label").textContent = SCALE.label;
  byId("legend-ramp").style.background = "linear-gradient(to right, " + STOPS.map(function (stop, i) {
    return "rgb(" + stop.join(",") + ") " + (100 * i / (STOPS.length - 1)) + "%";
  }).join(", ") + ")";
  SCALE.ticks.forEach(function (tick) {
    var mark = el("span", "tick", String(tick));
    mark.style.left = (100 * Math.sqrt(tick)) + "%";
    mark.setAttribute("data-weight", String(tick));
    byId("legend-ticks").appendChild(mark);
  });
  byId("legend-masked-swatch").style.background = "repeating-linear-gradient(135deg, rgb(" + MASKED.join(",") +
    ") 0 3px, rgba(0, 0, 0, 0.18) 3px 4px)";  /* the large heatmap's hatching of masked cells */

  var layerSelect = byId("layer-select"), headSelect = byId("head-select");
  report.layers.forEach(function (layer) {
    var option = el("option", "", "layer " + layer); option.value = String(layer); layerSelect.appendChild(option);
  });
  var headOptions = report.heads.map(function (head) {
    var option = el("option", "", "head " + head); option.value = String(head); headSelect.appendChild(option);
    return option;
  });
  layerSelect.addEventListener("change", function () { state.li = layerSelect.selectedIndex; render(); });
  headSelect.addEventListener("change", function () { state.hi = headSelect.selectedIndex; render(); });

  /* reveal: bring the selected head's bars and heatmap into view (below the sticky controls), as a click on a
     thumbnail or a table row far below them asks. */
  function selectHead(li, hi, reveal) {
    state.li = li; state.hi = hi; render();
    if (reveal) {
      var focus = byId("focus");
      focus.style.scrollMarginTop = (byId("controls").offsetHeight + 8) + "px";
      focus.scrollIntoView({ block: "nearest" });
    }
  }
  function selectQuery(q) { state.q = q; render(); }

  /* ---------------------------------------------------------------- tokens */
  var tokenNodes = report.tokens.map(function (token, q) {
    var node = el("button", "token" + (view.special[q] ? " special" : ""), token);
    node.type = "button";
    node.setAttribute("data-index", String(q));
    node.addEventListener("click", function () { selectQuery(q); });
    byId("tokens").appendChild(node);
    return node;
  });
  /* In cross-attention the keys are other pieces: a second strip, shaded by the query's attention. */
  var keyNodes = tokenNodes;
  if (!sameAxes) {
    byId("key-strip").hidden = false;
    byId("query-hint").textContent = "click a token of the decoder input";
    keyNodes = keys.map(function (token, k) {
      var node = el("span", "token key-chip" + (view.key_special[k] ? " special" : ""), token);
      node.setAttribute("data-key", String(k));
      byId("key-tokens").appendChild(node);
      return node;
    });
  }

  /* ---------------------------------------------------------------- heatmap grid */
  var grid = byId("head-grid"), cells = [];
  /* Thumbnails share the card's width: 92 px at most, down to --thumb-min (report.css: less in a narrow report)
     before the grid scrolls, so a notebook cell still shows every head of a 12-head layer. */
  grid.style.gridTemplateColumns = "auto repeat(" + report.heads.length + ", minmax(var(--thumb-min), 92px))";
  grid.appendChild(el("div", "axis"));
  report.heads.forEach(function (head) { grid.appendChild(el("div", "axis", "head " + head)); });
  report.layers.forEach(function (layer, li) {
    grid.appendChild(el("div", "axis row", "layer " + layer));
    cells.push(report.heads.map(function (head, hi) {
      var r = report.roles[li][hi];
      var cell = el("figure", "head-cell");
      var canvas = el("canvas", "heatmap");
      canvas.setAttribute("data-layer", String(layer));
      canvas.setAttribute("data-head", String(head));
      if (!kept(li, hi)) {  /* pruned from this layer: an empty thumbnail, labelled so */
        cell.classList.add("pruned");
        canvas.setAttribute("data-pruned", "");
        canvas.setAttribute("aria-label", "layer " + layer + ", head " + head + ": pruned");
        cell.title = "layer " + layer + ", head " + head + " \u2014 " + r.summary;
        cell.appendChild(canvas);
        cell.appendChild(roleCaption(r));
        grid.appendChild(cell);
        return cell;
      }
      canvas.setAttribute("role", "button");
      canvas.setAttribute("tabindex", "0");
      canvas.setAttribute("aria-label", "layer " + layer + ", head " + head + ": " + r.label);
      cell.title = "layer " + layer + ", head " + head + " (" + r.pattern + "): " + roleTip(r);
      if (nk !== n) canvas.style.aspectRatio = nk + " / " + n;
      drawSmall(canvas, report.weights[li][hi]);
      canvas.addEventListener("click", function () { selectHead(li, hi, true); });
      canvas.addEventListener("keydown", function (event) {
        if (event.key === "Enter" || event.key === " ") { event.preventDefault(); selectHead(li, hi, true); }
      });
      cell.appendChild(canvas);
      cell.appendChild(roleCaption(r));
      grid.appendChild(cell);
      return cell;
    }));
  });

  /* One pixel per (query, key); CSS scales it up without smoothing. Masked (causal) cells are grey. */
  function drawSmall(canvas, matrix) {
    canvas.width = nk; canvas.height = n;
    var ctx = canvas.getContext("2d"), image = ctx.createImageData(nk, n);
    for (var q = 0; q < n; q++) for (var k = 0; k < nk; k++) {
      var c = masked(q, k) ? MASKED : rgb(matrix[q][k]), o = 4 * (q * nk + k);
      image.data[o] = c[0]; image.data[o + 1] = c[1]; image.data[o + 2] = c[2]; image.data[o + 3] = 255;
    }
    ctx.putImageData(image, 0, 0);
  }

  /* ---------------------------------------------------------------- pieces or words */
  /* The focus views (bars, heatmap) draw rows (queries) and columns (keys) of pieces or, in the word view,
     of the words the pieces merge into: attention TO a word is the sum over its pieces, FROM a word the mean
     over its pieces (multihead.lab.inspect.syntax.word_attention); a special piece is a word of its own. */
  function members(index, count) {
    var groups = [];
    for (var w = 0; w < count; w++) groups.push([]);
    index.forEach(function (w, piece) { groups[w].push(piece); });
    return groups;
  }
  var qWords = view.words.query, kWords = view.words.key;
  var rowPieces = members(qWords.index, qWords.labels.length), colPieces = members(kWords.index, kWords.labels.length);
  var wordCache = {};
  function wordMatrix(li, hi) {
    var id = li + ":" + hi;
    if (!wordCache[id]) {
      var m = report.weights[li][hi];
      wordCache[id] = m.length === 0 ? [] : rowPieces.map(function (rows) {
        return colPieces.map(function (cols) {
          var total = 0;
          rows.forEach(function (i) { cols.forEach(function (j) { total += m[i][j]; }); });
          return total / rows.length;
        });
      });
    }
    return wordCache[id];
  }
  var wordMasked = rowPieces.map(function (rows) {  /* a word cell is masked when all its piece cells are */
    return colPieces.map(function (cols) {
      return rows.every(function (i) { return cols.every(function (j) { return masked(i, j); }); });
    });
  });
  var AXES = {
    pieces: { words: false, rows: report.tokens, cols: keys, rowSpecial: view.special, colSpecial: view.key_special,
              rowOf: function (q) { return q; }, colOf: function (k) { return k; },
              firstPiece: function (r) { return r; },
              matrix: function (li, hi) { return report.weights[li][hi]; }, masked: masked },
    words: { words: true, rows: qWords.labels, cols: kWords.labels, rowSpecial: qWords.special,
             colSpecial: kWords.special,
             rowOf: function (q) { return qWords.index[q]; }, colOf: function (k) { return kWords.index[k]; },
             firstPiece: function (r) { return rowPieces[r][0]; },
             matrix: wordMatrix, masked: function (r, c) { return wordMasked[r][c]; } },
  };
  function axes() { return state.words ? AXES.words : AXES.pieces; }
  /* The word view is offered when some word has several pieces. */
  var wordToggle = byId("word-view");
  byId("word-view-label").hidden = rowPieces.length === n && colPieces.length === nk;
  wordToggle.addEventListener("change", function () { state.words = wordToggle.checked; render(); });

  /* ---------------------------------------------------------------- large heatmap of the selected head */
  var detail = byId("head-detail"), detailWrap = detail.parentElement;
  var LABEL_ROOM = 13;  /* px a label needs across its row or column */
  function labelFont() { return "11px " + getComputedStyle(detail).getPropertyValue("--mono"); }
  function short(t) { return t.length > 12 ? t.slice(0, 11) + "\u2026" : t; }
  /* Cells as large as the card allows (4 to 30px, wider than the card scrolls); labels left of the rows and
     above the columns: every one when cells fit the text, else every step-th (see drawLabels). */
  function layoutFor(ax) {
    var ctx = detail.getContext("2d"), room = Math.max(160, detailWrap.clientWidth - 2);
    ctx.font = labelFont();
    function widest(names) {
      return Math.ceil(Math.max.apply(null, names.map(function (t) { return ctx.measureText(short(t)).width; }))) + 8;
    }
    var left = widest(ax.rows), top = widest(ax.cols);
    var cell = Math.max(4, Math.min(30, Math.floor((room - left) / ax.cols.length)));
    return { cell: cell, left: left, top: top, step: cell >= LABEL_ROOM ? 1 : Math.ceil(LABEL_ROOM / cell),
             width: left + ax.cols.length * cell + 2, height: top + ax.rows.length * cell + 2 };
  }
  var layout = null, hoverCell = null;
  function sizeDetail(ax) {
    layout = layoutFor(ax);
    var dpr = window.devicePixelRatio || 1;
    detail.width = Math.round(layout.width * dpr); detail.height = Math.round(layout.height * dpr);
    detail.style.width = layout.width + "px"; detail.style.height = layout.height + "px";
    detail.getContext("2d").setTransform(dpr, 0, 0, dpr, 0, 0);
  }
  function cellAt(event) {
    var box = detail.getBoundingClientRect(), ax = axes();
    var r = Math.floor((event.clientY - box.top - layout.top) / layout.cell);
    var c = Math.floor((event.clientX - box.left - layout.left) / layout.cell);
    return { r: r, c: c, row: r >= 0 && r < ax.rows.length, inside: r >= 0 && r < ax.rows.length && c >= 0 &&
             c < ax.cols.length };
  }
  detail.addEventListener("click", function (event) {
    var at = cellAt(event);
    if (at.row) selectQuery(axes().firstPiece(at.r));
  });
  /* Hovering a cell names its query and key in full (the title) and labels its row and column. */
  detail.addEventListener("mousemove", function (event) {
    var at = cellAt(event), ax = axes(), m = ax.matrix(state.li, state.hi);
    detail.title = m.length && at.inside ? ax.rows[at.r] + " \u2192 " + ax.cols[at.c] + ": " +
      (ax.masked(at.r, at.c) ? "masked (a later token)" : pct(m[at.r][at.c])) : "";
    var next = at.inside ? at.r + ":" + at.c : null;
    if (next !== (hoverCell && hoverCell.id)) {
      hoverCell = at.inside ? { id: next, r: at.r, c: at.c } : null;
      drawDetail();
    }
  });
  detail.addEventListener("mouseleave", function () { if (hoverCell) { hoverCell = null; drawDetail(); } });
  if (window.ResizeObserver) {  /* a wider or narrower card (a window resized, a notebook drawn late) */
    var lastWidth = detailWrap.clientWidth;
    new ResizeObserver(function () {
      if (detailWrap.clientWidth !== lastWidth) { lastWidth = detailWrap.clientWidth; drawDetail(); }
    }).observe(detailWrap);
  }
  /* Masked (causal) cells: grey hatching, apart from a weight of 0. */
  var hatch = (function () {
    var tile = document.createElement("canvas"), ctx = tile.getContext("2d");
    tile.width = tile.height = 6;
    ctx.fillStyle = "rgb(" + MASKED.join(",") + ")"; ctx.fillRect(0, 0, 6, 6);
    ctx.strokeStyle = "rgba(0, 0, 0, 0.18)"; ctx.lineWidth = 1;
    ctx.beginPath(); ctx.moveTo(0, 6); ctx.lineTo(6, 0); ctx.stroke();
    return detail.getContext("2d").createPattern(tile, "repeat");
  })();

  /* Which labels of count rows (or columns) to draw: every step-th, and the forced ones (the selected query,
     its strongest key, the hovered cell's), the others kept clear of them so none overlap. */
  function pickLabels(count, step, forced) {
    var chosen = [];
    for (var i = 0; i < count; i++) {
      var isForced = forced.indexOf(i) >= 0;
      var near = forced.some(function (f) { return f !== i && Math.abs(f - i) < step; });
      if (isForced || (i % step === 0 && !near)) chosen.push(i);
    }
    return chosen;
  }
  function strongest(row, ax, r) {
    var best = -1;
    row.forEach(function (w, c) { if (!ax.masked(r, c) && (best < 0 || w > row[best])) best = c; });
    return best;
  }

  function drawDetail() {
    var ax = axes();
    sizeDetail(ax);
    var ctx = detail.getContext("2d"), s = layout.cell, x0 = layout.left, y0 = layout.top;
    var nr = ax.rows.length, nc = ax.cols.length, q = ax.rowOf(state.q);
    ctx.clearRect(0, 0, layout.width, layout.height);
    if (!kept(state.li, state.hi)) { detail.setAttribute("data-labels", '{"rows":[],"cols":[]}'); return; }
    var m = ax.matrix(state.li, state.hi);
    for (var r = 0; r < nr; r++) for (var c = 0; c < nc; c++) {
      ctx.fillStyle = ax.masked(r, c) ? hatch : css(m[r][c]); ctx.fillRect(x0 + c * s, y0 + r * s, s, s);
    }
    var top = strongest(m[q], ax, q);
    var rows = pickLabels(nr, layout.step, [q].concat(hoverCell ? [hoverCell.r] : []));
    var cols = pickLabels(nc, layout.step, (top >= 0 ? [top] : []).concat(hoverCell ? [hoverCell.c] : []));
    var drawn = { rows: [], cols: [] };
    ctx.font = labelFont();
    ctx.textBaseline = "middle";
    rows.forEach(function (i) {  /* the queries, left of their rows */
      var name = short(ax.rows[i]);
      ctx.fillStyle = i === q ? "#c2410c" : ax.rowSpecial[i] ? "#8250df" : "#1f2328";
      ctx.textAlign = "right"; ctx.fillText(name, x0 - 5, y0 + (i + 0.5) * s);
      drawn.rows.push([i, name]);
    });
    cols.forEach(function (k) {  /* the keys, above their columns */
      var name = short(ax.cols[k]);
      ctx.save(); ctx.translate(x0 + (k + 0.5) * s, y0 - 5); ctx.rotate(-Math.PI / 2);
      ctx.textAlign = "left"; ctx.fillStyle = k === top ? "#c2410c" : ax.colSpecial[k] ? "#8250df" : "#1f2328";
      ctx.fillText(name, 0, 0);
      ctx.restore();
      drawn.cols.push([k, name]);
    });
    detail.setAttribute("data-labels", JSON.stringify(drawn));
    detail.setAttribute("data-step", String(layout.step));
    detail.setAttribute("data-geometry", JSON.stringify({ cell: s, left: x0, top: y0 }));
    ctx.strokeStyle = "#e8590c"; ctx.lineWidth = 2;
    ctx.strokeRect(x0 + 1, y0 + q * s + 1, nc * s - 2, Math.max(2, s - 2));
  }

  /* ---------------------------------------------------------------- where the query attends */
  var barsToggle = byId("bars-toggle");
  barsToggle.addEventListener("click", function () { state.allBars = !state.allBars; drawBars(); });
  function shadeTokens(ax, row, r) {
    tokenNodes.forEach(function (node, p) { node.classList.toggle("selected", ax.rowOf(p) === r); });
    keyNodes.forEach(function (node, k) {
      if (!row) { node.classList.remove("dark"); node.style.background = ""; node.title = ""; return; }
      var c = ax.colOf(k), w = row[c], hidden = ax.masked(r, c);
      node.style.background = hidden ? "" : css(w);
      node.classList.toggle("dark", !hidden && Math.sqrt(w) > 0.55);
      node.title = hidden ? "masked: after \u201c" + ax.rows[r] + "\u201d"
        : pct(w) + " of the attention of \u201c" + ax.rows[r] + "\u201d" + (ax.words ? " (to the word " +
          "\u201c" + ax.cols[c] + "\u201d)" : "");
    });
  }
  /* One row per key the query sees, strongest first, the strongest view.bars_shown visible; the keys a causal
     query cannot see are one line after them, not rows of "masked". */
  function drawBars() {
    var bars = byId("attention-bars"), title = byId("bars-title"), ax = axes(), r = ax.rowOf(state.q);
    bars.textContent = "";
    if (!kept(state.li, state.hi)) {
      title.textContent = "Head " + report.heads[state.hi] + " was pruned from layer " + report.layers[state.li];
      barsToggle.hidden = true;
      shadeTokens(ax, null, r);
      return;
    }
    var row = ax.matrix(state.li, state.hi)[r], max = Math.max.apply(null, row);
    title.textContent = "";
    /* a piece names what its row stands for: its whole word and the word's pieces when it is the word's query
       piece (multihead.lab.inspect.Inspection.query_of), else itself */
    var named = ax.words ? [ax.rows[r], r, r] : view.queries[r];
    title.appendChild(document.createTextNode("Where " + (ax.words ? "the word " : "")));
    title.appendChild(el("code", "", named[0]));
    title.appendChild(document.createTextNode(" (#" + (named[1] === named[2] ? named[1] : named[1] + "-" + named[2]) +
      ") attends" + (sameAxes ? "" : " in the source text") +
      " in layer " + report.layers[state.li] + ", head " + report.heads[state.hi]));
    var order = Array.prototype.map.call(row, function (w, c) { return c; })  /* row may be a Float32Array */
      .filter(function (c) { return !ax.masked(r, c); });
    order.sort(function (a, b) { return row[b] - row[a] || a - b; });
    order.forEach(function (c, rank) {
      var w = row[c];
      var line = el("div", "weight-row" + (sameAxes && c === r ? " is-query" : "") + (w === max ? " is-max" : ""));
      line.setAttribute("data-key", String(c));
      line.setAttribute("data-weight", String(w));
      line.appendChild(el("span", "key-index", c));
      line.appendChild(el("span", "key-token" + (ax.colSpecial[c] ? " special" : ""), ax.cols[c]));
      var track = el("div", "bar-track"), fill = el("div", "bar-fill");
      fill.style.width = (100 * w) + "%";
      track.appendChild(fill);
      line.appendChild(track);
      line.appendChild(el("span", "weight-pct", pct(w)));
      line.hidden = !state.allBars && rank >= view.bars_shown;
      bars.appendChild(line);
    });
    var later = row.length - order.length, unit = ax.words ? " word" : " key";
    if (later > 0) {
      bars.appendChild(el("p", "masked-note", later + " later" + unit + (later === 1 ? " is" : "s are") +
        " masked: a causal query sees only itself and what comes before it"));
    }
    barsToggle.hidden = order.length <= view.bars_shown;
    barsToggle.textContent = state.allBars ? "show the strongest " + view.bars_shown
      : "show all " + order.length + (ax.words ? " words" : " keys");
    barsToggle.setAttribute("aria-expanded", String(state.allBars));
    shadeTokens(ax, row, r);
  }

  /* ---------------------------------------------------------------- head view (bertviz's) */
  /* For the selected layer: a line from each query (left column) to each key (right column) it attends to
     with weight >= view.line_threshold, opacity = weight, one colour per head. The selected head is always
     drawn; the checkboxes add others. Hovering a token shows only its lines; clicking a query selects it. */
  var PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                 "#bcbd22", "#17becf", "#3b4cc0", "#637939"];
  function headColour(hi) {
    return hi < PALETTE.length ? PALETTE[hi] : "hsl(" + Math.round((hi * 137.508) % 360) + ", 60%, 42%)";
  }
  function svgEl(tag, attrs, text) {
    var node = document.createElementNS(SVG, tag);
    Object.keys(attrs).forEach(function (name) { node.setAttribute(name, String(attrs[name])); });
    if (text !== undefined) node.textContent = String(text);
    return node;
  }
  var headView = byId("head-view"), hvHover = null, extraHeads = {};
  var SVG = headView.namespaceURI;  /* the <svg> of the markup is in SVG's namespace: new elements join it */
  headView.setAttribute("data-threshold", String(view.line_threshold));
  var hvBoxes = report.heads.map(function (head, hi) {
    var label = el("label", "hv-head"), box = el("input");
    box.type = "checkbox";
    box.setAttribute("data-head", String(head));
    box.addEventListener("change", function () {
      if (box.checked) extraHeads[hi] = true; else delete extraHeads[hi];
      drawHeadView();
    });
    var swatch = el("span", "swatch");
    swatch.style.background = headColour(hi);
    label.appendChild(box);
    label.appendChild(swatch);
    label.appendChild(el("span", "", "head " + head));
    byId("head-view-heads").appendChild(label);
    return box;
  });
  byId("head-view-all").addEventListener("click", function () {
    report.heads.forEach(function (head, hi) { if (kept(state.li, hi)) extraHeads[hi] = true; });
    drawHeadView();
  });
  byId("head-view-one").addEventListener("click", function () { extraHeads = {}; drawHeadView(); });
  function shownHeads() {
    return report.heads.map(function (head, hi) { return hi; }).filter(function (hi) {
      return kept(state.li, hi) && (hi === state.hi || extraHeads[hi]);
    });
  }
  /* Hovering a token draws its lines in a group of their own and hides the group of all lines (cheap both
     ways: the thousands of lines of a long text are not rebuilt on every hover). */
  var hvAll = null, hvOne = null, hvGeometry = null;
  function setHover(side, index) {
    var next = side === null ? null : { side: side, index: index };
    if (JSON.stringify(next) === JSON.stringify(hvHover)) return;
    hvHover = next;
    hvOne.textContent = "";
    hvAll.style.display = hvHover ? "none" : "";
    if (hvHover) drawLines(hvOne, hvHover);
    Array.prototype.forEach.call(headView.querySelectorAll("text.hv-token"), function (node) {
      var side = node.getAttribute("data-side"), i = Number(node.getAttribute(side === "query" ? "data-query" : "data-key"));
      node.classList.toggle("hover", !!hvHover && hvHover.side === side && hvHover.index === i);
    });
    headView.setAttribute("data-lines", String((hvHover ? hvOne : hvAll).childNodes.length));
  }
  /* The lines of the shown heads into group, those of one token only when only is given. */
  function drawLines(group, only) {
    var ax = axes(), g = hvGeometry, nr = ax.rows.length, nc = ax.cols.length;
    shownHeads().forEach(function (hi) {
      var m = ax.matrix(state.li, hi), colour = headColour(hi);
      for (var r = 0; r < nr; r++) {
        if (only && only.side === "query" && only.index !== r) continue;
        for (var c = 0; c < nc; c++) {
          if (only && only.side === "key" && only.index !== c) continue;
          var w = m[r][c];
          if (ax.masked(r, c) || !(w >= view.line_threshold)) continue;
          group.appendChild(svgEl("line", { x1: g.x1, y1: g.y(r), x2: g.x2, y2: g.y(c), stroke: colour,
            "stroke-opacity": Math.min(1, w).toFixed(4), "stroke-width": 2, "data-head": report.heads[hi],
            "data-query": r, "data-key": c, "data-weight": w }));
        }
      }
    });
  }
  function drawHeadView() {
    var ax = axes(), nr = ax.rows.length, nc = ax.cols.length, q = ax.rowOf(state.q);
    byId("head-view-layer").textContent = "layer " + report.layers[state.li];
    hvBoxes.forEach(function (box, hi) {
      box.disabled = hi === state.hi || !kept(state.li, hi);
      box.checked = kept(state.li, hi) && (hi === state.hi || !!extraHeads[hi]);
      box.parentNode.title = !kept(state.li, hi) ? "pruned from this layer"
        : hi === state.hi ? "the selected head: always drawn" : "";
      box.parentNode.classList.toggle("pruned", !kept(state.li, hi));
    });
    var measure = detail.getContext("2d");
    measure.font = "12px " + getComputedStyle(detail).getPropertyValue("--mono");
    function widest(names) {
      return Math.ceil(Math.max.apply(null, names.map(function (t) { return measure.measureText(short(t)).width; })));
    }
    var rowH = Math.max(nr, nc) > 40 ? 14 : 18, pad = 8, gap = 220;
    var leftW = widest(ax.rows) + pad, rightW = widest(ax.cols) + pad;
    var width = leftW + gap + rightW, height = Math.max(nr, nc) * rowH + 4;
    hvGeometry = { x1: leftW + 4, x2: leftW + gap - 4, y: function (i) { return 2 + (i + 0.5) * rowH; } };
    headView.textContent = "";
    headView.setAttribute("width", String(width));
    headView.setAttribute("height", String(height));
    headView.setAttribute("viewBox", "0 0 " + width + " " + height);
    hvAll = svgEl("g", { "class": "hv-lines" });
    hvOne = svgEl("g", { "class": "hv-lines hv-hover" });
    drawLines(hvAll, null);
    headView.appendChild(hvAll);
    headView.appendChild(hvOne);
    function label(side, i, name, special) {
      var isQuery = side === "query";
      var node = svgEl("text", { x: isQuery ? leftW - 2 : leftW + gap + 2, y: hvGeometry.y(i),
        "text-anchor": isQuery ? "end" : "start", "dominant-baseline": "central",
        "class": "hv-token" + (special ? " special" : "") + (isQuery && i === q ? " selected" : ""),
        "data-side": side }, short(name));
      node.setAttribute(isQuery ? "data-query" : "data-key", String(i));
      node.addEventListener("mouseenter", function () { setHover(side, i); });
      node.addEventListener("mouseleave", function () { setHover(null); });
      if (isQuery) node.addEventListener("click", function () { selectQuery(ax.firstPiece(i)); });
      var group = svgEl("g", {});  /* its title: the whole token, on hover */
      group.appendChild(svgEl("title", {}, name));
      group.appendChild(node);
      headView.appendChild(group);
    }
    ax.rows.forEach(function (name, i) { label("query", i, name, ax.rowSpecial[i]); });
    ax.cols.forEach(function (name, k) { label("key", k, name, ax.colSpecial[k]); });
    var hover = hvHover;
    hvHover = null;
    headView.setAttribute("data-lines", String(hvAll.childNodes.length));
    if (hover) setHover(hover.side, hover.index);
  }

  /* ---------------------------------------------------------------- head similarity */
  /* The heads' pairwise Jensen-Shannon divergence in bits (0: the same attention, 1: disjoint), measured where
     the roles were, in the clustered order (report.similarity); click a cell to select its row's head. */
  var similarity = report.similarity, simMap = byId("similarity-map");
  var SIM_STOPS = [[63, 0, 125], [117, 107, 177], [188, 189, 220], [252, 251, 253]];  /* divergence 0 -> 1 */
  function simColour(d) {
    var t = Math.min(1, Math.max(0, d)) * (SIM_STOPS.length - 1);
    var i = Math.min(SIM_STOPS.length - 2, Math.floor(t)), f = t - i, a = SIM_STOPS[i], b = SIM_STOPS[i + 1];
    return "rgb(" + [0, 1, 2].map(function (c) { return Math.round(a[c] + f * (b[c] - a[c])); }).join(",") + ")";
  }
  function headName(pair) { return "L" + pair[0] + " H" + pair[1]; }
  /* (layer, head) of the data -> the (li, hi) of the page's grid */
  function cellOf(pair) { return { li: report.layers.indexOf(pair[0]), hi: report.heads.indexOf(pair[1]) }; }
  var simOrder = [], simLayout = null, simHover = null;
  if (similarity && similarity.heads.length > 0) {
    byId("similarity-section").hidden = false;
    byId("similarity-source").textContent = similarity.source;
    simOrder = similarity.order.map(function (index) { return similarity.heads[index]; });
    simMap.setAttribute("data-heads", JSON.stringify(simOrder));
    byId("similarity-ramp").style.background = "linear-gradient(to right, " +
      [0, 0.25, 0.5, 0.75, 1].map(simColour).join(", ") + ")";
    byId("near-threshold").textContent = fmt(similarity.threshold);
    byId("near-count").textContent = "(" + similarity.near_duplicates.length + ")";
    var list = byId("near-duplicates");
    if (similarity.near_duplicates.length === 0) list.appendChild(el("li", "none", "none"));
    similarity.near_duplicates.forEach(function (pair) {
      var item = el("li"), button = el("button", "link", headName(pair.a) + " \u2248 " + headName(pair.b));
      button.type = "button";
      button.setAttribute("data-a", pair.a.join(","));
      button.setAttribute("data-b", pair.b.join(","));
      /* select the first head; the second joins the head view when it is in the same layer */
      button.addEventListener("click", function () {
        var a = cellOf(pair.a), b = cellOf(pair.b);
        if (a.li === b.li) extraHeads[b.hi] = true;
        selectHead(a.li, a.hi, true);
      });
      item.appendChild(button);
      item.appendChild(el("span", "hint", " " + fmt(pair.divergence) + " bits"));
      list.appendChild(item);
    });
    simMap.addEventListener("click", function (event) {
      var at = simCellAt(event);
      if (at) { var pick = cellOf(simOrder[at.r]); selectHead(pick.li, pick.hi, true); }
    });
    simMap.addEventListener("mousemove", function (event) {
      var at = simCellAt(event);
      simMap.title = at ? headName(simOrder[at.r]) + " vs " + headName(simOrder[at.c]) + ": " +
        fmt(similarity.divergence[similarity.order[at.r]][similarity.order[at.c]]) + " bits" : "";
      var next = at ? at.r + ":" + at.c : null;
      if (next !== (simHover && simHover.id)) { simHover = at ? { id: next, r: at.r, c: at.c } : null; drawSimilarity(); }
    });
    simMap.addEventListener("mouseleave", function () { if (simHover) { simHover = null; drawSimilarity(); } });
  }
  function simCellAt(event) {
    var box = simMap.getBoundingClientRect(), N = simOrder.length;
    var r = Math.floor((event.clientY - box.top - simLayout.top) / simLayout.cell);
    var c = Math.floor((event.clientX - box.left - simLayout.left) / simLayout.cell);
    return r >= 0 && r < N && c >= 0 && c < N ? { r: r, c: c } : null;
  }
  function drawSimilarity() {
    if (!simOrder.length) return;
    var N = simOrder.length, names = simOrder.map(headName), ctx = simMap.getContext("2d");
    ctx.font = labelFont();
    var label = Math.ceil(Math.max.apply(null, names.map(function (t) { return ctx.measureText(t).width; }))) + 8;
    var room = Math.max(160, Math.min(560, simMap.parentElement.clientWidth - 2));
    var cell = Math.max(3, Math.min(24, Math.floor((room - label) / N)));
    simLayout = { cell: cell, left: label, top: label, step: cell >= LABEL_ROOM ? 1 : Math.ceil(LABEL_ROOM / cell) };
    var size = label + N * cell + 2, dpr = window.devicePixelRatio || 1;
    simMap.width = Math.round(size * dpr); simMap.height = Math.round(size * dpr);
    simMap.style.width = size + "px"; simMap.style.height = size + "px";
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, size, size);
    for (var r = 0; r < N; r++) for (var c = 0; c < N; c++) {
      ctx.fillStyle = simColour(similarity.divergence[similarity.order[r]][similarity.order[c]]);
      ctx.fillRect(label + c * cell, label + r * cell, cell, cell);
    }
    var current = -1;
    simOrder.forEach(function (pair, i) {
      var at = cellOf(pair);
      if (at.li === state.li && at.hi === state.hi) current = i;
    });
    var forced = (current >= 0 ? [current] : []);
    var rows = pickLabels(N, simLayout.step, forced.concat(simHover ? [simHover.r] : []));
    var cols = pickLabels(N, simLayout.step, forced.concat(simHover ? [simHover.c] : []));
    ctx.font = labelFont();
    ctx.textBaseline = "middle";
    rows.forEach(function (i) {
      ctx.fillStyle = i === current ? "#c2410c" : "#1f2328";
      ctx.textAlign = "right"; ctx.fillText(names[i], label - 5, label + (i + 0.5) * cell);
    });
    cols.forEach(function (k) {
      ctx.save(); ctx.translate(label + (k + 0.5) * cell, label - 5); ctx.rotate(-Math.PI / 2);
      ctx.textAlign = "left"; ctx.fillStyle = k === current ? "#c2410c" : "#1f2328"; ctx.fillText(names[k], 0, 0);
      ctx.restore();
    });
    simMap.setAttribute("data-labels", JSON.stringify({
      rows: rows.map(function (i) { return [i, names[i]]; }), cols: cols.map(function (k) { return [k, names[k]]; }) }));
    simMap.setAttribute("data-geometry", JSON.stringify({ cell: cell, left: label, top: label }));
    simMap.setAttribute("data-current", String(current));
    if (current >= 0) {  /* the selected head's row and column */
      ctx.strokeStyle = "#e8590c"; ctx.lineWidth = 2;
      ctx.strokeRect(label + 1, label + current * cell + 1, N * cell - 2, Math.max(2, cell - 2));
      ctx.strokeRect(label + current * cell + 1, label + 1, Math.max(2, cell - 2), N * cell - 2);
    }
  }

  function drawSummary() {
    var r = role(), box = byId("head-summary");
    box.textContent = "";
    box.appendChild(document.createTextNode(
      "layer " + report.layers[state.li] + " \u00b7 head " + report.heads[state.hi] + ": "));
    box.appendChild(el("span", "role", r.label));
    if (!kept(state.li, state.hi)) {
      box.appendChild(document.createTextNode(" \u2014 " + r.summary));
      return;
    }
    if (r.confidence) {
      box.appendChild(el("span", "confidence confidence-" + r.confidence, r.confidence + " confidence"));
    }
    box.appendChild(el("span", "pill", r.pattern));
    if (r.text) box.appendChild(el("span", "signals", r.text));
    if (r.relation) {
      box.appendChild(el("span", "relation", "tracks " + r.relation.name + " (" + fmt(r.relation.score) + ")"));
    }
    box.appendChild(el("span", "summary-text", r.summary));
  }

  /* ---------------------------------------------------------------- statistics tables */
  function statColumns() {
    return Object.keys(view.stat_names).map(function (key) {
      return { label: view.stat_names[key], title: key,
               get: function (li, hi, stats) { return stats[li][hi][key]; } };
    });
  }
  function headColumns() {
    return [
      { label: "layer", get: function (li) { return report.layers[li]; } },
      { label: "head", get: function (li, hi) { return report.heads[hi]; } },
    ];
  }

  /* A table with one row per (layer, head); click a header to sort, a row to select the head. */
  function buildTable(table, columns, stats) {
    var rows = [];
    report.layers.forEach(function (layer, li) {
      report.heads.forEach(function (head, hi) {
        if (!kept(li, hi)) return;  /* the tables list the heads each layer has */
        var tr = el("tr");
        tr.setAttribute("data-layer", String(layer));
        tr.setAttribute("data-head", String(head));
        var values = columns.map(function (column) {
          var value = column.get(li, hi, stats);
          var td = el("td", column.text ? "text" : "", column.show ? column.show(value) : column.text ? value : fmt(value));
          if (column.tip) td.title = column.tip(li, hi);
          tr.appendChild(td);
          return value;
        });
        tr.addEventListener("click", function () { selectHead(li, hi, true); });
        rows.push({ tr: tr, li: li, hi: hi, values: values, order: rows.length });
      });
    });
    var head = el("thead"), headRow = el("tr"), body = el("tbody"), sorted = { index: -1, dir: 1 };
    columns.forEach(function (column, index) {
      var th = el("th", column.text ? "text" : "", column.label);
      th.setAttribute("scope", "col");
      if (column.title) th.title = column.title;
      th.addEventListener("click", function () {
        sorted.dir = sorted.index === index ? -sorted.dir : (column.text && !column.order ? 1 : -1);
        sorted.index = index;
        Array.prototype.forEach.call(headRow.children, function (other) { other.removeAttribute("aria-sort"); });
        th.setAttribute("aria-sort", sorted.dir > 0 ? "ascending" : "descending");
        rows.sort(function (a, b) {
          var x = a.values[index], y = b.values[index];
          if (column.order) { x = column.order[x] || 0; y = column.order[y] || 0; }
          if (x === y) return a.order - b.order;
          if (x === null) return 1;
          if (y === null) return -1;
          return (x < y ? -1 : 1) * sorted.dir;
        });
        rows.forEach(function (row) { body.appendChild(row.tr); });
      });
      headRow.appendChild(th);
    });
    head.appendChild(headRow);
    rows.forEach(function (row) { body.appendChild(row.tr); });
    table.appendChild(head);
    table.appendChild(body);
    return rows;
  }

  /* The role and pattern columns come from report.roles, labelled from report.roles_from: the corpus when
     one was given (then the headers say so), while the other numbers of the first table are this text's. */
  var rolesFromText = report.roles_from === report.text_stats.source;
  var rolesFromCorpus = !!corpus && report.roles_from === corpus.source;
  function roleColumns(suffix) {
    var tip = "labelled from " + report.roles_from;
    function r(li, hi) { return report.roles[li][hi]; }
    return [
      { label: "role" + suffix, text: true, title: tip, get: function (li, hi) { return r(li, hi).label; },
        tip: function (li, hi) { return roleTip(r(li, hi)); } },
      { label: "strength" + suffix, title: tip + ": the measure behind the label",
        get: function (li, hi) { return r(li, hi).strength; },
        show: function (value) { return value === null || value === undefined ? "\u2014" : strengthText({ strength: value }); } },
      { label: "confidence" + suffix, text: true, title: tip, order: { high: 3, medium: 2, low: 1 },
        get: function (li, hi) { return r(li, hi).confidence || ""; } },
      { label: "signals" + suffix, text: true, title: tip + ": the strongest places the head looks",
        get: function (li, hi) { return r(li, hi).text || r(li, hi).label; } },
      { label: "pattern" + suffix, text: true, title: tip, get: function (li, hi) { return r(li, hi).pattern; } },
    ];
  }
  byId("head-stats-note").textContent = rolesFromText
    ? "Every column is measured on this text, the roles included."
    : "Numbers: this text. Role, strength, confidence, signals and pattern: labelled from " +
      (rolesFromCorpus ? "the corpus, " : "") + report.roles_from + ".";
  var extraColumns = Object.keys(view.extra_columns).map(function (name) {
    return { label: name, get: function (li, hi) { return view.extra_columns[name][li][hi]; } };
  });
  var tableRows = [buildTable(byId("head-stats"),
    headColumns().concat(roleColumns(rolesFromText ? "" : rolesFromCorpus ? " (corpus)" : " (" + report.roles_from + ")"),
      statColumns(), extraColumns), report.text_stats.stats)];

  /* Corpus statistics, folded: open the <details> to see them. */
  if (corpus) {
    byId("corpus-section").hidden = false;
    byId("corpus-hint").textContent = corpus.source + " \u00b7 " + corpus.tokens + " tokens";
    var table = el("table", "stats");
    table.id = "corpus-stats";
    byId("corpus-wrap").appendChild(table);
    tableRows.push(buildTable(table,
      headColumns().concat(rolesFromCorpus ? roleColumns("") : [], statColumns()), corpus.stats));
  }

  /* ---------------------------------------------------------------- render */
  function render() {
    layerSelect.selectedIndex = state.li;
    headSelect.selectedIndex = state.hi;
    headOptions.forEach(function (option, hi) {
      option.textContent = "head " + report.heads[hi] + (kept(state.li, hi) ? "" : " (pruned)");
    });
    cells.forEach(function (row, li) {
      row.forEach(function (cell, hi) { cell.classList.toggle("current", li === state.li && hi === state.hi); });
    });
    tableRows.forEach(function (rows) {
      rows.forEach(function (row) { row.tr.classList.toggle("current", row.li === state.li && row.hi === state.hi); });
    });
    drawSummary();
    drawBars();
    drawDetail();
    drawHeadView();
    drawSimilarity();
  }
  render();
})
