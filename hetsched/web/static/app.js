// The planner page: build a cluster spec from the form, solve it through the API, draw the plan.
// Plain DOM and SVG; no framework, no build step.
"use strict";

const state = { accelerators: [], models: [], plan: null, colors: new Map() };
const PALETTE = ["#1f77b4", "#d95f02", "#1b9e77", "#7570b3", "#e7298a", "#66a61e", "#a6761d", "#e6ab02",
                 "#386cb0", "#bf5b17", "#666666", "#17becf"];
const SVG = "http://www.w3.org/2000/svg";

const $ = (sel, root = document) => root.querySelector(sel);
const $$ = (sel, root = document) => Array.from(root.querySelectorAll(sel));

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "text") node.textContent = v; else node.setAttribute(k, v === true ? "" : v);
  }
  for (const child of children) node.append(child);
  return node;
}

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

const money = (x) => `$${Number(x).toLocaleString("en-US", { minimumFractionDigits: 2, maximumFractionDigits: 2 })}`;
const num = (x, digits = 2) => Number(x).toLocaleString("en-US", { maximumFractionDigits: digits });
const signed = (x) => (x > 0 ? "+" : x < 0 ? "−" : "±") + money(Math.abs(x));

// --- API -----------------------------------------------------------------------------------------------------

