// The twice console: polls the JSON API under /$console/api/ and renders it. Every value
// from the server is set as text, never as markup: message bodies are anyone's text.
"use strict";

const API = "/$console/api/";
const POLL_MS = 1000;
const HISTORY = 60;
const TOKEN_TTL_SECS = 300;
const $ = (id) => document.getElementById(id);

const state = {
  selected: null,          // entity path
  kind: null,              // "queue" or "subscription"
  view: "dlq",             // "dlq", "active" or "sessions"
  from: 0,                 // first sequence number of the shown page
  next: null,              // first sequence number of the next page
  previous: null,          // the last /api/entities answer
  entities: new Map(),     // its entities by path
  history: [],             // [{send, recv}] rates, oldest first
  readsNeedToken: true,
};

// --- credentials: kept for this tab only, in sessionStorage -------------------------------

function credentials() {
  const name = sessionStorage.getItem("twice.keyName");
  const key = sessionStorage.getItem("twice.key");
  return name && key ? { name, key } : null;
}

function base64(bytes) {
  let s = "";
  for (const b of new Uint8Array(bytes)) s += String.fromCharCode(b);
  return btoa(s);
}

// A SharedAccessSignature for this whole namespace, as the SDKs sign one: HMAC-SHA256 of the
// url-encoded resource, a newline and the expiry, with the key's bytes as the HMAC key.
async function sasToken(c = credentials()) {
  if (!c) return null;
  if (!window.crypto || !crypto.subtle) {
    throw new Error("signing needs a secure context: open the console on localhost or over https");
  }
  const enc = new TextEncoder();
  const sr = encodeURIComponent(location.origin + "/");
  const se = Math.floor(Date.now() / 1000) + TOKEN_TTL_SECS;
  const key = await crypto.subtle.importKey("raw", enc.encode(c.key), { name: "HMAC", hash: "SHA-256" }, false, ["sign"]);
  const sig = await crypto.subtle.sign("HMAC", key, enc.encode(sr + "\n" + se));
  return `SharedAccessSignature sr=${sr}&sig=${encodeURIComponent(base64(sig))}&se=${se}&skn=${encodeURIComponent(c.name)}`;
}

// `c`: the credentials to sign with, those of the tab by default.
async function api(path, options = {}, c = credentials()) {
  const headers = Object.assign({}, options.headers || {});
  const token = await sasToken(c);
  if (token) headers["Authorization"] = token;
  const response = await fetch(API + path, Object.assign({}, options, { headers, cache: "no-store" }));
  const body = await response.json().catch(() => ({}));
  if (!response.ok) {
    const e = body.error || { code: "http", message: response.status + " " + response.statusText };
    const err = new Error(e.message);
    err.code = e.code;
    throw err;
  }
  return body;
}

function showCredentials() {
  const c = credentials();
  $("sign-in-form").hidden = !!c;
  $("signed-in").hidden = !c;
  $("signed-in-name").textContent = c ? c.name : "";
}

// Signing in asks the server once (`api/key`) whether it knows the key: a wrong one is said
// at once, instead of every later call failing.
$("sign-in-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const name = $("key-name").value.trim();
  const key = $("key").value;
  if (!name || !key) return;
  $("sign-in-error").textContent = "";
  try {
    await api("key", {}, { name, key });
  } catch (e) {
    $("sign-in-error").textContent = e.code === "unauthorized"
      ? "wrong key or key name"
      : "cannot sign in: " + e.message;
    return;
  }
  sessionStorage.setItem("twice.keyName", name);
  sessionStorage.setItem("twice.key", key);
  $("key").value = "";
  showCredentials();
  loadMessages();
});

$("sign-out").addEventListener("click", () => {
  sessionStorage.removeItem("twice.keyName");
  sessionStorage.removeItem("twice.key");
  showCredentials();
  loadMessages();
});

// --- entities, counts and rates -----------------------------------------------------------

function cell(tr, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  tr.appendChild(td);
  return td;
}

function rate(now, before, field, seconds) {
  if (!before || seconds <= 0) return 0;
  return Math.max(0, (now[field] - before[field]) / seconds);
}

// A row of the entities table, made once per entity and updated in place on every poll, so a
// click never lands on a row that a poll has just replaced.
function entityRow(e) {
  const tr = document.createElement("tr");
  tr.dataset.path = e.path;
  const name = document.createElement("td");
  if (e.kind === "topic") {
    name.textContent = e.path;
  } else {
    const b = document.createElement("button");
    b.className = "link open";
    b.type = "button";
    b.textContent = e.path;
    b.addEventListener("click", () => select(state.entities.get(e.path)));
    name.appendChild(b);
  }
  tr.appendChild(name);
  cell(tr, e.kind + (e.requires_session ? " (sessions)" : ""));
  for (const c of ["active", "scheduled", "deferred", "dead_letter", "send-rate", "receive-rate"]) {
    cell(tr, "", "n " + c);
  }
  return tr;
}

