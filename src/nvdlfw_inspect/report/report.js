"use strict";
(function () {
  const data = JSON.parse(document.getElementById("data").textContent);
  const tooltip = document.getElementById("tooltip");
  const SVG = "http://www.w3.org/2000/svg";
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4d7c0f", "#be185d"];
  const WIDTH = 300, HEIGHT = 130, PAD = { left: 52, right: 8, top: 8, bottom: 18 };
  // Heatmap colours: under the diagnosis's threshold calm (white to green), over it warning to alarm (orange to
  // dark red); a statistic without a threshold on its map's own range, in blues that alarm no one.
  const CALM_STOPS = [[247, 252, 245], [161, 217, 155]];
  const ALARM_STOPS = [[254, 178, 76], [240, 59, 32], [128, 0, 38]];
  const NEUTRAL_STOPS = [[247, 251, 255], [107, 174, 214], [8, 48, 107]];
  const MAX_HEAT_COLUMNS = 1000, MIN_LABELED_ROW = 9, EAGER_LAYERS = 3, FINDINGS_SHOWN = 12;
  const NOT_LOGGED = [238, 240, 243];
  // A warm-up cell: its colour on the scale of the iterations after it, faded toward grey (it sets no colour).
  const WARMUP_GREY = [214, 217, 222], WARMUP_FADE = 0.7;
  const faded = (rgb) => rgb.map((c, k) => Math.round(c + WARMUP_FADE * (WARMUP_GREY[k] - c)));
  const KIND_NAMES = {
    nonfinite: "NaN or inf", overflow: "overflow", underflow: "underflow",
    scale_change: "scale jumps", dynamic_range: "dynamic range beyond the format", peer_outlier: "unlike its peers",
    block_underflow: "blocks flush to zero", block_saturation: "blocks saturate", block_error: "a block loses its values",
    kurtosis_growth: "kurtosis grows", outlier_channel_growth: "an outlier channel grows", scale_drift: "the scale drifts up",
  };

  const number = (v) => (v === null ? NaN : v === "inf" ? Infinity : v === "-inf" ? -Infinity : v);
  function format(v) {
    if (!Number.isFinite(v)) return String(v);
    const magnitude = Math.abs(v);
    if (magnitude !== 0 && (magnitude < 1e-3 || magnitude >= 1e6)) return v.toExponential(3);
    let text = v.toPrecision(5);
    if (text.includes(".")) text = text.replace(/0+$/, "").replace(/\.$/, "");
    return text;
  }
  function element(tag, attributes, text) {
    const node = document.createElement(tag);
    Object.entries(attributes || {}).forEach(([k, v]) => node.setAttribute(k, v));
    if (text !== undefined) node.textContent = text;
    return node;
  }
  function svgElement(tag, attributes) {
    const node = document.createElementNS(SVG, tag);
    Object.entries(attributes || {}).forEach(([k, v]) => node.setAttribute(k, v));
    return node;
  }
  function showTip(text, event) {
    tooltip.textContent = text;
    tooltip.hidden = false;
    tooltip.style.left = event.clientX + 14 + "px";
    tooltip.style.top = event.clientY + 14 + "px";
  }
  const hideTip = () => { tooltip.hidden = true; };

  data.series.forEach((s, i) => { s.id = i; s.it = data.iterations[s.it]; s.values = s.v.map(number); });
  const layerIndex = new Map(data.layers.map((name, i) => [name, i]));
  const byLayer = data.layers.map(() => []);
  data.series.forEach((s) => byLayer[s.layer].push(s));
  let visible = (name) => true;

  function summarize() {
    let first = Infinity, last = -Infinity;
    data.series.forEach((s) => { first = Math.min(first, s.it[0]); last = Math.max(last, s.it[s.it.length - 1]); });
    document.getElementById("summary").textContent =
      `${data.layers.length} layers, ${data.series.length} series, ranks ${data.ranks.join(", ")}, ` +
      `iterations ${first} to ${last}`;
  }

  // A link to the layer's charts; its name alone for a layer without statistics (routing records only).
  const layerLink = (name) =>
    (layerIndex.has(name) ? element("a", { href: `#layer-${layerIndex.get(name)}` }, name) : document.createTextNode(name));
  const percent = (fraction) => `${Math.round(fraction * 100)}%`;

  function diagnosis() {
    const t = data.thresholds, list = document.getElementById("findings");
    list.replaceChildren();
    const rule = `underflows% over ${t.underflow_pct}, overflows% over ${t.overflow_pct}, a scale jumping by more than ` +
      `x${t.scale_change}, a dynamic range beyond its per-tensor FP8 format's (${t.fp8_format}), a magnitude x${t.peer_ratio} away from ` +
      `its peers', per block of a block format its own calibrated thresholds; a problem when over its threshold in ` +
      `${percent(t.persistence)} of the iterations after the first ${t.warmup} (warm-up), or in the median of the last ${percent(t.tail)}`;
    const unmeasured = (data.unmeasured ? ` Not measured: ${data.unmeasured}.` : "") +
      (data.skipped ? ` Skipped: ${data.skipped}.` : "");
    const caution = document.getElementById("diagnosis-caution");
    caution.textContent = data.caution ? `Caution: ${data.caution}.` : "";
    caution.hidden = !data.caution;
    document.getElementById("diagnosis-summary").textContent = (data.findings.length
      ? `${data.findings.length} finding${data.findings.length > 1 ? "s" : ""}, the most severe first (${rule}).`
      : `No NaN or inf, and nothing persists over its threshold ${data.unmeasured ? "among what was logged " : ""}(${rule}).`) +
      unmeasured;
    const more = document.getElementById("more-findings");
    more.replaceChildren();
    const shown = data.findings.filter((f) => visible(f.layer));
    if (shown.length > FINDINGS_SHOWN) {  // the rest folded, so the risk table stays in sight
      const details = element("details");
      details.appendChild(element("summary", {}, `${shown.length - FINDINGS_SHOWN} more findings`));
      details.appendChild(element("ol", { start: FINDINGS_SHOWN + 1 }));
      more.appendChild(details);
    }
    shown.forEach((f, n) => {
      const item = element("li", { class: `finding ${f.kind}` });
      const head = element("div", { class: "finding-head" });
      head.appendChild(layerLink(f.layer));
      if (f.format_name) head.appendChild(element("span", { class: "format" }, ` (${f.format_name})`));
      head.appendChild(document.createTextNode(` ${f.tensor}: `));
      head.appendChild(element("b", {}, KIND_NAMES[f.kind] || f.kind));
      head.appendChild(document.createTextNode(` (${f.stat}) from iteration ${f.first_iteration}`));
      item.appendChild(head);
      item.appendChild(element("div", { class: "message" }, f.message));
      f.remedies.forEach((r) => {
        const where = r.gemms.length ? ` on ${r.gemms.join(" and ")}` : "";
        item.appendChild(element("div", { class: "remedy" }, `fix: ${r.feature}${where}: ${r.reason}`));
      });
      (n < FINDINGS_SHOWN ? list : more.querySelector("ol")).appendChild(item);
    });
    const inPlace = document.getElementById("in-place"), entries = (data.in_place || []).filter((e) => visible(e.layer));
    inPlace.hidden = !entries.length;
    inPlace.querySelector("ul").replaceChildren(...entries.map((e) => {
      const item = element("li", { class: `in-place ${e.verdict.replace(/ /g, "-")}` });
      item.appendChild(layerLink(e.layer));
      item.appendChild(document.createTextNode(` ${e.tensor}: `));
      item.appendChild(element("b", {}, e.verdict));
      item.appendChild(element("div", { class: "message" }, e.message));
      return item;
    }));
    const config = document.getElementById("remedy-config");
    config.hidden = !data.config_yaml;
    config.querySelector("pre").textContent = data.config_yaml || "";
  }

  // The page's top: where the run first held NaN or inf (NonfiniteGuard's finding, else the statistics') and every
  // early warning (a growth finding) from where it began, whatever the filter: what to read first.
  function firstSigns() {
    const first = data.first_nonfinite, line = document.getElementById("first-nonfinite");
    line.replaceChildren();
    if (!first) {
      line.textContent = "No non-finite value logged.";
    } else if (first.source === "guard" && first.layer === null) {
      line.className = "bad";
      line.textContent = `First non-finite value (NonfiniteGuard): step ${first.iteration}, on another rank of the ` +
        `reduction group (rank ${first.rank}'s tensors were finite).`;
    } else {
      line.className = "bad";
      line.appendChild(document.createTextNode(
        `First non-finite value (${first.source === "guard" ? "NonfiniteGuard" : "the first statistic logged as NaN or inf"}): `));
      line.appendChild(layerLink(first.layer));
      const what = first.source === "guard"
        ? ` ${first.tensor} of the ${first.gemm} GEMM, micro-batch ${first.micro_batch}, at step ${first.iteration}`
        : ` ${first.tensor} ${first.stat}, at iteration ${first.iteration}`;
      line.appendChild(document.createTextNode(`${what} (rank ${first.rank}).`));
    }
    const warnings = data.early_warnings, note = document.getElementById("early-warnings-note");
    note.textContent = warnings.length
      ? `${warnings.length} early warning${warnings.length > 1 ? "s" : ""} (a statistic that grows over its start, ` +
        `before the loss shows it), the earliest first:`
      : "No early warning.";
    document.getElementById("early-warnings").replaceChildren(...warnings.map((w) => {
      const item = element("li", { class: `early-warning ${w.kind}` });
      item.appendChild(layerLink(w.layer));
      item.appendChild(document.createTextNode(` ${w.tensor}: `));
      item.appendChild(element("b", {}, KIND_NAMES[w.kind] || w.kind));
      item.appendChild(document.createTextNode(` (${w.kind}, ${w.stat}) from iteration ${w.iteration}`));
      return item;
    }));
  }

  function statCell(cell) {
    if (!cell) return element("td", { class: "unlogged", title: "not logged" }, "-");
    const end = number(cell.persistent);  // NaN or inf when the run ends broken
    const td = element("td", !Number.isFinite(end) ? { class: "bad" } : cell.above > 0 ? {} : { class: "quiet" });
    td.appendChild(element("div", {}, format(end)));
    const over = cell.threshold === null ? "not judged: no per-tensor FP8 scale" : `over ${format(cell.threshold)} in ${percent(cell.above)}`;
    // the worst after warm-up; the warm-up's set aside, named after it where larger and over the threshold, and a run
    // all warm-up said so
    const early = cell.warmup_worst === null ? NaN : number(cell.warmup_worst);
    const warmup = cell.warmup_only ? " (all warm-up)"
      : early > number(cell.worst) && (cell.threshold === null || early > cell.threshold)
        ? `; warm-up ${format(early)} at ${cell.warmup_worst_iteration}` : "";
    td.appendChild(element("div", { class: "sub" }, `${over}; worst ${format(cell.worst)} at ${cell.worst_iteration}${warmup}`));
    return td;
  }

  function riskTable() {
    const body = document.querySelector("#risks tbody");
    body.replaceChildren();
    document.getElementById("risks-note").textContent = data.risks.length
      ? `Per tensor, each value at the end of the run (the median of the last ${percent(data.thresholds.tail)} of the ` +
        `iterations after warm-up), then the share of those iterations over its threshold and the worst value after ` +
        `warm-up with its iteration (the warm-up's beside it where larger). Ranked on the losses at the end against their ` +
        `thresholds; a statistic over its threshold in a passing spike is a transient, and only in warm-up (the first ` +
        `${data.thresholds.warmup} iteration${data.thresholds.warmup === 1 ? "" : "s"}) a warm-up transient. Problems are the diagnosis's findings, in its order; a dynamic range beyond its ` +
        `format's is a problem only where underflows% was not logged, and where it was, a caution: underflows% tells ` +
        `how much is lost. The format is the one the layer's GEMMs read the tensor in (its statistics describe the ` +
        `first GEMM's); the dynamic range of a tensor read without a per-tensor FP8 scale (block formats, whose every ` +
        `block has its own scale, and high precision) has no threshold.`
      : "No underflows%, overflows% or dynamic_range was logged.";
    data.risks.filter((r) => visible(r.layer)).forEach((r) => {
      const row = element("tr");
      const cell = element("td");
      cell.appendChild(layerLink(r.layer));
      row.appendChild(cell);
      row.appendChild(element("td", {}, r.tensor));
      row.appendChild(r.format ? element("td", {}, r.format)
        : element("td", { class: "unlogged", title: `no format in the routing records: judged as FP8 (${data.thresholds.fp8_format})` }, "-"));
      ["underflows%", "overflows%", "dynamic_range"].forEach((stat) => row.appendChild(statCell(r.stats[stat])));
      const broken = r.nonfinite !== null;
      row.appendChild(element("td", broken ? { class: "bad" } : {}, broken ? String(r.nonfinite) : ""));
      const status = element("td", { class: r.problem ? "bad" : r.caution ? "caution" : "transient" });
      r.status.forEach((label) => status.appendChild(element("div", {}, label)));
      row.appendChild(status);
      body.appendChild(row);
    });
  }

  // The precision map: a line's class and text for one tensor's routing (the cell's colour says what kind).
  const ROUTE_CLASSES = { fp8: "route-fp8", high_precision: "route-hp", modified: "route-modified" };
  const routeClass = (p) => (!p.recipe && p.decision === "high_precision" ? "route-norecipe" : ROUTE_CLASSES[p.decision]);
  function routeText(p) {
    if (p.decision === "fp8") return p.format_name || "FP8";
    if (p.decision === "modified") return p.feature || "modified";
    if (!p.recipe) return "high precision (no recipe)";
    const why = p.feature || p.reason;
    return why ? `high precision \u2014 ${why}` : "high precision";
  }
  // One line for the GEMM when its operands agree, else one per tensor ("activation: FakeQuant").
  function routeLines(parts) {
    const same = parts.length && parts.every((p) => p.decision !== "modified" && routeText(p) === routeText(parts[0]));
    return same ? [[routeClass(parts[0]), routeText(parts[0])]] : parts.map((p) => [routeClass(p), `${p.tensor}: ${routeText(p)}`]);
  }
  const ROUTE_LEGEND = [
    ["route-fp8", "FP8 (or the recipe's format: MXFP8, NVFP4, ...): the recipe's quantized operands"],
    ["route-hp", "high precision \u2014 the feature that kept the GEMM unquantized, or why the framework did not run it (a module left unconverted)"],
    ["route-modified", "tensor: the feature whose modify_tensor made the operand"],
    ["route-norecipe", "high precision (no recipe): no FP8 recipe was active"],
  ];

  function precisionMap() {
    const map = data.precision_map, body = document.querySelector("#precision-map tbody");
    const table = document.getElementById("precision-map"), legendBox = document.getElementById("precision-legend");
    body.replaceChildren();
    legendBox.replaceChildren();
    if (!map.layers.length) {
      document.getElementById("precision-note").textContent = "No routing records in this run " +
        "(nvdlfw_inspect_routing_jsonl/ is missing or empty: older versions and other frameworks do not write them), " +
        "so which GEMMs ran in FP8 is not shown.";
      table.hidden = legendBox.hidden = true;
      return;
    }
    const differ = map.ranks_differ.length
      ? ` Ranks recorded ${map.ranks_differ.join(", ")} differently: shown as the lowest rank recorded them.` : "";
    document.getElementById("precision-note").textContent = "What each GEMM consumed, per layer in model order, from " +
      "the routing records; a cell whose routing changed lists each state with the iteration it held from." + differ;
    ROUTE_LEGEND.forEach(([name, text]) => legendBox.appendChild(element("span", { class: `route ${name}` }, text)));
    map.layers.forEach((name, i) => {
      if (!visible(name)) return;
      const row = element("tr");
      const head = element("td");
      head.appendChild(layerLink(name));
      row.appendChild(head);
      map.cells[i].forEach((periods) => {
        const cell = element("td", { class: "routing" });
        if (!periods.length) cell.appendChild(element("div", { class: "unlogged", title: "no routing record" }, "-"));
        periods.forEach((period) => {
          const box = element("div", { class: "period" });
          routeLines(period.parts).forEach(([name, text]) => box.appendChild(element("div", { class: `route ${name}` }, text)));
          if (periods.length > 1) box.appendChild(element("div", { class: "sub" }, `from iteration ${period.from}`));
          cell.appendChild(box);
        });
        row.appendChild(cell);
      });
      body.appendChild(row);
    });
  }

  function ramp(stops, t) {
    const scaled = Math.min(Math.max(t, 0), 1) * (stops.length - 1);
    const i = Math.min(Math.floor(scaled), stops.length - 2), f = scaled - i;
    return stops[i].map((c, k) => Math.round(c + f * (stops[i + 1][k] - c)));
  }

  // The colour of a value: against the threshold the diagnosis judges the statistic by (calm up to it, from
  // warning at it to alarm at the map's largest value), else on the map's own range.
  function heatScale(low, high, threshold) {
    if (threshold === null) return (v) => ramp(NEUTRAL_STOPS, high > low ? (v - low) / (high - low) : 1);
    const floor = Math.min(low, 0);
    return (v) => (v <= threshold
      ? ramp(CALM_STOPS, threshold > floor ? (v - floor) / (threshold - floor) : 1)
      : ramp(ALARM_STOPS, (v - threshold) / (high - threshold)));
  }

  function rowLabels(layers, rowScale) {
    const labels = element("div", { class: "row-labels" });
    layers.forEach((l) => {
      const label = element("div", { title: data.layers[l] }, data.layers[l]);
      label.style.height = label.style.lineHeight = rowScale + "px";
      labels.appendChild(label);
    });
    return labels;
  }

  function swatch(rgb, text) {
    const box = element("span", { class: "swatch" });
    const color = element("i");
    color.style.background = `rgb(${rgb.join(",")})`;
    box.appendChild(color);
    box.appendChild(document.createTextNode(text));
    return box;
  }

  function colorBar(stops) {
    const bar = element("canvas", { width: 64, height: 1 });
    const context = bar.getContext("2d");
    const image = context.createImageData(64, 1);
    for (let i = 0; i < 64; i++) image.data.set([...ramp(stops, i / 63), 255], i * 4);
    context.putImageData(image, 0, 0);
    return bar;
  }

  function legend(low, high, threshold, broken, missing, formatsDiffer, warm) {
    const box = element("div", { class: "legend" });
    if (low <= high && threshold === null) {  // the colour scale, where any value is finite
      const why = formatsDiffer ? "its layers' formats differ" : "this map's own range";
      box.appendChild(element("span", {}, format(low)));
      box.appendChild(colorBar(NEUTRAL_STOPS));
      box.appendChild(element("span", {}, `${format(high)} (no threshold: ${why})`));
    } else if (low <= high) {
      box.appendChild(element("span", {}, format(Math.min(low, 0))));
      box.appendChild(colorBar(CALM_STOPS));
      box.appendChild(element("span", {}, `threshold ${format(threshold)}`));
      if (high > threshold) {
        box.appendChild(colorBar(ALARM_STOPS));
        box.appendChild(element("span", {}, format(high)));
      }
    }
    if (warm === "faded") {
      box.appendChild(swatch(faded(ALARM_STOPS[1]), `warm-up (before iteration ${data.warmup_end}): faded, outside the scale`));
    } else if (warm === "all") {
      box.appendChild(element("span", {}, `every iteration is warm-up (before ${data.warmup_end}): its values set the scale`));
    }
    if (broken) box.appendChild(swatch([0, 0, 0], "NaN or inf"));
    if (missing) box.appendChild(swatch(NOT_LOGGED, "not logged"));
    return box;
  }

  function heatmap(title, group) {
    const layers = [...new Set(group.map((s) => s.layer))].filter((l) => visible(data.layers[l])).sort((a, b) => a - b);
    const iterations = [...new Set(group.flatMap((s) => s.it))].sort((a, b) => a - b);
    if (!layers.length || !iterations.length) return null;
    const columns = Math.min(iterations.length, MAX_HEAT_COLUMNS);
    const columnOf = new Map(iterations.map((it, i) => [it, Math.floor((i * columns) / iterations.length)]));
    const rowOf = new Map(layers.map((l, i) => [l, i]));
    // The scale is set by the iterations after warm-up (data.warmup_end on), unless the run has no other: the warm-up's
    // values, kept apart (a cell of many iterations shows the ones after warm-up), are drawn faded on it.
    const allWarmup = iterations[iterations.length - 1] < data.warmup_end;
    const cells = new Float64Array(columns * layers.length).fill(NaN);
    const warmCells = new Float64Array(columns * layers.length).fill(NaN);
    const broken = new Uint8Array(columns * layers.length);
    let low = Infinity, high = -Infinity, warmLow = Infinity, warmHigh = -Infinity, anyBroken = false;
    group.forEach((s) => {
      if (!rowOf.has(s.layer)) return;
      s.values.forEach((v, k) => {
        const at = rowOf.get(s.layer) * columns + columnOf.get(s.it[k]);
        if (!Number.isFinite(v)) { broken[at] = 1; anyBroken = true; return; }
        if (!allWarmup && s.it[k] < data.warmup_end) {
          if (!(warmCells[at] >= v)) warmCells[at] = v;
          warmLow = Math.min(warmLow, v); warmHigh = Math.max(warmHigh, v);
          return;
        }
        if (!(cells[at] >= v)) cells[at] = v;
        low = Math.min(low, v); high = Math.max(high, v);
      });
    });
    if (low > high) { low = warmLow; high = warmHigh; }  // nothing finite after warm-up: the warm-up's scale
    if (!anyBroken && low > high) return null;  // nothing to draw
    const warmDrawn = warmLow <= warmHigh;  // a warm-up value drawn faded
    const warmDiffers = warmDrawn && (warmLow !== low || warmHigh !== high);
    // one tensor and stat: one threshold, unless its layers' formats give them different ones (or none)
    const thresholds = new Set(group.filter((s) => rowOf.has(s.layer)).map((s) => s.threshold));
    const formatsDiffer = thresholds.size > 1, threshold = formatsDiffer ? null : [...thresholds][0];
    const against = threshold === null ? "" : `, ${low > threshold ? "over" : "within"} its threshold ${format(threshold)}`;
    if (!anyBroken && low === high) {  // one value everywhere: said in words, not drawn as a blank map
      const after = warmDiffers ? " after warm-up" : "";
      const aside = warmDiffers ? `; in warm-up ${format(warmLow)} to ${format(warmHigh)}` : "";
      return element("p", { class: "flat" },
        `${title}: ${format(low)} in every logged cell${after}${against} (${layers.length} layer${layers.length > 1 ? "s" : ""}, ` +
        `iterations ${iterations[0]} to ${iterations[iterations.length - 1]})${aside}`);
    }
    const color = heatScale(low, high, threshold);
    const canvas = element("canvas", { width: columns, height: layers.length });  // as wide as the page (CSS)
    const rowScale = Math.max(1, Math.min(14, Math.floor(480 / layers.length)));
    canvas.style.height = layers.length * rowScale + "px";
    const context = canvas.getContext("2d");
    const image = context.createImageData(columns, layers.length);
    let missing = false;
    for (let i = 0; i < cells.length; i++) {
      const empty = Number.isNaN(cells[i]) && Number.isNaN(warmCells[i]);
      missing = missing || (!broken[i] && empty);
      const rgb = broken[i] ? [0, 0, 0] : empty ? NOT_LOGGED
        : Number.isNaN(cells[i]) ? faded(color(warmCells[i])) : color(cells[i]);
      image.data.set([...rgb, 255], i * 4);
    }
    context.putImageData(image, 0, 0);
    const where = (event) => {
      const box = canvas.getBoundingClientRect();
      const column = Math.floor(((event.clientX - box.left) / box.width) * columns);
      const row = Math.floor(((event.clientY - box.top) / box.height) * layers.length);
      return { column: Math.min(Math.max(column, 0), columns - 1), row: Math.min(Math.max(row, 0), layers.length - 1) };
    };
    canvas.addEventListener("mousemove", (event) => {
      const { column, row } = where(event);
      const first = iterations[Math.ceil((column * iterations.length) / columns)];
      const at = row * columns + column;
      const value = broken[at] ? "NaN or inf" : !Number.isNaN(cells[at]) ? format(cells[at])
        : !Number.isNaN(warmCells[at]) ? `${format(warmCells[at])} (warm-up, outside the scale)` : "not logged";
      showTip(`${data.layers[layers[row]]}\niteration ${first}\n${title}: ${value}`, event);
    });
    canvas.addEventListener("mouseleave", hideTip);
    canvas.addEventListener("click", (event) => {
      const target = document.getElementById(`layer-${layers[where(event).row]}`);
      if (target) target.scrollIntoView();
    });
    const box = element("div", { class: "heatmap" });
    box.appendChild(element("div", { class: "caption" }, title));
    const warm = warmDrawn ? "faded" : allWarmup ? "all" : null;
    box.appendChild(legend(low, high, threshold, anyBroken, missing, formatsDiffer, warm));
    const body = element("div", { class: "heatmap-body" });
    if (rowScale >= MIN_LABELED_ROW) body.appendChild(rowLabels(layers, rowScale));
    const plot = element("div", { class: "plot" });
    plot.appendChild(canvas);
    const axis = element("div", { class: "axis" });
    axis.appendChild(element("span", {}, `iteration ${iterations[0]}`));
    axis.appendChild(element("span", {}, String(iterations[iterations.length - 1])));
    plot.appendChild(axis);
    body.appendChild(plot);
    box.appendChild(body);
    return box;
  }

  function heatmaps() {
    const container = document.getElementById("heatmaps");
    container.replaceChildren();
    const groups = new Map();
    data.series.filter((s) => s.heatmap).forEach((s) => {
      const key = `${s.tensor} ${s.stat}`;
      if (!groups.has(key)) groups.set(key, []);
      groups.get(key).push(s);
    });
    [...groups.keys()].sort().forEach((key) => {
      const box = heatmap(key, groups.get(key));
      if (box) container.appendChild(box);
    });
    if (!container.children.length) container.appendChild(element("p", {}, "No underflows%, overflows% or dynamic range logged (or none of the layers the filter shows)."));
  }

  function lineChart(title, list) {
    const iterations = [...new Set(list.flatMap((s) => s.it))].sort((a, b) => a - b);
    const full = [iterations[0], iterations[iterations.length - 1]];
    let domain = full.slice(), dragFrom = null;
    const svg = svgElement("svg", { width: WIDTH, height: HEIGHT, viewBox: `0 0 ${WIDTH} ${HEIGHT}` });
    const plotWidth = WIDTH - PAD.left - PAD.right, plotHeight = HEIGHT - PAD.top - PAD.bottom;
    const xOf = (it) => PAD.left + ((it - domain[0]) / (domain[1] - domain[0] || 1)) * plotWidth;
    const itOf = (x) => domain[0] + ((x - PAD.left) / plotWidth) * (domain[1] - domain[0]);
    const band = svgElement("rect", { class: "zoom", y: PAD.top, height: plotHeight, width: 0 });

    function draw() {
      svg.replaceChildren();
      let low = Infinity, high = -Infinity;
      list.forEach((s) => s.values.forEach((v, k) => {
        if (Number.isFinite(v) && s.it[k] >= domain[0] && s.it[k] <= domain[1]) { low = Math.min(low, v); high = Math.max(high, v); }
      }));
      if (low > high) { low = 0; high = 1; }
      if (low === high && low === 0) high = 1;  // all zero: a line along the bottom of a 0..1 axis
      else if (low === high) { const pad = Math.abs(low) * 0.05; low -= pad; high += pad; }
      const yOf = (v) => PAD.top + (1 - (v - low) / (high - low)) * plotHeight;
      [[format(high), PAD.top + 8], [format(low), PAD.top + plotHeight]].forEach(([text, y]) => {
        const label = svgElement("text", { x: 2, y });
        label.textContent = text;
        svg.appendChild(label);
      });
      [[String(domain[0]), PAD.left, "start"], [String(domain[1]), WIDTH - PAD.right, "end"]].forEach(([text, x, anchor]) => {
        const label = svgElement("text", { x, y: HEIGHT - 4, "text-anchor": anchor });
        label.textContent = text;
        svg.appendChild(label);
      });
      svg.appendChild(svgElement("line", { x1: PAD.left, x2: PAD.left, y1: PAD.top, y2: PAD.top + plotHeight, stroke: "#c4c9d2" }));
      list.forEach((s, n) => {
        let path = "", pen = false;
        s.values.forEach((v, k) => {
          const it = s.it[k];
          if (it < domain[0] || it > domain[1]) { pen = false; return; }
          if (!Number.isFinite(v)) {
            const x = xOf(it);
            svg.appendChild(svgElement("line", { class: "nonfinite", x1: x, x2: x, y1: PAD.top + plotHeight - 6, y2: PAD.top + plotHeight }));
            pen = false;
            return;
          }
          path += `${pen ? "L" : "M"}${xOf(it).toFixed(1)},${yOf(v).toFixed(1)}`;
          pen = true;
        });
        svg.appendChild(svgElement("path", { d: path || "M0,0", fill: "none", stroke: COLORS[n % COLORS.length], "stroke-width": 1.5 }));
      });
      svg.appendChild(band);
    }

    const localX = (event) => event.clientX - svg.getBoundingClientRect().left;
    svg.addEventListener("mousedown", (event) => { dragFrom = localX(event); event.preventDefault(); });
    svg.addEventListener("mousemove", (event) => {
      const x = localX(event);
      if (dragFrom !== null) {
        band.setAttribute("x", Math.min(dragFrom, x));
        band.setAttribute("width", Math.abs(x - dragFrom));
        return;
      }
      const target = itOf(x);
      const nearest = iterations.reduce((best, it) => (Math.abs(it - target) < Math.abs(best - target) ? it : best), iterations[0]);
      const lines = list.map((s) => {
        const k = s.it.indexOf(nearest);
        return `${list.length > 1 ? `rank ${s.rank}: ` : ""}${k < 0 ? "-" : format(s.values[k])}`;
      });
      showTip(`${title}\niteration ${nearest}\n${lines.join("\n")}`, event);
    });
    svg.addEventListener("mouseup", (event) => {
      const x = localX(event);
      if (dragFrom !== null && Math.abs(x - dragFrom) > 3) {
        const a = itOf(Math.min(dragFrom, x)), b = itOf(Math.max(dragFrom, x));
        domain = [Math.max(full[0], a), Math.min(full[1], b)];
      }
      dragFrom = null;
      band.setAttribute("width", 0);
      draw();
    });
    svg.addEventListener("mouseleave", () => { hideTip(); dragFrom = null; band.setAttribute("width", 0); });
    svg.addEventListener("dblclick", () => { domain = full.slice(); draw(); });
    draw();
    const box = element("div", { class: "chart" });
    box.appendChild(element("div", { class: "caption" }, title));
    box.appendChild(svg);
    return box;
  }

  function fillLayer(section, index) {
    const groups = new Map();
    byLayer[index].forEach((s) => {
      const key = JSON.stringify([s.direction, s.tensor, s.stat]);  // names may hold any character
      if (!groups.has(key)) groups.set(key, []);
      groups.get(key).push(s);
    });
    const columns = element("div", { class: "directions" });
    ["forward", "backward", "other"].forEach((direction) => {
      const keys = [...groups.keys()].filter((k) => JSON.parse(k)[0] === direction).sort();
      if (!keys.length) return;
      const column = element("div", { class: "direction" });
      column.appendChild(element("h4", {}, direction));
      keys.forEach((key) => {
        const [, tensor, stat] = JSON.parse(key);
        column.appendChild(lineChart(`${tensor} ${stat}`, groups.get(key)));
      });
      columns.appendChild(column);
    });
    section.appendChild(columns);
  }

  function layers() {
    const container = document.getElementById("layers");
    const observer = new IntersectionObserver((entries) => entries.forEach((entry) => {
      if (!entry.isIntersecting) return;
      observer.unobserve(entry.target);
      fillLayer(entry.target, Number(entry.target.dataset.index));
    }), { rootMargin: "400px" });
    data.layers.forEach((name, index) => {
      const section = element("div", { class: "layer", id: `layer-${index}`, "data-index": index });
      section.appendChild(element("h3", {}, name));
      container.appendChild(section);
      if (index < EAGER_LAYERS) fillLayer(section, index);  // the first ones at once: the page is whole when its script ends
      else observer.observe(section);
    });
  }

  function applyFilter(text) {
    let pattern = null;
    try { pattern = text ? new RegExp(text, "i") : null; } catch (error) { pattern = null; }
    const lower = text.toLowerCase();
    visible = !text ? () => true : pattern ? (name) => pattern.test(name) : (name) => name.toLowerCase().includes(lower);
    document.querySelectorAll(".layer").forEach((section) => {
      section.hidden = !visible(data.layers[Number(section.dataset.index)]);
    });
    diagnosis();
    riskTable();
    precisionMap();
    heatmaps();
  }

  summarize();
  firstSigns();
  diagnosis();
  riskTable();
  precisionMap();
  heatmaps();
  layers();
  document.getElementById("filter").addEventListener("input", (event) => applyFilter(event.target.value));
  document.body.dataset.ready = "true";
})();