async function api(method, path, body) {
  const headers = { Accept: "application/json" };
  const token = $("#token").value.trim();
  if (token) headers.Authorization = `Bearer ${token}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  const data = response.status === 204 ? null : await response.json().catch(() => null);
  if (!response.ok) {
    const detail = data && data.detail ? data.detail : `${response.status} ${response.statusText}`;
    const error = new Error(detail);
    error.field = data && data.field;
    error.status = response.status;
    throw error;
  }
  return data;
}

function say(target, message, kind = "") {
  const node = $(target);
  node.textContent = message;
  node.className = kind;
}

// --- form rows -----------------------------------------------------------------------------------------------

function cell(input, label) {
  input.setAttribute("aria-label", label);
  return el("td", {}, input);
}

function numberInput(name, value, { min = 0, step = "any", placeholder = "" } = {}) {
  return el("input", { type: "number", name, value: value ?? "", min, step, placeholder, inputmode: "decimal" });
}

function removeButton(label) {
  const button = el("button", { type: "button", class: "remove", "aria-label": label, text: "Remove" });
  button.addEventListener("click", () => button.closest("tr").remove());
  return el("td", {}, button);
}

function modelSelect(value) {
  const select = el("select", { name: "model" });
  for (const source of ["bundled", "uploaded"]) {
    const names = state.models.filter((m) => m.source === source);
    if (!names.length) continue;
    const group = el("optgroup", { label: source === "bundled" ? "Bundled" : "Uploaded" });
    for (const m of names) {
      const size = m.total_params_b === m.active_params_b ? `${num(m.total_params_b, 1)}B`
        : `${num(m.total_params_b, 1)}B, ${num(m.active_params_b, 1)}B active`;
      group.append(el("option", { value: m.name, text: `${m.name} (${size})` }));
    }
    select.append(group);
  }
  if (value && !state.models.some((m) => m.name === value)) select.append(el("option", { value, text: value }));
  if (value) select.value = value;
  return select;
}

function addModelRow(m = {}) {
  const n = $("#models tbody").rows.length + 1;
  const w = m.workload || {};
  // a model loaded without an SLO keeps none (its capacity rows were measured at one); a new row starts with one
  const slo = m.slo ?? (m.name ? {} : { ttft_ms: 1000, tpot_ms: 100 });
  const row = el("tr", {},
    cell(modelSelect(m.name || "llama-3.1-8b"), `Model ${n}`),
    cell(numberInput("rate", w.rate_rps ?? 10), `Requests per second, model ${n}`),
    cell(numberInput("input", w.input_tokens ?? 1024, { min: 1, step: 1 }), `Prompt tokens, model ${n}`),
    cell(numberInput("output", w.output_tokens ?? 256, { min: 1, step: 1 }), `Output tokens, model ${n}`),
    cell(numberInput("ttft", slo.ttft_ms, { min: 1 }), `TTFT milliseconds, model ${n}`),
    cell(numberInput("tpot", slo.tpot_ms, { min: 1 }), `TPOT milliseconds, model ${n}`),
    cell(numberInput("min", m.min_replicas ?? 1, { step: 1 }), `Minimum replicas, model ${n}`),
    removeButton(`Remove model ${n}`));
  row.dataset.extra = JSON.stringify(extraFields(m, ["name", "slo", "workload", "min_replicas"]));
  row.dataset.slo = JSON.stringify(m.slo || {});
  if (w.buckets || w.distribution) {
    // request-size buckets or a distribution from a loaded file: kept as they are, only the rate is edited here
    row.dataset.workload = JSON.stringify(w);
    for (const name of ["input", "output"]) {
      const input = $(`[name=${name}]`, row);
      input.disabled = true;
      input.value = "";
      input.placeholder = w.buckets ? `${w.buckets.length} buckets` : "distribution";
      input.title = "set by the loaded cluster file";
    }
  }
  $("#models tbody").append(row);
  return row;
}

function accelSelect(value) {
  const select = el("select", { name: "accelerator" });
  for (const a of state.accelerators) {
    select.append(el("option", { value: a.id, text: `${a.id} — ${a.name}, ${num(a.memory_gb, 0)} GB` }));
  }
  for (const a of loadedAccelerators) {
    select.append(el("option", { value: a.id, text: `${a.id} — not in the catalog (capacity rows only)` }));
  }
  select.value = value || "h100-sxm";
  return select;
}

function addPoolRow(p = {}) {
  const n = $("#pools tbody").rows.length + 1;
  const accel = accelSelect(p.accelerator);
  const price = numberInput("price", p.price_per_hour);
  const gpn = numberInput("gpus", p.gpus_per_node, { min: 1, step: 1 });
  const mig = el("input", { type: "checkbox", name: "mig" });
  mig.checked = Boolean(p.partition_allowed ?? p.mig_allowed);
  const sync = () => {
    const a = state.accelerators.find((x) => x.id === accel.value) ?? loadedAccelerators.find((x) => x.id === accel.value);
    price.placeholder = a ? num(a.price_per_hour) : "";
    gpn.placeholder = a ? String(a.gpus_per_node) : "";
    mig.disabled = !(a && a.splittable);
    if (mig.disabled) mig.checked = false;
  };
  accel.addEventListener("change", sync);
  const name = el("input", { name: "pool", value: p.name || `pool-${n}`, required: true });
  const row = el("tr", {},
    cell(name, `Pool name ${n}`), cell(accel, `Accelerator, pool ${n}`),
    cell(numberInput("nodes", p.nodes ?? 1, { min: 1, step: 1 }), `Nodes, pool ${n}`),
    cell(gpn, `GPUs per node, pool ${n}`), cell(price, `Price per GPU-hour, pool ${n}`),
    cell(mig, `MIG allowed, pool ${n}`), removeButton(`Remove pool ${n}`));
  row.dataset.extra = JSON.stringify(extraFields(p, ["name", "accelerator", "nodes", "gpus_per_node", "price_per_hour",
                                                      "partition_allowed", "mig_allowed"]));
  $("#pools tbody").append(row);
  sync();
  return row;
}

function addCapacityRow(c = {}) {
  const n = $("#capacities tbody").rows.length + 1;
  const device = el("input", { name: "device", value: c.device || "", list: "devices" });
  const row = el("tr", {},
    cell(el("input", { name: "model", value: c.model || "" }), `Capacity ${n} model`),
    cell(device, `Capacity ${n} device`),
    cell(numberInput("tp", c.tp ?? 1, { min: 1, step: 1 }), `Capacity ${n} tensor parallel`),
    cell(el("input", { name: "bucket", value: c.bucket || "", placeholder: "all" }), `Capacity ${n} bucket`),
    cell(numberInput("rps", c.requests_per_s), `Capacity ${n} requests per second`),
    removeButton(`Remove capacity ${n}`));
  row.dataset.role = c.role || "unified";
  row.dataset.pool = c.pool || "";
  $("#capacities tbody").append(row);
  return row;
}

function extraFields(obj, known) {
  return Object.fromEntries(Object.entries(obj).filter(([k]) => !known.includes(k)));
}

const value = (row, name) => $(`[name=${name}]`, row).value.trim();
const numberOrNull = (text) => (text === "" ? null : Number(text));

function readSpec() {
  const models = $$("#models tbody tr").map((row) => {
    const workload = row.dataset.workload ? { ...JSON.parse(row.dataset.workload), rate_rps: numberOrNull(value(row, "rate")) }
      : { rate_rps: numberOrNull(value(row, "rate")), input_tokens: numberOrNull(value(row, "input")),
          output_tokens: numberOrNull(value(row, "output")) };
    const ttft = numberOrNull(value(row, "ttft"));
    const tpot = numberOrNull(value(row, "tpot"));
    const slo = ttft === null && tpot === null ? undefined  // none: the capacity rows' own
      : { ...JSON.parse(row.dataset.slo || "{}"), ttft_ms: ttft, tpot_ms: tpot };
    return { ...JSON.parse(row.dataset.extra || "{}"), name: value(row, "model"), slo,
             workload, min_replicas: numberOrNull(value(row, "min")) };
  });
  const pools = $$("#pools tbody tr").map((row) => {
    const pool = { ...JSON.parse(row.dataset.extra || "{}"), name: value(row, "pool"),
                   accelerator: value(row, "accelerator"), nodes: numberOrNull(value(row, "nodes")),
                   partition_allowed: $("[name=mig]", row).checked };
    const gpus = numberOrNull(value(row, "gpus"));
    const price = numberOrNull(value(row, "price"));
    if (gpus !== null) pool.gpus_per_node = gpus;
    if (price !== null) pool.price_per_hour = price;
    return pool;
  });
  const capacities = $$("#capacities tbody tr").map((row) => {
    const c = { model: value(row, "model"), device: value(row, "device"), tp: numberOrNull(value(row, "tp")),
                role: row.dataset.role, requests_per_s: numberOrNull(value(row, "rps")) };
    if (value(row, "bucket")) c.bucket = value(row, "bucket");
    if (row.dataset.pool) c.pool = row.dataset.pool;
    return c;
  });
  const headroom = numberOrNull($("#headroom").value);
  const spec = { name: $("#plan-name").value.trim() || "web-plan", pools, models,
                 solver: { ...loadedSolver, time_limit_s: numberOrNull($("#time-limit").value),
                           headroom: headroom === null ? loadedSolver.headroom : headroom / 100 } };
  if (capacities.length) spec.capacities = capacities;
  if (loadedAccelerators.length) spec.accelerators = loadedAccelerators;
  return spec;
}

// Solver settings a loaded cluster file states beyond the form's two (mip_gap, churn_weight, …) travel with it.
let loadedSolver = {};
// Accelerators a loaded cluster file defines that the catalog does not have (known by price and capacity rows).
let loadedAccelerators = [];

function fillForm(spec) {
  for (const id of ["#models", "#pools", "#capacities"]) $(`${id} tbody`).replaceChildren();
  loadedSolver = { ...(spec.solver || {}) };
  loadedAccelerators = [...(spec.accelerators || [])];
  spec.models.forEach(addModelRow);
  spec.pools.forEach(addPoolRow);
  (spec.capacities || []).forEach(addCapacityRow);
  $("#capacities-box").open = Boolean(spec.capacities && spec.capacities.length);
  $("#plan-name").value = spec.name || "web-plan";
  $("#headroom").value = Math.round(100 * (spec.solver?.headroom ?? 0.1));
  $("#time-limit").value = spec.solver?.time_limit_s ?? 10;
}

// Point at the form field a 422 names, e.g. "spec.models[0].slo.ttft_ms".
const FIELD_INPUT = { rate_rps: "rate", input_tokens: "input", output_tokens: "output", ttft_ms: "ttft", tpot_ms: "tpot",
                      min_replicas: "min", name: null, model: "model", accelerator: "accelerator", nodes: "nodes",
                      gpus_per_node: "gpus", price_per_hour: "price", partition_allowed: "mig", requests_per_s: "rps",
                      device: "device", tp: "tp", bucket: "bucket" };

function focusField(field) {
  $$(".invalid").forEach((n) => { n.classList.remove("invalid"); n.removeAttribute("aria-invalid"); });
  const match = /(models|pools|capacities)\[(\d+)\](?:\.[a-z_]+)*?\.([a-z_]+)$/.exec(field || "");
  if (!match) return;
  const row = $(`#${match[1]} tbody`).rows[Number(match[2])];
  if (!row) return;
  const name = match[3] === "name" ? (match[1] === "pools" ? "pool" : "model") : FIELD_INPUT[match[3]];
  const input = name && $(`[name=${name}]`, row);
  if (input) { input.classList.add("invalid"); input.setAttribute("aria-invalid", "true"); input.focus(); }
}