function renderEntities(data) {
  const before = state.previous;
  const seconds = before ? (data.time_ms - before.time_ms) / 1000 : 0;
  const old = new Map((before ? before.entities : []).map((e) => [e.path, e]));
  let send = 0, recv = 0;
  const body = $("entities");
  const rows = new Map([...body.children].map((tr) => [tr.dataset.path, tr]));
  state.entities = new Map(data.entities.map((e) => [e.path, e]));
  let at = 0;
  for (const e of data.entities) {
    const s = rate(e, old.get(e.path), "sends", seconds);
    const r = rate(e, old.get(e.path), "receives", seconds);
    send += s;
    recv += r;
    let tr = rows.get(e.path);
    rows.delete(e.path);
    if (!tr) tr = entityRow(e);
    if (body.children[at] !== tr) body.insertBefore(tr, body.children[at] || null);
    at += 1;
    tr.classList.toggle("selected", e.path === state.selected);
    const set = (c, text) => { const td = tr.querySelector("td." + c); if (td.textContent !== text) td.textContent = text; };
    set("active", String(e.active));
    set("scheduled", String(e.scheduled));
    set("deferred", String(e.deferred));
    set("dead_letter", String(e.dead_letter));
    tr.querySelector("td.dead_letter").classList.toggle("nonzero", e.dead_letter > 0);
    set("send-rate", s.toFixed(1));
    set("receive-rate", r.toFixed(1));
  }
  for (const gone of rows.values()) gone.remove();
  if (before) {
    state.history.push({ send, recv });
    if (state.history.length > HISTORY) state.history.shift();
  }
  state.previous = data;
  state.readsNeedToken = data.reads_need_token;
  renderChart();
}

function renderChart() {
  const h = state.history;
  const max = Math.max(1, ...h.map((p) => Math.max(p.send, p.recv)));
  const x = (i) => (600 * (i + HISTORY - h.length)) / (HISTORY - 1);
  const y = (v) => 110 - (100 * v) / max;
  const line = (f) => h.map((p, i) => `${x(i).toFixed(1)},${y(p[f]).toFixed(1)}`).join(" ");
  $("chart-send").setAttribute("points", line("send"));
  $("chart-recv").setAttribute("points", line("recv"));
  $("chart-max").textContent = `${max.toFixed(1)}/s`;
}

async function poll() {
  try {
    renderEntities(await api("entities"));
    $("health").textContent = "live";
    $("health").className = "ok";
  } catch (e) {
    $("health").textContent = "unreachable: " + e.message;
    $("health").className = "error";
  }
}

// --- one entity: its dead-letter queue, active messages and sessions ------------------------

function select(e) {
  state.selected = e.path;
  state.kind = e.kind;
  state.from = 0;
  $("detail").hidden = false;
  $("detail-title").textContent = e.path;
  $("tab-sessions").hidden = !e.requires_session;
  $("resubmit-to-label").hidden = false;
  $("resubmit-to").placeholder = e.kind === "subscription" ? "its topic, or a queue" : "the queue itself";
  $("result").textContent = "";
  $("note").textContent = "";
  for (const tr of $("entities").children) tr.classList.toggle("selected", tr.dataset.path === e.path);
  view("dlq");
}

function view(v) {
  state.view = v;
  state.from = 0;
  for (const [id, name] of [["tab-dlq", "dlq"], ["tab-active", "active"], ["tab-sessions", "sessions"]]) {
    $(id).setAttribute("aria-pressed", String(name === v));
  }
  $("dlq-actions").hidden = v !== "dlq";
  loadMessages();
}

$("tab-dlq").addEventListener("click", () => view("dlq"));
$("tab-active").addEventListener("click", () => view("active"));
$("tab-sessions").addEventListener("click", () => view("sessions"));
$("refresh").addEventListener("click", () => loadMessages());
$("next-page").addEventListener("click", () => { state.from = state.next; loadMessages(); });
$("select-all").addEventListener("change", (ev) => {
  for (const c of document.querySelectorAll("#messages input.pick")) c.checked = ev.target.checked;
});

function head(columns) {
  const tr = document.createElement("tr");
  for (const c of columns) {
    const th = document.createElement("th");
    th.textContent = c;
    tr.appendChild(th);
  }
  $("messages-head").replaceChildren(tr);
}

