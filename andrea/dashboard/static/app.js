"use strict";
// ANDREA loss dashboard. It follows NAME.loss.json files (JSON Lines: one record per step plus event
// lines; when a step repeats, the later line wins) and redraws without reloading. Data comes from:
//   - `andrea dashboard`: api/runs lists the runs; each poll reads only the bytes appended since the
//     last one (HTTP Range), so a long run costs kilobytes per poll;
//   - any other static server (python -m http.server): the runs named by ?run=URL, re-read whole
//     when they change;
//   - files picked with "open file…" or dropped on the page: read once, works from file://.
// Step records of a run trained in phases carry "phase"; a "pivot" event (step = the last step of the
// finished phase, "from", "to") marks each change and is drawn on every chart; a "best" event names
// the step of NAME.best.ckpt. Records at the eval interval carry val_loss and, for data with loss
// masks, val_loss_assistant. A run that mixes data sources adds, per step, "mix" (each source's
// probability), "source_loss" and "source_sequences" (of the sources drawn that step) and, at the eval
// interval, "val_loss_sources": objects keyed by source name, each drawn on a chart of its own.
// From the server, each run is "current" or superseded (a run folder results/ no longer links to, which
// `andrea runs --prune` would remove): superseded runs are listed only with the "superseded" toggle
// (#all=1 or ?all=1). A run's NAME.samples.json (a list of {"step", "samples": [{"prompt", "completion"}]})
// is shown below the charts for each plotted run: the newest step's samples, as text.

const params = new URLSearchParams(location.search);
const POLL_MS = Math.max(200, Number(params.get("poll")) || 2000);
const LIVE_AGE_S = 120;   // a loss file written this recently belongs to a run that is training
const RATE_WINDOW = 50;   // steps over which tokens/s and the ETA are measured
const COLORS = ["#2f6fde", "#e8743b", "#19a979", "#d64545", "#945ecf", "#13a4b4", "#c6a100", "#6c8893"];
// Data sources have colours of their own (a source keeps its colour on every chart and for every run);
// the runs on the per-source charts are told apart by their line's dash.
const SOURCE_COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948", "#9c755f",
  "#ff9da7", "#8c8c8c"];
const RUN_DASHES = [[], [6, 4], [2, 3], [9, 3, 2, 3]];
// Tick spacings: whole steps and tokens; round durations for wall time.
const COUNT_INCRS = Array.from({length: 16}, (_, e) => [1, 2, 5].map((m) => m * 10 ** e)).flat();
const TIME_INCRS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400,
  172800, 604800];
const decoder = new TextDecoder();
const encoder = new TextEncoder();
// A record is a few hundred bytes (a mixing run's, a few kilobytes): a longer line is foreign and is
// passed over unparsed, and of a line still growing at most this much is kept (as the server does).
const MAX_RECORD_BYTES = 1 << 20;

const runs = new Map();   // id -> Run, in the order they appeared
const view = readHash();  // what the address keeps: x axis, log scale, smoothing, selected runs
let source = null;        // "server" | "static" | "files"
let sourceNote = "";
let charts = {};          // chart name -> uPlot
let structure = "";       // what the charts were built for; a change rebuilds them
let dataKey = "";         // what their data was built from; a change refreshes it
let zoom = null;          // {min, max} of x chosen by dragging on a chart; double-click clears it
let hovered = null;       // the uPlot under the mouse: only it shows the read-out
const sourceColors = new Map();  // source name -> colour, in the order the sources were first read
let sourceRuns = [];      // ids of the plotted runs that have per-source fields: each one's dash

class Run {
  constructor(id, url) {
    this.id = id;
    this.url = url;       // null for a file opened from disk
    this.color = COLORS[runs.size % COLORS.length];
    this.state = null;    // NAME.state.json (or the server's summary of it): total_steps
    this.summary = null;  // the server's phase and best step of the file, for a run not read here
    this.ageS = null;     // seconds since the loss file changed (server only)
    this.current = true;  // false: superseded (server only)
    this.samplesFile = null;  // the server's {path, size, file_id} of NAME.samples.json
    this.samplesKey = null;   // which version of it `samples` was read from
    this.samples = null;      // {step, samples: [{prompt, completion}]}: the newest step's
    this.size = 0;
    this.version = 0;
    this.reset(null);
  }

  // fileId names the bytes read so far: inode from the server, Last-Modified + length elsewhere.
  reset(fileId) {
    this.fileId = fileId;
    this.offset = 0;
    this.tail = new Uint8Array(0);
    this.overlong = false;  // in a line longer than MAX_RECORD_BYTES: the bytes up to its newline are dropped
    this.records = [];
    this.events = [];
    this.version++;
  }

  ingest(bytes) {
    this.offset += bytes.length;
    if (this.overlong) {
      const cut = bytes.indexOf(10);
      if (cut < 0) return;
      bytes = bytes.subarray(cut + 1);
      this.overlong = false;
    }
    const buf = new Uint8Array(this.tail.length + bytes.length);
    buf.set(this.tail);
    buf.set(bytes, this.tail.length);
    const end = buf.lastIndexOf(10) + 1;  // whole lines only: the trainer may be mid-write
    this.tail = buf.slice(end);
    if (this.tail.length > MAX_RECORD_BYTES) {
      this.tail = new Uint8Array(0);
      this.overlong = true;
    }
    for (const line of decoder.decode(buf.subarray(0, end)).split("\n")) {
      const rec = parseRecord(line);
      if (!rec) continue;
      if (rec.event) this.events.push(rec);
      else if (Number.isFinite(rec.step)) this.add(rec);
    }
    this.version++;
  }

  add(rec) {
    const r = this.records;
    if (!r.length || rec.step > r[r.length - 1].step) { r.push(rec); return; }
    const i = lowerBound(r.length, (k) => r[k].step < rec.step);
    if (r[i] && r[i].step === rec.step) r[i] = rec; else r.splice(i, 0, rec);
  }