// --- results -------------------------------------------------------------------------------------------------

function colorOf(name) {
  if (!state.colors.has(name)) state.colors.set(name, PALETTE[state.colors.size % PALETTE.length]);
  return state.colors.get(name);
}

function textOn(background) {
  // black or white, whichever reads better on the background (WCAG relative luminance)
  const channel = (i) => {
    const c = parseInt(background.slice(1 + 2 * i, 3 + 2 * i), 16) / 255;
    return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4;
  };
  const luminance = 0.2126 * channel(0) + 0.7152 * channel(1) + 0.0722 * channel(2);
  return luminance > 0.179 ? "#000" : "#fff";
}

function showPlan(stored) {
  state.plan = stored;
  const plan = stored.plan;
  $("#result").hidden = false;
  const gpus = plan.pools.reduce((s, p) => s + p.gpus_used, 0);
  const replicas = plan.models.reduce((s, m) => s + m.replicas.reduce((t, g) => t + g.replicas, 0), 0);
  $("#headline").replaceChildren(
    el("span", { class: `status ${plan.status}`, text: plan.status }), " ",
    plan.status === "infeasible" ? "No plan meets every SLO with this inventory."
      : `${money(plan.cost_per_hour)} per hour · ${gpus} GPUs · ${replicas} replicas`,
    el("span", { class: "muted", text: ` — plan #${stored.id} “${plan.name}”, solved in ${num(plan.solver.time_s, 2)} s` }));
  showExplanation(plan.explanation);
  showTable(plan);
  barChart($("#chart-pools"), plan.pools.filter((p) => p.gpus_total > 0)
    .map((p) => ({ label: `${p.pool} (${p.accelerator})`, value: p.cost_per_hour, color: "#386cb0" })), "Cost per hour by pool");
  barChart($("#chart-models"), Object.entries(plan.cost_by_model)
    .map(([m, v]) => ({ label: m, value: v, color: colorOf(m) })), "Cost per hour by model");
  showMig(plan);
  $("#export-resources").href = `/api/plans/${stored.id}/resources.yaml`;
  $("#export-mig").href = `/api/plans/${stored.id}/mig-parted.yaml`;
  $("#export-dcm").href = `/api/plans/${stored.id}/dcm-config.json`;
  $("#export-dcm-item").hidden = !Object.keys(plan.partition_profiles || {}).length;
  whatIfForm(stored);
  $("#diff").replaceChildren();
  say("#whatif-status", "");
}

