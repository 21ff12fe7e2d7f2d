(function () {
  "use strict";
  /* report: Inspection.to_dict(), as in inspect.json; view: what only the page needs. */
  var payload = JSON.parse(document.getElementById("report-data").textContent);
  var report = payload.report, view = payload.view, corpus = report.corpus_stats;
  var n = report.tokens.length;
  /* Heads go by their checkpoint numbers; a head pruned from a layer has no weights there (an empty list). */
  function kept(li, hi) { return report.weights[li][hi].length > 0; }
  function firstKept() {
    for (var li = 0; li < report.layers.length; li++) for (var hi = 0; hi < report.heads.length; hi++) {
      if (kept(li, hi)) return { li: li, hi: hi };
    }
    return { li: 0, hi: 0 };
  }
  var start = kept(0, 0) ? { li: 0, hi: 0 } : firstKept();
  var state = { li: start.li, hi: start.hi, q: report.token };

  function byId(id) { return document.getElementById(id); }

  /* Create an element; text (user data included) goes in through textContent only. */
  function el(tag, className, text) {
    var node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  /* Sequential color scale (light to dark blue) on sqrt(weight), so small weights stay visible. */
  var STOPS = [[247, 251, 255], [198, 219, 239], [107, 174, 214], [33, 113, 181], [8, 48, 107]];
  function rgb(w) {
    var t = Math.sqrt(Math.min(1, Math.max(0, w))) * (STOPS.length - 1);
    var i = Math.min(STOPS.length - 2, Math.floor(t)), f = t - i, a = STOPS[i], b = STOPS[i + 1];
    return [0, 1, 2].map(function (c) { return Math.round(a[c] + f * (b[c] - a[c])); });
  }
  function css(w) { return "rgb(" + rgb(w).join(",") + ")"; }
  function pct(w) { return (100 * w).toFixed(1) + "%"; }
  function fmt(x) {
    if (x === null || x === undefined) return "\u2014";
    if (Number.isInteger(x)) return String(x);
    var a = Math.abs(x);
    return x.toFixed(a >= 100 ? 0 : a >= 10 ? 1 : 3);
  }
  function weights() { return report.weights[state.li][state.hi]; }
  function role() { return report.roles[state.li][state.hi]; }

  /* ---------------------------------------------------------------- header and controls */
  byId("report-title").textContent = view.title;
  byId("report-model").textContent = report.model;
  byId("report-ntokens").textContent = String(n);
  byId("report-roles-source").textContent = report.roles_from;
  byId("report-text").textContent = report.text;
  if (corpus) {
    byId("report-corpus").textContent = corpus.source;
    byId("report-corpus-meta").hidden = false;
  }
  byId("legend-ramp").style.background = "linear-gradient(to right, " +
    [0, 0.0625, 0.25, 0.5625, 1].map(css).join(", ") + ")";

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

  function selectHead(li, hi) { state.li = li; state.hi = hi; render(); }
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

  /* ---------------------------------------------------------------- heatmap grid */
  var grid = byId("head-grid"), cells = [];
  grid.style.gridTemplateColumns = "auto repeat(" + report.heads.length + ", minmax(58px, 92px))";
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
        cell.appendChild(el("figcaption", "role-label", r.label));
        grid.appendChild(cell);
        return cell;
      }
      canvas.setAttribute("role", "button");
      canvas.setAttribute("tabindex", "0");
      canvas.setAttribute("aria-label", "layer " + layer + ", head " + head + ": " + r.label);
      cell.title = "layer " + layer + ", head " + head + " \u2014 " + r.label + " (" + r.pattern + "): " + r.summary;
      drawSmall(canvas, report.weights[li][hi]);
      canvas.addEventListener("click", function () { selectHead(li, hi); });
      canvas.addEventListener("keydown", function (event) {
        if (event.key === "Enter" || event.key === " ") { event.preventDefault(); selectHead(li, hi); }
      });
      cell.appendChild(canvas);
      cell.appendChild(el("figcaption", "role-label", r.label));
      grid.appendChild(cell);
      return cell;
    }));
  });

  /* One pixel per (query, key); CSS scales it up without smoothing. */
  function drawSmall(canvas, matrix) {
    canvas.width = n; canvas.height = n;
    var ctx = canvas.getContext("2d"), image = ctx.createImageData(n, n);
    for (var q = 0; q < n; q++) for (var k = 0; k < n; k++) {
      var c = rgb(matrix[q][k]), o = 4 * (q * n + k);
      image.data[o] = c[0]; image.data[o + 1] = c[1]; image.data[o + 2] = c[2]; image.data[o + 3] = 255;
    }
    ctx.putImageData(image, 0, 0);
  }

  /* ---------------------------------------------------------------- large heatmap of the selected head */
  var detail = byId("head-detail");
  /* Cells as large as the card allows (at most 30px); token labels (vertical above) when cells fit the text. */
  var layout = (function () {
    var ctx = detail.getContext("2d"), room = Math.max(120, detail.parentElement.clientWidth - 2);
    ctx.font = "11px " + getComputedStyle(document.body).getPropertyValue("--mono");
    var names = report.tokens.map(function (t) { return t.length > 12 ? t.slice(0, 11) + "\u2026" : t; });
    var width = Math.ceil(Math.max.apply(null, names.map(function (t) { return ctx.measureText(t).width; }))) + 8;
    var cell = Math.min(30, Math.floor((room - width) / n));
    if (cell >= 11) return { cell: cell, labels: true, names: names, left: width, top: width };
    return { cell: Math.max(2, Math.min(30, Math.floor(room / n))), labels: false, names: names, left: 0, top: 0 };
  })();
  (function () {
    var dpr = window.devicePixelRatio || 1, w = layout.left + n * layout.cell + 2, h = layout.top + n * layout.cell + 2;
    detail.width = Math.round(w * dpr); detail.height = Math.round(h * dpr);
    detail.style.width = w + "px"; detail.style.height = h + "px";
    detail.getContext("2d").scale(dpr, dpr);
  })();
  function rowAt(event) {
    var box = detail.getBoundingClientRect(), y = event.clientY - box.top - layout.top;
    var x = event.clientX - box.left - layout.left, q = Math.floor(y / layout.cell), k = Math.floor(x / layout.cell);
    return { q: q, k: k, inside: q >= 0 && q < n };
  }
  detail.addEventListener("click", function (event) { var at = rowAt(event); if (at.inside) selectQuery(at.q); });
  detail.addEventListener("mousemove", function (event) {
    var at = rowAt(event);
    detail.title = kept(state.li, state.hi) && at.inside && at.k >= 0 && at.k < n
      ? report.tokens[at.q] + " \u2192 " + report.tokens[at.k] + ": " + pct(weights()[at.q][at.k]) : "";
  });

  function drawDetail() {
    var ctx = detail.getContext("2d"), m = weights(), s = layout.cell, x0 = layout.left, y0 = layout.top;
    ctx.clearRect(0, 0, detail.width, detail.height);
    if (!kept(state.li, state.hi)) return;  /* a pruned head: nothing to draw */
    for (var q = 0; q < n; q++) for (var k = 0; k < n; k++) {
      ctx.fillStyle = css(m[q][k]); ctx.fillRect(x0 + k * s, y0 + q * s, s, s);
    }
    if (layout.labels) {
      ctx.font = "11px " + getComputedStyle(document.body).getPropertyValue("--mono");
      ctx.textBaseline = "middle";
      layout.names.forEach(function (name, i) {
        ctx.fillStyle = i === state.q ? "#c2410c" : view.special[i] ? "#8250df" : "#1f2328";
        ctx.textAlign = "right"; ctx.fillText(name, x0 - 5, y0 + (i + 0.5) * s);
        ctx.save(); ctx.translate(x0 + (i + 0.5) * s, y0 - 5); ctx.rotate(-Math.PI / 2);
        ctx.textAlign = "left"; ctx.fillStyle = view.special[i] ? "#8250df" : "#1f2328"; ctx.fillText(name, 0, 0);
        ctx.restore();
      });
    }
    ctx.strokeStyle = "#e8590c"; ctx.lineWidth = 2;
    ctx.strokeRect(x0 + 1, y0 + state.q * s + 1, n * s - 2, Math.max(2, s - 2));
  }

  /* ---------------------------------------------------------------- where the query attends */
  function drawBars() {
    var bars = byId("attention-bars"), title = byId("bars-title");
    if (!kept(state.li, state.hi)) {
      title.textContent = "Head " + report.heads[state.hi] + " was pruned from layer " + report.layers[state.li];
      bars.textContent = "";
      tokenNodes.forEach(function (node, k) {
        node.classList.toggle("selected", k === state.q);
        node.classList.remove("dark");
        node.style.background = "";
        node.title = "";
      });
      return;
    }
    var row = weights()[state.q], max = Math.max.apply(null, row);
    title.textContent = "";
    title.appendChild(document.createTextNode("Where "));
    title.appendChild(el("code", "", report.tokens[state.q]));
    title.appendChild(document.createTextNode(" (#" + state.q + ") attends in layer " + report.layers[state.li] +
      ", head " + report.heads[state.hi]));
    bars.textContent = "";
    row.forEach(function (w, k) {
      var line = el("div", "weight-row" + (k === state.q ? " is-query" : "") + (w === max ? " is-max" : ""));
      line.setAttribute("data-key", String(k));
      line.setAttribute("data-weight", String(w));
      line.appendChild(el("span", "key-index", k));
      line.appendChild(el("span", "key-token" + (view.special[k] ? " special" : ""), report.tokens[k]));
      var track = el("div", "bar-track"), fill = el("div", "bar-fill");
      fill.style.width = (100 * w) + "%";
      track.appendChild(fill);
      line.appendChild(track);
      line.appendChild(el("span", "weight-pct", pct(w)));
      bars.appendChild(line);
    });
    tokenNodes.forEach(function (node, k) {
      var w = row[k];
      node.classList.toggle("selected", k === state.q);
      node.style.background = css(w);
      node.classList.toggle("dark", Math.sqrt(w) > 0.55);
      node.title = pct(w) + " of the attention of \u201c" + report.tokens[state.q] + "\u201d";
    });
  }

  function drawSummary() {
    var r = role(), box = byId("head-summary");
    box.textContent = "";
    box.appendChild(document.createTextNode(
      "layer " + report.layers[state.li] + " \u00b7 head " + report.heads[state.hi] + ": "));
    box.appendChild(el("span", "role", r.label));
    if (kept(state.li, state.hi)) box.appendChild(el("span", "pill", r.pattern));
    else box.appendChild(document.createTextNode(" \u2014 "));
    box.appendChild(document.createTextNode(r.summary));
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
          var td = el("td", column.text ? "text" : "", column.text ? value : fmt(value));
          if (column.tip) td.title = column.tip(li, hi);
          tr.appendChild(td);
          return value;
        });
        tr.addEventListener("click", function () { selectHead(li, hi); });
        rows.push({ tr: tr, li: li, hi: hi, values: values, order: rows.length });
      });
    });
    var head = el("thead"), headRow = el("tr"), body = el("tbody"), sorted = { index: -1, dir: 1 };
    columns.forEach(function (column, index) {
      var th = el("th", column.text ? "text" : "", column.label);
      th.setAttribute("scope", "col");
      if (column.title) th.title = column.title;
      th.addEventListener("click", function () {
        sorted.dir = sorted.index === index ? -sorted.dir : (column.text ? 1 : -1);
        sorted.index = index;
        Array.prototype.forEach.call(headRow.children, function (other) { other.removeAttribute("aria-sort"); });
        th.setAttribute("aria-sort", sorted.dir > 0 ? "ascending" : "descending");
        rows.sort(function (a, b) {
          var x = a.values[index], y = b.values[index];
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

  var roleColumns = [
    { label: "role", text: true, get: function (li, hi) { return report.roles[li][hi].label; },
      tip: function (li, hi) { return report.roles[li][hi].summary; } },
    { label: "pattern", text: true, get: function (li, hi) { return report.roles[li][hi].pattern; } },
  ];
  var extraColumns = Object.keys(view.extra_columns).map(function (name) {
    return { label: name, get: function (li, hi) { return view.extra_columns[name][li][hi]; } };
  });
  var tableRows = [buildTable(byId("head-stats"),
    headColumns().concat(roleColumns, statColumns(), extraColumns), report.text_stats.stats)];

  if (corpus) {
    var section = el("section", "card");
    var heading = el("h2", "", "Per-head statistics on the corpus ");
    heading.appendChild(el("span", "hint", corpus.source + " \u00b7 " + corpus.tokens + " tokens"));
    var wrap = el("div", "table-wrap"), table = el("table", "stats");
    table.id = "corpus-stats";
    wrap.appendChild(table);
    section.appendChild(heading);
    section.appendChild(wrap);
    byId("corpus-slot").appendChild(section);
    tableRows.push(buildTable(table, headColumns().concat(statColumns()), corpus.stats));
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
  }
  render();
})();