  get last() { return this.records[this.records.length - 1]; }
  // The newest start/resume/init_from event carries this invocation's stop and the run's total_steps.
  get plan() {
    for (let i = this.events.length - 1; i >= 0; i--) if (Number.isFinite(this.events[i].stop)) return this.events[i];
    return null;
  }
  // Phase changes, one per step (a pivot written again after a resume replaces the earlier one).
  get pivots() {
    const byStep = new Map();
    for (const ev of this.events) {
      if (ev.event === "pivot" && Number.isFinite(ev.step) && typeof ev.to === "string") byStep.set(ev.step, ev);
    }
    return [...byStep.values()].sort((a, b) => a.step - b.step);
  }
  // The phase of the newest record, or the one a pivot at or after it starts; null without phases.
  get phase() {
    if (!this.records.length) return (this.summary && this.summary.phase) || null;
    const last = this.last, pivots = this.pivots, pivot = pivots[pivots.length - 1];
    if (pivot && pivot.step >= last.step) return pivot.to;
    return typeof last.phase === "string" ? last.phase : null;
  }
  // The newest "best" event: the step NAME.best.ckpt holds, its validation loss and which one it was.
  get best() {
    for (let i = this.events.length - 1; i >= 0; i--) {
      const ev = this.events[i];
      if (ev.event === "best" && Number.isFinite(ev.step)) return ev;
    }
    return this.records.length ? null : (this.summary && this.summary.best) || null;
  }
  get total() { return (this.plan && this.plan.total_steps) || (this.state && this.state.total_steps); }
  get stop() { return (this.plan && this.plan.stop) || this.total; }  // --max-steps ends a run early
}

// ---- reading ------------------------------------------------------------------------------------

// The JSON object on a whole line, or null: a line that is not one (`null`, a number, an array, a
// line torn by a full disk or a crash, one longer than MAX_RECORD_BYTES) is passed over. When the next
// append glued a whole record onto a torn line, that record is the part from one of its "{" to the end
// that parses. Only the "{" that the line's last "}" closes can be that one (from any other, the
// object ends before the line does), so one pass backwards finds it and one parse reads it.
function parseRecord(line) {
  if (line.length > MAX_RECORD_BYTES / 3 && encoder.encode(line).length > MAX_RECORD_BYTES) return null;
  const whole = parseObject(line);
  if (whole) return whole;
  const start = gluedRecordStart(line);
  return start > 0 ? parseObject(line.slice(start)) : null;
}

function parseObject(text) {
  try {
    const value = JSON.parse(text);
    return value !== null && typeof value === "object" && !Array.isArray(value) ? value : null;
  } catch {
    return null;  // not JSON
  }
}

// Where the "{" is that the last "}" of `line` closes, counting brackets outside strings from the end
// (a quote opens or ends a string when an even number of backslashes precede it); -1 if the line ends
// otherwise or that bracket is missing or not a "{".
function gluedRecordStart(line) {
  let end = line.length;
  while (end > 0 && " \t\r\n".includes(line[end - 1])) end--;
  if (line[end - 1] !== "}") return -1;
  let depth = 0, quoted = false;
  for (let i = end - 1; i >= 0; i--) {
    const c = line[i];
    if (c === '"') {
      let k = i;
      while (k > 0 && line[k - 1] === "\\") k--;
      if ((i - k) % 2 === 0) quoted = !quoted;
      i = k;  // the backslashes are no brackets
    } else if (!quoted && "{}[]".includes(c)) {
      depth += c === "}" || c === "]" ? 1 : -1;
      if (depth === 0) return c === "{" ? i : -1;
    }
  }
  return -1;
}

async function detectSource() {
  try {
    const res = await fetch("api/runs", {cache: "no-store"});
    if (res.ok && (res.headers.get("content-type") || "").startsWith("application/json")) return "server";
  } catch { /* not served by andrea (or opened from file://) */ }
  return location.protocol === "file:" ? "files" : "static";
}

function addRun(id, url) {
  const run = new Run(id, url);
  runs.set(id, run);
  return run;
}

async function pollServer() {
  const listing = await (await fetch("api/runs", {cache: "no-store"})).json();
  sourceNote = listing.results;
  const listed = new Set();
  for (const info of listing.runs) {
    listed.add(info.id);
    const url = "results/" + info.loss.split("/").map(encodeURIComponent).join("/");
    const run = runs.get(info.id) || addRun(info.id, url);
    // A new file under the same name (a fresh start moves the old history aside): read it from byte 0.
    if (info.file_id !== run.fileId || info.size < run.offset) run.reset(info.file_id);
    run.size = info.size;
    run.ageS = info.age_s;
    run.state = info.state;
    run.summary = {phase: info.phase, best: info.best};
    run.current = info.current !== false;
    run.samplesFile = info.samples || null;
    if (!run.samplesFile) run.samples = run.samplesKey = null;
  }
  for (const [id, run] of runs) if (run.url && !listed.has(id)) runs.delete(id);
  selectDefault();
  await Promise.all([...selectedRuns().filter((r) => r.url && r.size > r.offset).map(readAppended),
    ...selectedRuns().filter((r) => r.samplesFile).map(readSamples)]);
}

// The newest step's samples of a run, read again only when the file changed (it is rewritten whole).
async function readSamples(run) {
  const file = run.samplesFile, key = `${file.file_id}|${file.size}`;
  if (run.samplesKey === key) return;
  const res = await fetch("results/" + file.path.split("/").map(encodeURIComponent).join("/"), {cache: "no-store"});
  if (!res.ok) return;  // replaced or removed since the listing: the next poll tries again
  const history = await res.json().catch(() => null);
  if (run.samplesFile !== file) return;
  run.samples = newestSamples(history);
  run.samplesKey = key;
}

function newestSamples(history) {
  if (!Array.isArray(history)) return null;
  let newest = null;
  for (const entry of history) {
    if (!entry || !Number.isFinite(entry.step) || !Array.isArray(entry.samples)) continue;
    if (!newest || entry.step >= newest.step) newest = entry;
  }
  if (!newest) return null;
  const text = (v) => (typeof v === "string" ? v : v == null ? "" : JSON.stringify(v));
  return {step: newest.step, samples: newest.samples.filter((x) => x && typeof x === "object")
    .map((x) => ({prompt: text(x.prompt), completion: text(x.completion)}))};
}

// One read per run at a time: two overlapping reads from the same offset would ingest twice.
function readAppended(run) {
  if (!run.reading) run.reading = fetchAppended(run).finally(() => { run.reading = null; });
  return run.reading;
}