function showExplanation(explanation) {
  const box = $("#explanation");
  box.replaceChildren();
  const lists = [["Why there is no plan", explanation.infeasible],
                 ["Binding constraints", explanation.binding.map((b) => `${b.kind.replace(/_/g, " ")}: ${b.detail}`)],
                 ["Step models", (explanation.corrections || [])
                   .map((c) => `${c.model} on ${c.device} TP=${c.tp}: corrected by ${c.label}`)],
                 ["Notes", explanation.notes]];
  for (const [title, items] of lists) {
    if (!items.length) continue;
    box.append(el("h3", { text: title }), el("ul", {}, ...items.map((t) => el("li", { text: t }))));
  }
}

function showTable(plan) {
  const body = $("#plan-table tbody");
  body.replaceChildren();
  for (const model of plan.models) {
    for (const g of model.replicas) {
      const swatch = el("span", { class: "swatch", style: `background:${colorOf(g.model)}`, "aria-hidden": "true" });
      body.append(el("tr", {},
        el("th", { scope: "row" }, swatch, g.model), el("td", { text: g.role }), el("td", { text: g.pool }),
        el("td", { text: g.device }), el("td", { class: "num", text: g.tp }), el("td", { class: "num", text: g.replicas }),
        el("td", { class: "num", text: num(g.load_rps) }), el("td", { class: "num", text: num(g.capacity_rps) }),
        el("td", { class: "num", text: money(g.cost_per_hour) })));
    }
  }
  if (!body.rows.length) body.append(el("tr", {}, el("td", { colspan: 9, text: "No replicas." })));
}

