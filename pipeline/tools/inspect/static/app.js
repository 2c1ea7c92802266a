// rollwise inspect: renders the JSON of pipeline/inspect/server.py. Every string that comes from a run
// (model output, environment replies, ids, reasons) is untrusted: it is only ever set with textContent or
// as an attribute value, never parsed as HTML.
"use strict";

const state = { groups: [], selected: null, detail: null };

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (key === "text") node.textContent = value;
    else if (key === "class") node.className = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child);
  return node;
}

async function getJSON(url) {
  const response = await fetch(url);
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || `${response.status} from ${url}`);
  return body;
}

function fmt(x, digits = 3) {
  return x === null || x === undefined ? "-" : Number(x).toFixed(digits);
}

// ---- colour channels: value -> CSS colour, and the text shown on hover -------------------------------
const CLIP_NAMES = { "-1": "not scored", 0: "trained", 1: "clipped", 2: "rejected (mismatch)" };

function mix(rgb, t) {
  // t = 0: white, t = 1: rgb
  const c = rgb.map((v) => Math.round(255 + (v - 255) * Math.max(0, Math.min(1, t))));
  return `rgb(${c[0]}, ${c[1]}, ${c[2]})`;
}
const GREEN = [46, 160, 67], RED = [214, 48, 49], BLUE = [41, 98, 255], ORANGE = [245, 124, 0];

const CHANNELS = {
  logprob: {
    key: "logprob",
    colour: (v) => `hsl(${Math.round(120 * Math.exp(v))}, 75%, 72%)`,
    label: (t) => `engine log-prob ${fmt(t.logprob)} (p = ${fmt(Math.exp(t.logprob))})`,
    legend: [["p 0", "hsl(0, 75%, 72%)"], ["p 0.5", "hsl(60, 75%, 72%)"], ["p 1", "hsl(120, 75%, 72%)"]],
  },
  mismatch: {
    key: "mismatch",
    colour: (v) => mix(v >= 0 ? BLUE : RED, Math.abs(v) / 0.5),
    label: (t) => `learner ${fmt(t.learner_logprob)} - engine ${fmt(t.logprob)} = ${fmt(t.mismatch, 4)}`,
    legend: [["learner lower", mix(RED, 1)], ["equal", mix(RED, 0)], ["learner higher", mix(BLUE, 1)]],
  },
  advantage: {
    key: "advantage",
    colour: (v) => mix(v >= 0 ? GREEN : RED, Math.abs(v) / 2),
    label: (t) => `advantage ${fmt(t.advantage)}`,
    legend: [["negative", mix(RED, 1)], ["0", mix(RED, 0)], ["positive", mix(GREEN, 1)]],
  },
  version: {
    key: "version",
    colour: (v, range) => {
      const span = Math.max(1, range[1] - range[0]);
      return `hsl(${Math.round(30 + (170 * (v - range[0])) / span)}, 70%, 75%)`;
    },
    label: (t) => `policy version ${t.version}`,
    legend: [["oldest in group", "hsl(30, 70%, 75%)"], ["newest", "hsl(200, 70%, 75%)"]],
  },
  is_weight: {
    key: "is_weight",
    colour: (v) => mix(v >= 1 ? BLUE : RED, Math.abs(v - 1)),
    label: (t) => `IS weight ${fmt(t.is_weight)}`,
    legend: [["< 1", mix(RED, 0.8)], ["1", mix(RED, 0)], ["> 1", mix(BLUE, 0.8)]],
  },
  clip: {
    key: "clip",
    colour: (v) => ({ 0: mix(GREEN, 0.35), 1: mix(ORANGE, 0.8), 2: mix(RED, 0.9) })[v] || "transparent",
    label: (t) => `clip state: ${CLIP_NAMES[t.clip]}`,
    legend: [["trained", mix(GREEN, 0.35)], ["clipped", mix(ORANGE, 0.8)], ["rejected", mix(RED, 0.9)]],
  },
};

function channel() {
  return CHANNELS[document.getElementById("channel").value];
}

function paintToken(span, token, ch, range) {
  const value = token[ch.key];
  span.classList.remove("novalue");
  span.style.backgroundColor = "";
  if (value === null || value === undefined) {
    span.classList.add("novalue");
    span.title = "not traced: the learner's trace has no value for this token";
    span.dataset.value = "";
    return;
  }
  span.style.backgroundColor = ch.colour(value, range);
  span.title = ch.label(token);
  span.dataset.value = String(value);
}

function repaint() {
  const ch = channel();
  const legend = document.getElementById("legend");
  legend.replaceChildren(...ch.legend.map(([name, colour]) => {
    const swatch = el("span", { text: name });
    swatch.style.backgroundColor = colour;
    return swatch;
  }));
  if (!state.detail) return;
  const range = state.detail.summary.versions || [0, 0];
  for (const span of document.querySelectorAll("#episodes .tok.gen")) {
    paintToken(span, span.tokenData, ch, range);
  }
}

// ---- the group list and its filters --------------------------------------------------------------------
function fillSelect(select, values) {
  const current = select.value;
  select.replaceChildren(el("option", { value: "", text: "any" }), ...values.map((v) => el("option", { value: v, text: v })));
  select.value = values.includes(current) ? current : "";
}