async function fetchAppended(run) {
  const {offset, fileId} = run;
  const res = await fetch(run.url, {cache: "no-store", headers: offset ? {Range: `bytes=${offset}-`} : {}});
  if (res.status === 416) return;  // nothing past our offset yet
  if (!res.ok) throw new Error(`${run.url}: HTTP ${res.status}`);
  const bytes = new Uint8Array(await res.arrayBuffer());
  if (run.offset !== offset || run.fileId !== fileId) return;  // the file was replaced meanwhile
  if (res.status === 200) run.reset(fileId);  // the whole file, not a range
  run.ingest(bytes);
}

async function pollStatic() {
  for (const url of params.getAll("run")) {
    const id = runName(url);
    if (!runs.has(id)) addRun(id, url);
  }
  selectDefault();
  await Promise.all([...runs.values()].filter((r) => r.url).map(async (run) => {
    const res = await fetch(run.url, {cache: "no-cache"});
    if (!res.ok) throw new Error(`${run.url}: HTTP ${res.status}`);
    const stamp = `${res.headers.get("last-modified")}|${res.headers.get("content-length")}`;
    if (stamp === run.fileId) return;
    run.reset(stamp);
    run.ingest(new Uint8Array(await res.arrayBuffer()));
    const state = await fetch(run.url.replace(/\.loss\.json$/, ".state.json"), {cache: "no-cache"}).catch(() => null);
    if (state && state.ok) run.state = await state.json().catch(() => run.state);
  }));
}

async function openFiles(fileList) {
  const files = [...fileList];
  for (const f of files.filter((f) => !f.name.endsWith(".state.json"))) {
    const id = runName(f.name);
    const run = runs.get(id) || addRun(id, null);
    run.reset(null);
    run.ingest(new Uint8Array(await f.arrayBuffer()));
    view.selected.add(id);
  }
  for (const f of files.filter((f) => f.name.endsWith(".state.json"))) {
    const run = runs.get(runName(f.name));
    if (run) run.state = JSON.parse(await f.text());
  }
  render();
}

async function poll() {
  try {
    if (source === "server") await pollServer();
    else await pollStatic();
    setSourceLine(false);
  } catch (err) {
    setSourceLine(true, err.message);
  }
  render();
  setTimeout(poll, POLL_MS);
}

function setSourceLine(failed, message) {
  const el = document.getElementById("source");
  const time = new Date().toLocaleTimeString();
  el.classList.toggle("error", failed);
  if (failed) el.textContent = `${message} · retrying every ${POLL_MS / 1000} s`;
  else if (source === "server") {
    const hidden = [...runs.values()].filter((r) => !visible(r)).length;
    el.textContent = `${sourceNote} · ${runs.size} run${runs.size === 1 ? "" : "s"}`
      + `${hidden ? ` (${hidden} superseded hidden)` : ""} · updated ${time}`;
  }
  else if (source === "static") el.textContent = `static files · updated ${time}`;
  else el.textContent = "files opened from disk";
}

// ---- selection and the address ------------------------------------------------------------------

function readHash() {
  const h = new URLSearchParams(location.hash.slice(1));
  const x = ["step", "tokens", "time"].includes(h.get("x")) ? h.get("x") : "step";
  const smooth = h.has("smooth") ? Math.min(0.999, Math.max(0, Number(h.get("smooth")) || 0)) : 0.8;
  return {x, log: h.get("log") === "1", smooth, all: h.get("all") === "1" || params.get("all") === "1",
    selected: new Set((h.get("runs") || "").split(",").filter(Boolean))};
}

function writeHash() {
  const h = new URLSearchParams({x: view.x, log: view.log ? "1" : "0", smooth: String(view.smooth)});
  if (view.all) h.set("all", "1");
  if (view.selected.size) h.set("runs", [...view.selected].join(","));
  history.replaceState(null, "", `#${h.toString().replace(/%2C/g, ",")}`);
}

// With nothing chosen (or shown), follow the newest run (server) or show every named one (elsewhere).
function selectDefault() {
  const shown = [...runs.values()].filter(visible);
  if (shown.some((r) => view.selected.has(r.id)) || !shown.length) return;
  if (source === "server") {
    const newest = shown.reduce((a, b) => (b.ageS < a.ageS ? b : a));
    view.selected.add(newest.id);
  } else {
    for (const id of runs.keys()) view.selected.add(id);
  }
  writeHash();
}

// A superseded run is listed (and plotted) only while the toggle asks for superseded runs.
function visible(run) {
  return view.all || run.current;
}

function selectedRuns() {
  return [...runs.values()].filter((r) => view.selected.has(r.id) && visible(r));
}

// ---- numbers --------------------------------------------------------------------------------------