function barChart(container, bars, title) {
  container.replaceChildren();
  if (!bars.length) { container.append(el("p", { class: "muted", text: "Nothing to show." })); return; }
  const rowH = 28, labelW = 190, barW = 260, valueW = 90;
  const max = Math.max(...bars.map((b) => b.value), 1e-9);
  const chart = svg("svg", { width: labelW + barW + valueW, height: bars.length * rowH + 4, role: "img",
                             "aria-label": `${title}: ${bars.map((b) => `${b.label} ${money(b.value)}`).join(", ")}` });
  chart.append(svg("title", {}, title));
  bars.forEach((b, i) => {
    const y = i * rowH + 2;
    const g = svg("g", { class: "bar", "data-label": b.label, "data-value": b.value.toFixed(4) });
    g.append(svg("text", { x: labelW - 8, y: y + rowH / 2 + 4, "text-anchor": "end" }, b.label));
    g.append(svg("rect", { x: labelW, y: y + 4, height: rowH - 8, width: Math.max(1, (b.value / max) * barW),
                           fill: b.color }));
    g.append(svg("text", { x: labelW + (b.value / max) * barW + 6, y: y + rowH / 2 + 4 }, money(b.value)));
    chart.append(g);
  });
  container.append(chart);
}

function showMig(plan) {
  const box = $("#mig");
  box.replaceChildren();
  const geometry = (accel) => state.accelerators.find((a) => a.id === accel)?.mig;
  let drawn = 0;
  for (const node of plan.nodes) {
    const shapes = node.gpus.filter((g) => g.instances.length)
      .map((gpu) => [gpu, gpu.mode === "mig" ? geometry(node.accelerator) : gpu.mode === "partitioned" ? partitionShape(gpu) : null])
      .filter(([, shape]) => shape);
    if (!shapes.length) continue;
    const caption = `${node.name} (${node.accelerator}${node.partition_profile ? `, profile ${node.partition_profile}` : ""})`;
    const figure = el("figure", { class: "node" }, el("figcaption", { text: caption }));
    for (const [gpu, shape] of shapes) figure.append(migGpu(node, gpu, shape));
    drawn += shapes.length;
    box.append(figure);
  }
  if (!drawn) box.append(el("p", { class: "muted", text: "No GPU is split in this plan." }));
}

// An AMD partitioned GPU, drawn as a MIG one is: one equal slot per partition, numbered from 0.
function partitionShape(gpu) {
  return { memory_slices: gpu.instances.length, profiles: [{ name: gpu.partition, memory_slices: 1 }] };
}

function migGpu(node, gpu, mig) {
  const slotW = 64, h = 46, labelW = 56;
  const width = labelW + mig.memory_slices * slotW;
  const describe = gpu.instances.map((i) => `${i.profile} at slice ${i.start}: ${i.model || "idle"}`).join("; ");
  const drawing = svg("svg", { width, height: h + 4, role: "img", class: "gpu", "data-node": node.name,
                               "data-gpu": gpu.index, "aria-label": `${node.name} GPU ${gpu.index}: ${describe}` });
  drawing.append(svg("text", { x: 0, y: h / 2 + 6 }, `GPU ${gpu.index}`));
  drawing.append(svg("rect", { x: labelW, y: 2, width: mig.memory_slices * slotW, height: h, class: "slots" }));
  for (let s = 1; s < mig.memory_slices; s++) {
    drawing.append(svg("line", { x1: labelW + s * slotW, x2: labelW + s * slotW, y1: 2, y2: h + 2, class: "tick" }));
  }
  for (const instance of gpu.instances) {
    const profile = mig.profiles.find((p) => p.name === instance.profile);
    const slices = profile ? profile.memory_slices : 1;
    const g = svg("g", { class: "instance", "data-profile": instance.profile, "data-start": instance.start,
                         "data-model": instance.model || "" });
    g.append(svg("title", {}, `${instance.profile} at slice ${instance.start}: ${instance.model || "idle"}`));
    const fill = instance.model ? colorOf(instance.model) : "#dddddd";
    g.append(svg("rect", { x: labelW + instance.start * slotW + 1, y: 3, width: slices * slotW - 2, height: h - 2,
                           fill, rx: 3 }));
    g.append(svg("text", { x: labelW + instance.start * slotW + 5, y: 20, class: "profile", style: `fill:${textOn(fill)}` },
                 instance.profile));
    g.append(svg("text", { x: labelW + instance.start * slotW + 5, y: 38, class: "who", style: `fill:${textOn(fill)}` },
                 (instance.model || "idle").slice(0, Math.max(4, slices * 9))));
    drawing.append(g);
  }
  return drawing;
}

// --- what-if -------------------------------------------------------------------------------------------------