function message(m) {
  const tr = document.createElement("tr");
  tr.dataset.seq = String(m.sequence_number);
  if (state.view === "dlq") {
    const td = document.createElement("td");
    const c = document.createElement("input");
    c.type = "checkbox";
    c.className = "pick";
    c.value = String(m.sequence_number);
    td.appendChild(c);
    tr.appendChild(td);
    cell(tr, String(m.sequence_number), "n seq");
    cell(tr, m.message_id || "");
    cell(tr, m.dead_letter_reason || "", "reason");
    cell(tr, m.dead_letter_description || "", "description");
  } else {
    cell(tr, String(m.sequence_number), "n seq");
    cell(tr, m.message_id || "");
    cell(tr, m.state);
    cell(tr, m.session_id || "");
  }
  cell(tr, String(m.delivery_count), "n");
  cell(tr, m.enqueued_time);
  cell(tr, m.body_preview, "body");
  const props = Object.entries(m.properties).map(([k, v]) => `${k}: ${JSON.stringify(v)}`);
  for (const [k, v] of [["subject", m.subject], ["content_type", m.content_type], ["correlation_id", m.correlation_id]]) {
    if (v) props.unshift(`${k}: ${v}`);
  }
  cell(tr, props.join("\n"), "body properties");
  return tr;
}

async function loadMessages() {
  if (!state.selected) return;
  const rows = $("messages");
  $("more").hidden = true;
  $("note").textContent = "";
  if (state.readsNeedToken && !credentials()) {
    head([]);
    rows.replaceChildren();
    $("note").textContent = "Sign in with a key that may listen to see messages and sessions.";
    $("note").className = "muted";
    return;
  }
  const entity = encodeURIComponent(state.selected);
  try {
    if (state.view === "sessions") {
      const data = await api(`sessions?entity=${entity}&top=50`);
      head(["Session", "Messages", "Locked by a receiver", "State"]);
      rows.replaceChildren(...data.sessions.map((s) => {
        const tr = document.createElement("tr");
        tr.dataset.session = s.session_id;
        cell(tr, s.session_id);
        cell(tr, s.messages + (s.more ? "+" : ""), "n");
        cell(tr, s.locked ? "yes" : "no");
        cell(tr, s.locked ? "(locked)" : (s.state_preview ?? "(none)"), "body");
        return tr;
      }));
      return;
    }
    const dlq = state.view === "dlq" ? 1 : 0;
    const data = await api(`peek?entity=${entity}&dlq=${dlq}&from=${state.from}&max=50`);
    head(dlq
      ? ["", "Seq", "Message id", "Reason", "Description", "Deliveries", "Enqueued", "Body", "Properties"]
      : ["Seq", "Message id", "State", "Session", "Deliveries", "Enqueued", "Body", "Properties"]);
    rows.replaceChildren(...data.messages.map(message));
    state.next = data.next_from;
    $("more").hidden = data.messages.length < 50;
    if (data.messages.length === 0) {
      $("note").textContent = dlq ? "The dead-letter queue is empty." : "No active messages.";
      $("note").className = "muted";
    }
  } catch (e) {
    rows.replaceChildren();
    $("note").textContent = e.message;
    $("note").className = "error";
  }
}

// --- resubmit and purge --------------------------------------------------------------------

function picked() {
  return [...document.querySelectorAll("#messages input.pick:checked")].map((c) => Number(c.value));
}

async function change(what) {
  const seqs = picked();
  if (seqs.length === 0) {
    $("result").textContent = "Select the messages first.";
    $("result").className = "error";
    return;
  }
  if (!credentials()) {
    $("result").textContent = "Sign in with a key to change anything.";
    $("result").className = "error";
    return;
  }
  const body = { entity: state.selected, sequence_numbers: seqs };
  if (what === "resubmit") {
    const to = $("resubmit-to").value.trim();
    if (to) body.to = to;
    if ($("new-id").checked) body.new_id = true;
  } else if (!confirm(`Delete ${seqs.length} dead-lettered message(s) of ${state.selected}?`)) {
    return;
  }
  try {
    const r = await api(what, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    const verb = what === "resubmit" ? "resubmitted" : "purged";
    const notes = [];
    if (r.kept.length) notes.push(`${r.kept.length} kept (inside the target's duplicate-detection window; try new message ids)`);
    if (r.missing.length) notes.push(`${r.missing.length} no longer there`);
    if (r.in_both.length) notes.push(`${r.in_both.length} sent but still dead-lettered`);
    if (r.error) notes.push("stopped: " + r.error.message);
    $("result").textContent = `${verb} ${r.done.length} of ${seqs.length}` + (notes.length ? "; " + notes.join("; ") : "");
    $("result").className = r.error || r.in_both.length ? "error" : "ok";
  } catch (e) {
    $("result").textContent = e.message;
    $("result").className = "error";
  }
  $("select-all").checked = false;
  await Promise.all([poll(), loadMessages()]);
}

$("resubmit").addEventListener("click", () => change("resubmit"));
$("purge").addEventListener("click", () => change("purge"));

showCredentials();
poll();
setInterval(poll, POLL_MS);