function lowerBound(n, below) {
  let lo = 0, hi = n;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (below(mid)) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Exponential moving average with the start-up bias removed (as TensorBoard does), so the first
// points are not dragged toward zero.
function ema(values, weight) {
  const out = new Array(values.length);
  let acc = 0, n = 0;
  for (let i = 0; i < values.length; i++) {
    const v = values[i];
    if (v == null) { out[i] = null; continue; }
    acc = acc * weight + (1 - weight) * v;
    n++;
    out[i] = weight ? acc / (1 - weight ** n) : v;
  }
  return out;
}

// Columns of one run for the current x axis and smoothing; rebuilt only when one of them changes.
function columns(run) {
  const c = run.columns;
  if (c && c.version === run.version && c.x === view.x && c.smooth === view.smooth) return c;
  const r = run.records;
  const col = (field) => r.map((rec) => (Number.isFinite(rec[field]) ? rec[field] : null));
  const loss = col("loss"), grad = col("grad_norm"), tps = col("tokens_per_s"), valAsst = col("val_loss_assistant");
  const mix = bySource(r, "mix"), valSources = bySource(r, "val_loss_sources"), sourceLoss = bySource(r, "source_loss");
  for (const m of [mix, valSources, sourceLoss]) for (const name of m.keys()) sourceColor(name);
  run.columns = {
    version: run.version, x: view.x, smooth: view.smooth, run,
    xs: col(view.x), loss, lossEma: ema(loss, view.smooth), val: col("val_loss"), lr: col("lr"),
    valAsst, hasAsst: valAsst.some((v) => v != null),
    grad, gradEma: ema(grad, view.smooth), tps, tpsEma: ema(tps, view.smooth),
    mix, valSources, sourceSequences: bySource(r, "source_sequences"),
    sourceLossEma: new Map([...sourceLoss].map(([name, v]) => [name, ema(v, view.smooth)])),
  };
  return run.columns;
}

// A per-source field of the records (an object keyed by source name) as one column per source, in
// the order the sources first appear; null where a record lacks the source (not drawn that step, not
// an eval step). No column for a run without the field.
function bySource(records, field) {
  const out = new Map();
  records.forEach((rec, i) => {
    const o = rec[field];
    if (!o || typeof o !== "object" || Array.isArray(o)) return;
    for (const [name, v] of Object.entries(o)) {
      if (!Number.isFinite(v)) continue;
      if (!out.has(name)) out.set(name, new Array(records.length).fill(null));
      out.get(name)[i] = v;
    }
  });
  return out;
}

function sourceColor(name) {
  if (!sourceColors.has(name)) sourceColors.set(name, SOURCE_COLORS[sourceColors.size % SOURCE_COLORS.length]);
  return sourceColors.get(name);
}

function runDash(id) {
  return RUN_DASHES[Math.max(0, sourceRuns.indexOf(id)) % RUN_DASHES.length];
}

const hasSources = (c) => c.mix.size > 0 || c.valSources.size > 0 || c.sourceLossEma.size > 0;

// Tokens/s and seconds per step over the last RATE_WINDOW steps: steadier than one step's figure.
function rate(run) {
  const r = run.records;
  if (r.length < 2) return null;
  const a = r[Math.max(0, r.length - 1 - RATE_WINDOW)], b = r[r.length - 1];
  const dt = b.time - a.time;
  if (!(dt > 0) || b.step <= a.step) return null;
  return {tokensPerS: (b.tokens - a.tokens) / dt, sPerStep: dt / (b.step - a.step)};
}

function status(run) {
  const step = run.last ? run.last.step : run.state && run.state.step;
  if (run.stop && step >= run.stop) return "done";
  if (run.ageS == null) return "";
  return run.ageS < LIVE_AGE_S ? "live" : "stopped";
}

function lastMeasured(values, i) {
  for (let k = i; k >= 0; k--) if (values[k] != null) return values[k];
  return null;
}

const fmtLoss = (v) => (v == null ? "–" : v.toFixed(4));
const fmtExp = (v) => (v == null ? "–" : v.toExponential(2));
const fmtFixed = (d) => (v) => (v == null ? "–" : v.toFixed(d));
const fmtTick = (v) => String(+v.toPrecision(3));  // 6, 5.5, 0.25, 0.001: no padding zeros
const fmtInt = (v) => (v == null ? "–" : Math.round(v).toLocaleString("en-US"));

function fmtSI(v) {
  if (v == null) return "–";
  const a = Math.abs(v);
  for (const [d, s] of [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]]) {
    if (a >= d) return `${+(v / d).toPrecision(3)}${s}`;
  }
  return `${+v.toPrecision(3)}`;
}

// "45s", "4m 05s", "2h", "1d 03h": two units at most, a zero second unit left out.
function fmtDuration(s) {
  if (s == null || !Number.isFinite(s)) return "–";
  s = Math.round(s);
  const two = (big, unit, small, smallUnit) => (small ? `${big}${unit} ${String(small).padStart(2, "0")}${smallUnit}` : `${big}${unit}`);
  if (s < 60) return `${s}s`;
  if (s < 3600) return two(Math.floor(s / 60), "m", s % 60, "s");
  if (s < 86400) return two(Math.floor(s / 3600), "h", Math.floor(s / 60) % 60, "m");
  return two(Math.floor(s / 86400), "d", Math.floor(s / 3600) % 24, "h");
}

const X_FORMAT = {step: fmtSI, tokens: fmtSI, time: fmtDuration};