function whatIfForm(stored) {
  const box = $("#whatif-fields");
  box.replaceChildren();
  $("#compare").disabled = !stored.spec;
  if (!stored.spec) {
    box.append(el("p", { class: "muted", text: "This plan was stored without its input, so it cannot be re-solved." }));
    return;
  }
  stored.spec.pools.forEach((p, i) => {
    const price = p.price_per_hour ?? stored.plan.pools.find((u) => u.pool === p.name)?.price_per_hour ?? 0;
    box.append(fieldset(`Pool ${p.name}`, [
      labelled(`wi-price-${i}`, `${p.name}: $ per GPU-hour`, numberInput(`price:${p.name}`, price)),
      labelled(`wi-nodes-${i}`, `${p.name}: nodes (0 removes it)`, numberInput(`nodes:${p.name}`, p.nodes, { step: 1 })),
      migToggle(`wi-mig-${i}`, p),
    ]));
  });
  stored.spec.models.forEach((m, i) => {
    box.append(fieldset(`Model ${m.name}`, [
      labelled(`wi-demand-${i}`, `${m.name}: requests/s`, numberInput(`demand:${m.name}`, m.workload.rate_rps)),
    ]));
  });
}

function migToggle(id, pool) {
  const box = el("input", { type: "checkbox", id, name: `mig:${pool.name}` });
  box.checked = Boolean(pool.partition_allowed ?? pool.mig_allowed);
  box.dataset.initial = String(box.checked);
  box.disabled = !state.accelerators.find((a) => a.id === pool.accelerator)?.splittable;
  return el("div", { class: "field check" }, box, el("label", { for: id, text: `${pool.name}: MIG allowed` }));
}

function fieldset(legend, children) {
  return el("fieldset", {}, el("legend", { text: legend }), ...children);
}

function labelled(id, text, input) {
  input.id = id;
  input.dataset.initial = input.value;
  return el("div", { class: "field" }, el("label", { for: id, text }), input);
}

function readChanges() {
  const changes = { prices: {}, demand: {}, nodes: {}, partition_allowed: {} };
  const keys = { price: "prices", demand: "demand", nodes: "nodes" };
  for (const box of $$("#whatif-fields input[type=checkbox]")) {
    if (String(box.checked) !== box.dataset.initial) changes.partition_allowed[box.name.slice(4)] = box.checked;
  }
  for (const input of $$("#whatif-fields input[type=number]")) {
    if (input.value.trim() === input.dataset.initial || input.value.trim() === "") continue;
    const [kind, ...rest] = input.name.split(":");
    changes[keys[kind]][rest.join(":")] = Number(input.value);
  }
  return changes;
}

function showDiff(result) {
  const d = result.diff;
  const box = $("#diff");
  const rows = (items) => items.filter((c) => Math.abs(c.delta) > 1e-9).map((c) => el("tr", {},
    el("th", { scope: "row", text: c.name }), el("td", { class: "num", text: money(c.before) }),
    el("td", { class: "num", text: money(c.after) }), el("td", { class: `num ${c.delta > 0 ? "up" : "down"}`, text: signed(c.delta) })));
  const costTable = (title, items) => {
    const body = rows(items);
    return body.length ? el("table", { class: "data" }, el("caption", { text: title }),
      el("thead", {}, el("tr", {}, ...["", "Before", "After", "Change"].map((t) => el("th", { scope: "col", text: t })))),
      el("tbody", {}, ...body)) : el("p", { class: "muted", text: `${title}: no change.` });
  };
  const replicaRows = d.replicas.map((r) => el("tr", {},
    el("th", { scope: "row", text: r.model }), el("td", { text: r.pool }), el("td", { text: `${r.device}${r.tp > 1 ? ` ×TP${r.tp}` : ""}` }),
    el("td", { class: "num", text: r.before }), el("td", { class: "num", text: r.after }),
    el("td", { class: `num ${r.after > r.before ? "up" : "down"}`, text: (r.after > r.before ? "+" : "−") + Math.abs(r.after - r.before) })));
  box.replaceChildren(
    el("p", { class: "headline", id: "diff-headline" },
      `Plan #${result.result.id}: ${money(d.cost_before)} → ${money(d.cost_after)} per hour (${signed(d.cost_delta)}), `
      + `${d.gpus_before} → ${d.gpus_after} GPUs, ${d.replicas_moved} replicas moved`
      + (d.status_after !== d.status_before ? `; status ${d.status_before} → ${d.status_after}` : "") + "."),
    costTable("Cost by pool", d.pools), costTable("Cost by model", d.models),
    replicaRows.length ? el("table", { class: "data", id: "diff-replicas" }, el("caption", { text: "Replica changes" }),
      el("thead", {}, el("tr", {}, ...["Model", "Pool", "Config", "Before", "After", "Change"].map((t) => el("th", { scope: "col", text: t })))),
      el("tbody", {}, ...replicaRows)) : el("p", { class: "muted", text: "Replicas: no change." }),
    el("p", {}, el("button", { type: "button", id: "open-whatif", text: `Open plan #${result.result.id}` })));
  $("#open-whatif").addEventListener("click", () => { fillForm(result.result.spec); showPlan(result.result); });
}