async function loadGroups() {
  const params = new URLSearchParams();
  for (const [key, value] of new FormData(document.getElementById("filters"))) {
    if (value !== "") params.set(key, value);
  }
  let body;
  try {
    body = await getJSON(`/api/groups?${params}`);
  } catch (error) {
    document.getElementById("group-count").textContent = `error: ${error.message}`;
    return;
  }
  state.groups = body.groups;
  fillSelect(document.getElementById("f-env"), body.choices.env);
  fillSelect(document.getElementById("f-outcome"), body.choices.outcome);
  fillSelect(document.getElementById("f-finish"), body.choices.finish_reason);
  document.getElementById("group-count").textContent =
    `${body.matched} of ${body.total} groups match (newest version ${body.newest_version ?? "-"})`;
  const rows = body.groups.map((g) => {
    const finish = Object.entries(g.finish_reasons).map(([k, v]) => `${k} ${v}`).join(", ");
    const versions = g.versions ? `${g.versions[0]}-${g.versions[1]}` : "-";
    const tr = el("tr", { "data-group": g.group_id },
      el("td", { text: g.group_id + (g.traced ? " \u25c6" : "") }),
      el("td", { text: g.env }),
      el("td", { text: `${g.solved}/${g.episodes}`, class: `outcome-${g.outcome}` }),
      el("td", { text: finish }),
      el("td", { text: versions }),
      el("td", { text: g.staleness ?? "-" }));
    if (g.group_id === state.selected) tr.classList.add("selected");
    tr.addEventListener("click", () => selectGroup(g.group_id));
    return tr;
  });
  document.querySelector("#groups tbody").replaceChildren(...rows);
}

// ---- one group: episodes side by side as chat turns ---------------------------------------------------
function roleName(block) {
  if (block.role === "prompt") return block.segment ? `prompt (segment ${block.segment})` : "prompt";
  return block.role === "model" ? `model, turn ${block.turn}` : `environment, after turn ${block.turn}`;
}

function renderEpisode(ep, ch, range) {
  const outcome = ep.outcome === null ? "no outcome" : `outcome ${fmt(ep.outcome, 2)}`;
  const column = el("div", { class: "episode", "data-episode": ep.episode_id },
    el("h3", { text: ep.episode_id }),
    el("div", { class: "meta", text: `${outcome}, ${ep.finish_reason}, ${ep.num_turns} turns, turn rewards ` +
      ep.turn_rewards.map((r) => fmt(r, 2)).join(" ") + (ep.traced ? ", traced" : "") }));
  if (ep.trace_id) {
    column.append(el("div", { class: "meta trace-id", text: `trace ${ep.trace_id}` }));
  }
  for (const block of ep.blocks) {
    const div = el("div", { class: `block ${block.role}` }, el("span", { class: "role", text: roleName(block) }));
    for (const token of block.tokens) {
      const generated = token.logprob !== undefined;
      const span = el("span", { class: generated ? "tok gen" : "tok", text: token.text });
      if (generated) {
        span.tokenData = token;
        paintToken(span, token, ch, range);
      }
      div.append(span);
    }
    column.append(div);
  }
  return column;
}

async function selectGroup(groupId) {
  state.selected = groupId;
  for (const tr of document.querySelectorAll("#groups tbody tr")) {
    tr.classList.toggle("selected", tr.dataset.group === groupId);
  }
  let detail;
  try {
    detail = await getJSON(`/api/groups/${encodeURIComponent(groupId)}`);
  } catch (error) {
    document.getElementById("group-title").textContent = `error: ${error.message}`;
    return;
  }
  state.detail = detail;
  const s = detail.summary;
  document.getElementById("group-title").textContent =
    `${s.group_id}: ${s.env}, task ${s.task_id}, ${s.solved}/${s.episodes} solved, versions ` +
    `${s.versions ? s.versions.join("-") : "-"}, staleness ${s.staleness ?? "-"}` +
    (s.trained_step !== null ? `, trained at step ${s.trained_step}` : ", not trained yet");
  const ch = channel();
  const range = s.versions || [0, 0];
  document.getElementById("episodes").replaceChildren(...detail.episodes.map((ep) => renderEpisode(ep, ch, range)));
  repaint();
}

async function loadQuarantine() {
  const body = await getJSON("/api/quarantine");
  const items = body.files.map((f) => el("li", {}, el("b", { text: f.file }), ` (${f.bytes} bytes): `, el("span", { text: f.reason })));
  if (!items.length) items.push(el("li", { text: "none" }));
  document.getElementById("quarantine").replaceChildren(...items);
}

async function start() {
  const info = await getJSON("/api/run");
  document.getElementById("run-info").textContent = `${info.run_dir} (newest version ${info.newest_version ?? "-"})`;
  document.getElementById("filters").addEventListener("submit", (event) => {
    event.preventDefault();
    loadGroups();
  });
  document.getElementById("channel").addEventListener("change", repaint);
  repaint();
  await Promise.all([loadGroups(), loadQuarantine()]);
  document.body.dataset.ready = "1";
}

start();