function runName(path) {
  const base = decodeURIComponent(path.split(/[?#]/)[0].split("/").pop());
  return base.replace(/\.(loss|state)\.json$|\.jsonl?$/, "");
}

function fade(hex, alpha) {
  const n = parseInt(hex.slice(1), 16);
  return `rgba(${n >> 16}, ${(n >> 8) & 255}, ${n & 255}, ${alpha})`;
}

// `hex` moved a fraction `t` of the way to `toward` (both #rrggbb).
function mix(hex, toward, t) {
  const a = parseInt(hex.slice(1), 16), b = parseInt(toward.slice(1), 16);
  const ch = (shift) => Math.round(((a >> shift) & 255) * (1 - t) + ((b >> shift) & 255) * t);
  return `#${((ch(16) << 16) | (ch(8) << 8) | ch(0)).toString(16).padStart(6, "0")}`;
}

// The assistant-token validation series of a run: its colour taken toward the text colour (darker on
// a light page, lighter on a dark one), so it stands apart from val_loss and still reads as that run.
function assistantColor(run) {
  return mix(run.color, cssVar("--text") || "#000000", 0.5);
}

// ---- the runs table (the header's numbers) -------------------------------------------------------

function renderTable() {
  const table = document.getElementById("runs"), body = table.tBodies[0];
  const rows = new Map([...body.rows].map((tr) => [tr.dataset.run, tr]));
  for (const [id, tr] of rows) if (!runs.has(id)) tr.remove();
  const shown = {phase: false, asst: false, best: false};  // columns only runs with phases, masks or a best step need
  for (const run of runs.values()) {
    const tr = rows.get(run.id) || body.appendChild(newRow(run));
    tr.hidden = !visible(run);
    tr.classList.toggle("superseded", !run.current);
    if (tr.hidden) continue;
    const on = view.selected.has(run.id);
    tr.classList.toggle("off", !on);
    tr.querySelector("input").checked = on;
    const c = on && run.records.length ? columns(run) : null;
    const last = c && run.last, speed = c && rate(run), st = status(run);
    const step = last ? last.step : run.state && run.state.step;
    const remaining = run.stop && step != null ? run.stop - step : null;
    const phase = run.phase, best = run.best;
    const asst = c && c.hasAsst ? lastMeasured(c.valAsst, c.valAsst.length - 1) : null;
    shown.phase ||= phase != null;
    shown.asst ||= asst != null;
    shown.best ||= best != null;
    const cells = {
      status: st,
      step: step == null ? "–" : `${fmtInt(step)}${run.total ? ` / ${fmtInt(run.total)}` : ""}`,
      loss: c ? fmtLoss(lastMeasured(c.lossEma, c.lossEma.length - 1)) : "",
      phase: phase == null ? "" : phase,
      val: c ? fmtLoss(lastMeasured(c.val, c.val.length - 1)) : "",
      val_assistant: asst == null ? "" : fmtLoss(asst),
      best: best ? `${Number.isFinite(best.val_loss) ? fmtLoss(best.val_loss) : "–"} @ ${fmtInt(best.step)}` : "",
      lr: last ? fmtExp(last.lr) : "",
      grad: last ? fmtFixed(3)(last.grad_norm) : "",
      tps: speed ? fmtSI(speed.tokensPerS) : "",
      tokens: last ? fmtSI(last.tokens) : "",
      elapsed: last ? fmtDuration(last.time) : "",
      eta: st === "done" ? "done" : st === "live" && speed && remaining != null ? fmtDuration(remaining * speed.sPerStep) : "–",
    };
    for (const [key, text] of Object.entries(cells)) tr.querySelector(`[data-cell=${key}]`).textContent = text;
    tr.querySelector("[data-cell=status]").className = `status ${st}`;
    tr.querySelector("[data-cell=best]").title = best
      ? `NAME.best.ckpt: step ${fmtInt(best.step)}${best.metric ? `, ${best.metric} ${fmtLoss(best.val_loss)}` : ""}` : "";
  }
  for (const [key, on] of Object.entries(shown)) table.classList.toggle(`show-${key}`, on);
  const superseded = [...runs.values()].filter((r) => !r.current).length;
  document.getElementById("all-count").textContent = superseded ? `(${superseded})` : "";
}

function newRow(run) {
  const tr = document.createElement("tr");
  tr.dataset.run = run.id;
  const cell = (key, cls = "num") => `<td class="${cls}"><span data-cell="${key}"></span></td>`;
  tr.innerHTML = "<td><input type=\"checkbox\"></td>"
    + `<td class="name"><span class="swatch" style="background:${run.color}"></span>`
    + "<span class=\"tag\" title=\"results/ links to a newer run of this name; andrea runs --prune removes it\">superseded</span>"
    + "<span class=\"id\"></span></td>"
    + cell("status", "") + cell("step") + cell("phase", "opt-phase") + cell("loss", "num big") + cell("val")
    + cell("val_assistant", "num opt-asst") + cell("best", "num opt-best") + cell("lr") + cell("grad")
    + cell("tps") + cell("tokens") + cell("elapsed") + cell("eta");
  tr.querySelector(".id").textContent = run.id;
  tr.querySelector(".name").title = run.id;  // a long id is cut short with an ellipsis
  tr.querySelector("input").ariaLabel = `show ${run.id}`;
  tr.querySelector("input").addEventListener("change", (e) => {
    if (e.target.checked) view.selected.add(run.id); else view.selected.delete(run.id);
    refresh();
    // A newly ticked run has not been read yet: fetch it now rather than at the next poll.
    if (source === "server") pollServer().then(render, () => {});
  });
  return tr;
}

// Below the charts: each plotted run's newest samples. Text only (textContent): a model writes anything.
function renderSamples() {
  const section = document.getElementById("samples");
  const shown = selectedRuns().filter((r) => r.samples && r.samples.samples.length);
  const want = JSON.stringify(shown.map((r) => [r.id, r.samplesKey, r.color]));
  section.hidden = !shown.length;
  if (section.dataset.drawn === want) return;
  section.dataset.drawn = want;
  section.replaceChildren(...shown.map((run) => {
    const panel = document.createElement("figure");
    panel.className = "panel sample-run";
    panel.dataset.run = run.id;
    const caption = document.createElement("figcaption");
    caption.innerHTML = `<span class="swatch" style="background:${run.color}"></span>samples <span class="key"></span>`;
    caption.querySelector(".key").textContent = `${run.id} · step ${fmtInt(run.samples.step)}`;
    panel.append(caption);
    for (const {prompt, completion} of run.samples.samples) {
      const item = document.createElement("div");
      item.className = "sample";
      const p = document.createElement("div"), c = document.createElement("div");
      p.className = "prompt";
      c.className = "completion";
      p.textContent = prompt;
      c.textContent = completion;
      item.append(p, c);
      panel.append(item);
    }
    return panel;
  }));
}

function renderEmpty() {
  const el = document.getElementById("empty");
  let html = "";
  if (!runs.size && source === "server") {
    html = `No runs under <code>${escapeHtml(sourceNote)}</code> yet. Start one with `
      + "<code>andrea train … --out results/NAME.ckpt</code>; it appears here as soon as it logs a step.";
  } else if (!runs.size && source === "static") {
    html = "Name a run in the address, <code>?run=NAME.loss.json</code>, or open / drop a .loss.json file.";
  } else if (!runs.size) {
    html = "Drop a <code>NAME.loss.json</code> here or use <b>open file…</b>: a page opened from file:// "
      + "cannot read files by itself. <code>andrea dashboard</code> follows runs live.";
  } else if (![...runs.values()].some(visible)) {
    html = "Every run here is superseded (results/ links to newer ones); tick <b>superseded</b> to list them.";
  } else if (!selectedRuns().length) {
    html = "Tick a run to plot it.";
  }
  el.innerHTML = html;
  el.hidden = !html;
}

function escapeHtml(s) {
  return String(s).replace(/[&<>"]/g, (ch) => `&#${ch.charCodeAt(0)};`);
}

// ---- charts ---------------------------------------------------------------------------------------

const CHARTS = [
  {
    name: "loss", el: "chart-loss", fmt: fmtTick, logScale: true,
    // The assistant-token series only for a run that has one: an old run's chart stays as it was.
    table: (c) => [c.xs, c.loss, c.lossEma, c.val, ...(c.hasAsst ? [c.valAsst] : [])],
    series: (run, c) => [
      {label: `${run.id} loss`, stroke: fade(run.color, 0.35), width: 1},
      {label: `${run.id} loss EMA`, stroke: run.color, width: 2},
      {label: `${run.id} val loss`, stroke: run.color, width: 1.5, dash: [5, 4], spanGaps: true,
        points: {show: true, size: 7, width: 2, fill: run.color}},
      ...(c.hasAsst ? [{label: `${run.id} val loss (assistant)`, stroke: assistantColor(run), width: 1.5, dash: [2, 3],
        spanGaps: true, points: {show: true, size: 7, width: 2, fill: cssVar("--panel")}}] : []),
    ],
    readout: (c, i) => [["EMA", fmtLoss(c.lossEma[i])], ["raw", fmtLoss(c.loss[i])], ["val", fmtLoss(lastMeasured(c.val, i))],
      ...(c.hasAsst ? [["val asst", fmtLoss(lastMeasured(c.valAsst, i))]] : [])],
  },
  // The per-source charts, built only while a plotted run has their field: one series per source
  // (`sources` gives the run's columns by source name) in the source's colour, dashed by run.
  sourceChart({
    name: "mix", el: "chart-mix", fmt: fmtTick, range: [0, 1], sources: (c) => c.mix,
    series: (run, name) => ({label: `${run.id} mix (${name})`}),
    // The probability and, where the record has it, how many of the step's sequences were drawn.
    value: (c, name, p, i) => {
      const n = c.sourceSequences.has(name) ? c.sourceSequences.get(name)[i] : null;
      return `${fmtFixed(2)(p[i])}${n == null ? "" : ` · ${fmtInt(n)} seq`}`;
    },
  }),
  sourceChart({
    name: "val_sources", el: "chart-val-sources", fmt: fmtTick, logScale: true, sources: (c) => c.valSources,
    series: (run, name) => ({label: `${run.id} val loss (${name})`, spanGaps: true,
      points: {show: true, size: 6, width: 1.5, fill: sourceColor(name)}}),
    value: (c, name, v, i) => fmtLoss(lastMeasured(v, i)),
  }),
  sourceChart({
    name: "source_loss", el: "chart-source-loss", fmt: fmtTick, logScale: true, sources: (c) => c.sourceLossEma,
    series: (run, name) => ({label: `${run.id} loss EMA (${name})`, spanGaps: true}),
    value: (c, name, v, i) => fmtLoss(lastMeasured(v, i)),
  }),
  {
    name: "lr", el: "chart-lr", fmt: (v) => (v ? v.toExponential(1) : "0"),
    table: (c) => [c.xs, c.lr],
    series: (run) => [{label: `${run.id} lr`, stroke: run.color, width: 1.5}],
    readout: (c, i) => [["lr", fmtExp(c.lr[i])]],
  },
  {
    name: "grad", el: "chart-grad", fmt: fmtTick,
    table: (c) => [c.xs, c.grad, c.gradEma],
    series: (run) => [
      {label: `${run.id} grad norm`, stroke: fade(run.color, 0.35), width: 1},
      {label: `${run.id} grad norm EMA`, stroke: run.color, width: 1.5},
    ],
    readout: (c, i) => [["EMA", fmtFixed(3)(c.gradEma[i])], ["raw", fmtFixed(3)(c.grad[i])]],
  },
  {
    name: "tps", el: "chart-tps", fmt: fmtSI,
    table: (c) => [c.xs, c.tps, c.tpsEma],
    series: (run) => [
      {label: `${run.id} tokens/s`, stroke: fade(run.color, 0.35), width: 1},
      {label: `${run.id} tokens/s EMA`, stroke: run.color, width: 1.5},
    ],
    readout: (c, i) => [["EMA", fmtSI(c.tpsEma[i])], ["raw", fmtSI(c.tps[i])]],
  },
];

function sourceChart({sources, series, value, ...def}) {
  return {
    ...def, sources, shows: (c) => sources(c).size > 0,
    table: (c) => [c.xs, ...sources(c).values()],
    series: (run, c) => [...sources(c).keys()].map((name) => ({stroke: sourceColor(name), width: 1.5, dash: runDash(run.id),
      ...series(run, name)})),
    readout: (c, i) => [...sources(c)].map(([name, v]) => [sourceKey(name), value(c, name, v, i)]),
  };
}

// A source's swatch and name, as HTML (a source's name is any string).
function sourceKey(name) {
  return `<span class="swatch" style="background:${sourceColor(name)}"></span>${escapeHtml(name)}`;
}

function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

function chartData(def, cols) {
  return uPlot.join(cols.map(def.table));
}

function buildCharts(cols) {
  for (const u of Object.values(charts)) u.destroy();
  charts = {};
  for (const def of CHARTS) {
    const el = document.getElementById(def.el);
    el.dataset.phases = "[]";
    if (def.shows) el.parentNode.hidden = !cols.some(def.shows);
  }
  if (!cols.length) return;
  const axis = {
    stroke: cssVar("--axis"),
    grid: {stroke: cssVar("--grid"), width: 1},
    ticks: {stroke: cssVar("--grid"), width: 1, size: 4},
    font: "11px system-ui, sans-serif",
  };
  for (const def of CHARTS) {
    const el = document.getElementById(def.el);
    if (el.parentNode.hidden) continue;
    const log = def.logScale && view.log;
    const opts = {
      width: el.clientWidth, height: el.clientHeight,
      legend: {show: false},
      cursor: {sync: {key: "andrea"}, drag: {x: true, y: false, setScale: false}, points: {size: 7}},
      scales: {x: {time: false}, y: log ? {distr: 3, log: 10} : def.range ? {range: def.range} : {}},
      axes: [
        {...axis, size: 32, space: view.x === "time" ? 70 : 50, values: (u, ticks) => ticks.map(X_FORMAT[view.x]),
          incrs: view.x === "time" ? TIME_INCRS : COUNT_INCRS},
        // A log axis hands over null for the ticks it leaves unlabelled.
        {...axis, size: 56, values: (u, ticks) => ticks.map((v) => (v == null ? "" : def.fmt(v)))},
      ],
      series: [{label: view.x}, ...cols.flatMap((c) => def.series(c.run, c).map((s) => ({points: {show: false}, ...s})))],
      hooks: {
        setCursor: [(u) => showReadout(u, def)],
        setSelect: [zoomTo],
        draw: def.name === "loss" ? [drawMarks, drawPhases] : [drawPhases],
      },
    };
    const u = new uPlot(opts, chartData(def, cols), el);
    u.over.addEventListener("mouseenter", () => { hovered = u; });
    u.over.addEventListener("mouseleave", () => { hovered = null; document.getElementById("tip").hidden = true; });
    u.over.addEventListener("dblclick", () => { zoom = null; refresh(true); });
    charts[def.name] = u;
  }
  applyZoom();
}

function updateCharts(cols) {
  for (const def of CHARTS) if (charts[def.name]) charts[def.name].setData(chartData(def, cols));
  applyZoom();
}

function zoomTo(u) {
  if (u.select.width < 2) return;
  zoom = {min: u.posToVal(u.select.left, "x"), max: u.posToVal(u.select.left + u.select.width, "x")};
  u.setSelect({left: 0, top: 0, width: 0, height: 0}, false);
  applyZoom();
}

function applyZoom() {
  if (zoom) for (const u of Object.values(charts)) u.setScale("x", zoom);
}

// Dashed vertical lines at a run's events worth seeing on the curve.
const MARKS = {resume: "resume", init_from: "init", nonfinite: "non-finite step"};

function drawMarks(u) {
  const ctx = u.ctx, {left, top, width, height} = u.bbox, px1 = devicePixelRatio;
  ctx.save();
  ctx.setLineDash([3 * px1, 3 * px1]);
  ctx.lineWidth = px1;
  ctx.font = `${10 * px1}px system-ui, sans-serif`;
  ctx.textAlign = "left";  // uPlot leaves the alignment of its last axis label behind
  ctx.textBaseline = "top";
  for (const run of selectedRuns()) {
    for (const ev of run.events) {
      if (!MARKS[ev.event] || !(ev.step > 0)) continue;
      const r = run.records, rec = r[lowerBound(r.length, (k) => r[k].step < ev.step)];
      if (!rec) continue;
      const x = u.valToPos(view.x === "step" ? ev.step : rec[view.x], "x", true);
      if (x < left || x > left + width) continue;
      ctx.strokeStyle = ctx.fillStyle = ev.event === "nonfinite" ? cssVar("--bad") : run.color;
      ctx.beginPath();
      ctx.moveTo(x, top);
      ctx.lineTo(x, top + height);
      ctx.stroke();
      ctx.fillText(MARKS[ev.event], x + 4 * px1, top + 2 * px1);
    }
  }
  ctx.restore();
}

// A solid vertical line where each phase ends, in the run's colour: the next phase's name right of it
// (the first phase's name left of the first one). At the pivot's step, or, with x in tokens or time,
// at the pivot step's record. What was drawn goes to the chart element's data-phases, for tests.
function drawPhases(u) {
  const ctx = u.ctx, {left, top, width, height} = u.bbox, px1 = devicePixelRatio;
  const drawn = [];
  ctx.save();
  ctx.lineWidth = 1.5 * px1;
  ctx.font = `600 ${10 * px1}px system-ui, sans-serif`;
  ctx.textBaseline = "top";
  const labelY = top + 14 * px1;  // below the labels of drawMarks
  for (const run of selectedRuns()) {
    const r = run.records;
    run.pivots.forEach((ev, k) => {
      const rec = r[lowerBound(r.length, (j) => r[j].step < ev.step)];
      const value = view.x === "step" ? ev.step : rec && rec[view.x];
      if (!Number.isFinite(value)) return;
      const x = u.valToPos(value, "x", true);
      if (x < left || x > left + width) return;
      ctx.strokeStyle = ctx.fillStyle = run.color;
      ctx.beginPath();
      ctx.moveTo(x, top);
      ctx.lineTo(x, top + height);
      ctx.stroke();
      const toWidth = ctx.measureText(ev.to).width;
      const toRight = x + 4 * px1 + toWidth <= left + width;
      ctx.textAlign = toRight ? "left" : "right";
      ctx.fillText(ev.to, toRight ? x + 4 * px1 : x - 4 * px1, toRight ? labelY : labelY + 12 * px1);
      if (k === 0 && typeof ev.from === "string" && x - 4 * px1 - ctx.measureText(ev.from).width >= left) {
        ctx.textAlign = "right";
        ctx.fillText(ev.from, x - 4 * px1, labelY);
      }
      drawn.push({run: run.id, step: ev.step, x: value, from: ev.from, to: ev.to});
    });
  }
  ctx.restore();
  u.root.parentNode.dataset.phases = JSON.stringify(drawn);
}

// The hover read-out: the hovered x, then each run's values at its nearest point.
function showReadout(u, def) {
  const tip = document.getElementById("tip");
  const {left, top, idx} = u.cursor;
  if (u !== hovered || idx == null || left < 0) { tip.hidden = true; return; }
  const x = u.data[0][idx];
  let head = "";
  const rows = [];
  for (const run of selectedRuns()) {
    if (!run.records.length) continue;
    const c = columns(run);
    const i = nearest(c.xs, x);
    const rec = run.records[i];
    if (!head) {
      head = `step ${fmtInt(rec.step)} · ${fmtSI(rec.tokens)} tokens · ${fmtDuration(rec.time)}`;
      if (typeof rec.phase === "string") head += ` · ${escapeHtml(rec.phase)}`;
    }
    const cells = def.readout(c, i).map(([k, v]) => `<td><span class="k">${k}</span> ${v}</td>`).join("");
    if (!cells) continue;  // a run without sources on a per-source chart
    rows.push(`<tr><td><span class="swatch" style="background:${run.color}"></span>${escapeHtml(run.id)}</td>${cells}</tr>`);
  }
  tip.innerHTML = `<div class="head">${head}</div><table>${rows.join("")}</table>`;
  tip.hidden = false;
  const box = u.over.getBoundingClientRect();
  const flip = box.left + left + 16 + tip.offsetWidth > window.innerWidth;
  tip.style.left = `${box.left + left + (flip ? -16 - tip.offsetWidth : 16)}px`;
  tip.style.top = `${Math.max(8, box.top + top - tip.offsetHeight / 2)}px`;
}

function nearest(xs, x) {
  const i = lowerBound(xs.length, (k) => xs[k] < x);
  if (i >= xs.length) return xs.length - 1;
  return i > 0 && x - xs[i - 1] < xs[i] - x ? i - 1 : i;
}

// ---- the page -------------------------------------------------------------------------------------

function render() {
  renderTable();
  renderEmpty();
  renderSamples();
  const cols = selectedRuns().filter((r) => r.records.length).map(columns);
  document.querySelector(".charts").hidden = !cols.length;
  const dark = matchMedia("(prefers-color-scheme: dark)").matches;
  sourceRuns = cols.filter(hasSources).map((c) => c.run.id);
  // A run without sources adds nothing to the shape: an old run's charts are built as they always were.
  const sources = (c) => (hasSources(c) ? [[...c.mix.keys()], [...c.valSources.keys()], [...c.sourceLossEma.keys()]] : []);
  const shape = JSON.stringify([cols.map((c) => [c.run.id, c.hasAsst, ...sources(c)]), view.x, view.log, dark]);
  renderKeys(cols);
  const data = JSON.stringify([shape, cols.map((c) => c.version), view.smooth]);
  if (shape !== structure) buildCharts(cols);
  else if (data !== dataKey && cols.length) updateCharts(cols);
  structure = shape;
  dataKey = data;
}

// The loss chart's key: the assistant-token series (a swatch of each run's colour for it) and the
// phase boundaries, shown only when a plotted run has them.
function renderKeys(cols) {
  const asst = cols.filter((c) => c.hasAsst), key = document.getElementById("key-assistant");
  key.hidden = !asst.length;
  const swatches = key.querySelector(".swatches");
  const want = asst.map((c) => assistantColor(c.run)).join(" ");
  if (swatches.dataset.colors !== want) {
    swatches.dataset.colors = want;
    swatches.replaceChildren(...asst.map((c) => {
      const sw = document.createElement("span");
      sw.className = "swatch ring";
      sw.style.borderColor = assistantColor(c.run);
      sw.title = c.run.id;
      return sw;
    }));
  }
  document.getElementById("key-phase").hidden = !cols.some((c) => c.run.pivots.length);
  for (const def of CHARTS.filter((d) => d.shows)) renderSourceKey(def, cols.filter(def.shows));
}

// A per-source chart's key: a swatch and the name of each source it draws and, with more than one
// run on it, each run's dash.
function renderSourceKey(def, cols) {
  const key = document.getElementById(def.el).parentNode.querySelector(".key.sources");
  const names = new Set(cols.flatMap((c) => [...def.sources(c).keys()]));
  const ordered = [...sourceColors.keys()].filter((name) => names.has(name));
  const runsShown = cols.length > 1 ? cols.map((c) => c.run.id) : [];
  const want = JSON.stringify([ordered, runsShown.map((id) => [id, runDash(id)])]);
  if (key.dataset.drawn === want) return;
  key.dataset.drawn = want;
  const entries = ordered.map((name) => {
    const item = document.createElement("span");
    item.className = "source";
    item.dataset.source = name;
    item.innerHTML = sourceKey(name);
    return item;
  });
  for (const id of runsShown) {
    const item = document.createElement("span");
    item.className = "run-dash";
    const dash = runDash(id).join(" ");
    item.innerHTML = `<svg width="22" height="8" aria-hidden="true"><line x1="0" y1="4" x2="22" y2="4" stroke="currentColor"
      stroke-width="1.5" stroke-dasharray="${dash || "none"}"/></svg>`;
    item.append(id);
    entries.push(item);
  }
  key.replaceChildren(...entries);
}

function refresh(rebuild = false) {
  if (rebuild) structure = "";
  writeHash();
  render();
}

function bindControls() {
  for (const b of document.querySelectorAll("[data-x]")) {
    b.addEventListener("click", () => {
      view.x = b.dataset.x;
      zoom = null;
      syncControls();
      refresh();
    });
  }
  const log = document.getElementById("log");
  log.addEventListener("change", () => { view.log = log.checked; refresh(); });
  const all = document.getElementById("all");
  all.addEventListener("change", () => {
    view.all = all.checked;
    selectDefault();
    refresh();
    // A run shown again may not have been read yet: fetch it now rather than at the next poll.
    if (source === "server") pollServer().then(render, () => {});
  });
  const smooth = document.getElementById("smooth");
  smooth.addEventListener("input", () => {
    view.smooth = Number(smooth.value);
    syncControls();
    refresh();
  });
  document.getElementById("pick").addEventListener("change", (e) => openFiles(e.target.files));

  const drop = document.getElementById("drop");
  let depth = 0;
  const hasFiles = (e) => e.dataTransfer && [...e.dataTransfer.types].includes("Files");
  window.addEventListener("dragenter", (e) => { if (hasFiles(e)) { depth++; drop.hidden = false; } });
  window.addEventListener("dragleave", () => { if (--depth <= 0) { depth = 0; drop.hidden = true; } });
  window.addEventListener("dragover", (e) => { if (hasFiles(e)) e.preventDefault(); });
  window.addEventListener("drop", (e) => {
    e.preventDefault();
    depth = 0;
    drop.hidden = true;
    if (e.dataTransfer.files.length) openFiles(e.dataTransfer.files);
  });

  new ResizeObserver(() => {
    for (const def of CHARTS) {
      const el = document.getElementById(def.el);
      if (charts[def.name]) charts[def.name].setSize({width: el.clientWidth, height: el.clientHeight});
    }
  }).observe(document.querySelector(".charts"));
  matchMedia("(prefers-color-scheme: dark)").addEventListener("change", () => render());
}

function syncControls() {
  for (const b of document.querySelectorAll("[data-x]")) b.setAttribute("aria-checked", String(b.dataset.x === view.x));
  document.getElementById("log").checked = view.log;
  document.getElementById("all").checked = view.all;
  document.getElementById("all-toggle").hidden = source !== "server";
  document.getElementById("smooth").value = view.smooth;
  document.getElementById("smooth-value").textContent = view.smooth.toFixed(view.smooth >= 0.99 ? 3 : 2);
}

// For the console and for tests: the runs as read, the view, the live uPlot instances.
window.andreaDashboard = {runs, view, get charts() { return charts; }};

(async function start() {
  bindControls();
  syncControls();
  source = await detectSource();
  syncControls();
  setSourceLine(false);
  if (source === "files") render();
  else poll();
})();