// --- history -------------------------------------------------------------------------------------------------

async function loadHistory() {
  const plans = await api("GET", "/api/plans?limit=50");
  const body = $("#history tbody");
  body.replaceChildren();
  for (const p of plans) {
    const open = el("button", { type: "button", text: "Open", "aria-label": `Open plan ${p.id}` });
    open.addEventListener("click", async () => {
      const stored = await api("GET", `/api/plans/${p.id}`);
      if (stored.spec) fillForm(stored.spec);
      showPlan(stored);
      $("#result-h").scrollIntoView();
    });
    body.append(el("tr", {}, el("td", { class: "num", text: p.id }), el("td", { text: p.name }), el("td", { text: p.origin }),
      el("td", { text: p.status }), el("td", { class: "num", text: p.cost_per_hour === null ? "—" : money(p.cost_per_hour) }),
      el("td", { text: p.note }), el("td", { text: new Date(p.created_at).toLocaleString() }), el("td", {}, open)));
  }
  if (!plans.length) body.append(el("tr", {}, el("td", { colspan: 8, text: "No plans yet." })));
}

async function loadStore() {
  const [profiles, capacities] = await Promise.all([api("GET", "/api/profiles"), api("GET", "/api/capacities")]);
  const when = (t) => new Date(t).toLocaleString();
  $("#profiles tbody").replaceChildren(...profiles.slice(0, 50).map((p) => el("tr", {},
    el("td", { class: "num", text: p.id }), el("td", { text: p.model }), el("td", { text: p.accelerator }),
    el("td", { text: p.source }), el("td", { text: p.backend }), el("td", { class: "num", text: p.tp }),
    el("td", { text: when(p.created_at) }))));
  $("#capacity-cache tbody").replaceChildren(...capacities.slice(0, 50).map((c) => el("tr", {},
    el("td", { text: c.model }), el("td", { text: c.device }), el("td", { class: "num", text: c.tp }),
    el("td", { class: "num", text: num(c.requests_per_s) }), el("td", { text: when(c.created_at) }))));
  for (const [id, rows] of [["#profiles", profiles], ["#capacity-cache", capacities]]) {
    if (!rows.length) $(`${id} tbody`).append(el("tr", {}, el("td", { colspan: 7, text: "None yet." })));
  }
}

// --- wiring --------------------------------------------------------------------------------------------------

function deviceOptions() {
  const list = $("#devices");
  list.replaceChildren();
  for (const a of state.accelerators) {
    list.append(el("option", { value: a.id }));
    for (const p of a.mig?.profiles || []) list.append(el("option", { value: `${a.id}:${p.name}` }));
  }
}

async function solve(event) {
  event.preventDefault();
  const button = $("#solve");
  button.disabled = true;
  say("#solve-status", "Solving…");
  try {
    const stored = await api("POST", "/api/plans", { spec: readSpec() });
    focusField(null);
    showPlan(stored);
    say("#solve-status", `Solved: plan #${stored.id}.`, "ok");
    loadHistory();
  } catch (error) {
    say("#solve-status", error.message, "error");
    focusField(error.field);
  } finally {
    button.disabled = false;
  }
}

async function compare(event) {
  event.preventDefault();
  const changes = readChanges();
  $("#compare").disabled = true;
  say("#whatif-status", "Solving the what-if…");
  try {
    const result = await api("POST", `/api/plans/${state.plan.id}/what-if`, { changes });
    showDiff(result);
    say("#whatif-status", "Compared.", "ok");
    loadHistory();
  } catch (error) {
    say("#whatif-status", error.message, "error");
  } finally {
    $("#compare").disabled = false;
  }
}

async function upload() {
  const name = $("#upload-name").value.trim();
  const file = $("#upload-file").files[0];
  if (!name || !file) { say("#upload-status", "Give a name and choose a config.json.", "error"); return; }
  try {
    const config = JSON.parse(await file.text());
    const info = await api("PUT", `/api/models/${encodeURIComponent(name)}`, config);
    state.models = await api("GET", "/api/models");
    for (const select of $$("#models select[name=model]")) select.replaceWith(relabel(modelSelect(select.value), select));
    say("#upload-status", `Uploaded ${info.name}: ${num(info.total_params_b, 1)}B parameters, ${info.layers} layers.`, "ok");
  } catch (error) {
    say("#upload-status", error instanceof SyntaxError ? `Not valid JSON: ${error.message}` : error.message, "error");
  }
}

function relabel(fresh, old) {
  fresh.setAttribute("aria-label", old.getAttribute("aria-label"));
  return fresh;
}

async function loadClusterFile() {
  const file = $("#load-file").files[0];
  if (!file) return;
  try {
    const spec = await api("POST", "/api/specs/parse", { text: await file.text(), filename: file.name });
    fillForm(spec);
    say("#solve-status", `Loaded ${file.name}. Press Solve.`, "ok");
  } catch (error) {
    say("#solve-status", `${file.name}: ${error.message}`, "error");
  }
}

// A server with a token answers only /api/info without it: the rest loads once the token is entered.
async function loadPlanner() {
  let accelerators, models;
  try {
    [accelerators, models] = await Promise.all([api("GET", "/api/accelerators"), api("GET", "/api/models")]);
  } catch (error) {
    if (error.status !== 401) throw error;
    say("#solve-status", "Enter this server's access token above to use the planner.", "error");
    $("#token").focus();
    return;
  }
  state.accelerators = accelerators;
  state.models = models;
  deviceOptions();
  addModelRow({ name: "llama-3.1-8b", workload: { rate_rps: 20, input_tokens: 1024, output_tokens: 256 },
                slo: { ttft_ms: 1000, tpot_ms: 100 } });
  addPoolRow({ name: "h100", accelerator: "h100-sxm", nodes: 1, partition_allowed: true });
  addPoolRow({ name: "l40s", accelerator: "l40s", nodes: 2 });
  say("#solve-status", "");
  await loadHistory();
  document.body.dataset.ready = "true";
}

// An export link cannot send the token: with one, fetch the file and hand the browser the result.
async function download(event) {
  const token = $("#token").value.trim();
  if (!token) return;
  event.preventDefault();
  const link = event.currentTarget;
  try {
    const response = await fetch(link.href, { headers: { Authorization: `Bearer ${token}` } });
    if (!response.ok) throw new Error(`${response.status} ${response.statusText}`);
    const url = URL.createObjectURL(await response.blob());
    el("a", { href: url, download: new URL(link.href).pathname.split("/").pop() }).click();
    setTimeout(() => URL.revokeObjectURL(url), 10_000);
  } catch (error) {
    say("#whatif-status", `Download failed: ${error.message}`, "error");
  }
}

async function start() {
  const info = await api("GET", "/api/info");
  $("#server").textContent = `hetsched ${info.version} · store ${info.database} · solves time out after ${info.solve_timeout_s} s`;
  $("#auth").hidden = !info.auth_required;
  $("#token").value = sessionStorage.getItem("hetsched-token") || "";
  $("#token").addEventListener("change", () => {
    sessionStorage.setItem("hetsched-token", $("#token").value);
    if (document.body.dataset.ready !== "true") loadPlanner();
  });
  for (const id of ["#export-resources", "#export-mig", "#export-dcm"]) $(id).addEventListener("click", download);
  $("#add-model").addEventListener("click", () => $("[name=model]", addModelRow()).focus());
  $("#add-pool").addEventListener("click", () => $("[name=pool]", addPoolRow()).focus());
  $("#add-capacity").addEventListener("click", () => $("[name=model]", addCapacityRow()).focus());
  $("#upload").addEventListener("click", upload);
  $("#upload-name").addEventListener("keydown", (event) => {
    if (event.key === "Enter") { event.preventDefault(); upload(); }  // Enter here uploads; it does not solve
  });
  $("#load-file").addEventListener("change", loadClusterFile);
  $("#scenario").addEventListener("submit", solve);
  $("#whatif").addEventListener("submit", compare);
  $("#store-box").addEventListener("toggle", () => { if ($("#store-box").open) loadStore(); });
  await loadPlanner();
}

document.addEventListener("DOMContentLoaded", () => {
  start().catch((error) => say("#solve-status", `Cannot reach the planner API: ${error.message}`, "error"));
});
