"use strict";
// The page at / of colibri serve: a chat over the public API, streamed (SSE), with the
// routing extension on, so every token arrives with its experts (routing.js draws them).
// A model with a chat template chats through /v1/chat/completions; one without continues the
// text so far through /v1/completions (the page says so). With --api-key the page asks for
// the key, keeps it for this tab only (sessionStorage) and sends it as a bearer token.

const $ = (id) => document.getElementById(id);
const KEY_STORE = "colibri-api-key";

const state = {
  key: sessionStorage.getItem(KEY_STORE) || "",
  card: null,            // /v1/models' entry for the served model
  chat: true,            // false: no chat template, text continuation over /v1/completions
  messages: [],          // the chat history sent with each request
  transcript: "",        // the text so far (completion mode)
  busy: null,            // the AbortController of the reply being streamed
  epoch: 0,              // bumped by reset: a reply of an older conversation records nothing
};

const view = new RoutingView({
  heatmap: $("heatmap"), utilisation: $("utilisation"), layer: $("layer"),
  heatTotal: $("heat-total"), utilNote: $("util-note"), legend: $("legend"),
});
view.onLayer = () => document.querySelectorAll("#log .tok").forEach((s) => view.paint(s));

class NeedKey extends Error {}

// -- the API -------------------------------------------------------------------------------
async function api(path, init) {
  const headers = {"Content-Type": "application/json"};
  if (state.key) headers.Authorization = `Bearer ${state.key}`;
  const resp = await fetch(path, Object.assign({}, init, {headers}));
  if (resp.status === 401) {
    askKey(state.key ? "The server refused this api key; enter the one it runs with."
                     : "This server needs an api key (it runs with --api-key).");
    throw new NeedKey("api key required");
  }
  return resp;
}

// what a request too long for the context can do about it
const HINTS = {
  context_length_exceeded: " Reset the conversation, or lower max tokens, to go on.",
};

async function errorText(resp) {
  const raw = await resp.text();
  try {
    const body = JSON.parse(raw);
    if (body.error && body.error.message) return body.error.message + (HINTS[body.error.code] || "");
    if (body.detail) return typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
  } catch (e) { /* not JSON: the raw text below */ }
  return `HTTP ${resp.status}: ${raw.slice(0, 200)}`;
}

// the data: payloads of an SSE response, parsed, until [DONE]
async function* sseChunks(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) throw new Error("The stream ended before its [DONE]: the server stopped or the " +
                              "connection broke; the reply is cut here.");
    buf += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

// -- connecting ----------------------------------------------------------------------------
function askKey(message) {
  $("key-message").textContent = message;
  if (!state.card) $("model-name").textContent = "waiting for the api key";
  $("key-dialog").hidden = false;
  $("send").disabled = true;
  $("key-input").focus();
}

function notice(text, isError) {
  const n = $("notice");
  n.textContent = text;
  n.hidden = !text;
  n.classList.toggle("error", !!isError);
}

async function connect() {
  let resp;
  try {
    resp = await api("/v1/models");
  } catch (e) {
    if (!(e instanceof NeedKey)) notice(`Cannot reach the server: ${e.message}`, true);
    return;
  }
  if (!resp.ok) { notice(`GET /v1/models failed: ${await errorText(resp)}`, true); return; }
  $("key-dialog").hidden = true;
  const card = (await resp.json()).data[0];
  const ext = card.colibri || {};
  state.card = card;
  state.chat = !!ext.chat_template;
  $("model-name").textContent = `${card.id} · ${ext.experts} experts, top-${ext.experts_per_token}` +
    ` · ${(ext.moe_layers || []).length} MoE layers · ${ext.ctx} tokens of context`;
  $("mode").textContent = state.chat ? "chat" : "text continuation";
  $("mode").dataset.mode = state.chat ? "chat" : "completion";
  notice(state.chat ? "" :
    `The model file of ${card.id} has no chat template, so it cannot chat ` +
    "(/v1/chat/completions answers 400 no_chat_template). The page continues text instead: " +
    "each message is appended to the text so far and the model continues it through " +
    "/v1/completions.");
  $("input").placeholder = state.chat
    ? "Send a message (Enter sends, Shift+Enter breaks the line)"
    : "Text for the model to continue (Enter sends, Shift+Enter breaks the line)";
  view.configure(ext.moe_layers || [], ext.experts || 0, ext.experts_per_token || 0);
  $("send").disabled = false;
}

// -- the conversation ------------------------------------------------------------------------
function addMessage(role, text) {
  const box = document.createElement("div");
  box.className = `msg ${role}`;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role === "user" ? "you" : (state.card ? state.card.id : "model");
  const body = document.createElement("div");
  body.className = "body";
  body.textContent = text;
  const tail = document.createElement("div");
  tail.className = "tail";
  box.append(who, body, tail);
  $("log").appendChild(box);
  scrollDown();
  return {box, body, tail};
}

function scrollDown() {
  const log = $("log");
  log.scrollTop = log.scrollHeight;
}

function appendToken(reply, text, routings) {
  const span = document.createElement("span");
  span.className = "tok";
  span.textContent = text;
  if (routings.length) {
    span.routing = routings;
    span.title = view.describe(routings);
    view.paint(span);
  }
  reply.body.appendChild(span);
  scrollDown();
}

function number(id, parse) {
  const v = parse($(id).value);
  return Number.isFinite(v) ? v : undefined;
}

function requestBody(text) {
  const body = {model: state.card.id, stream: true, stream_options: {include_usage: true},
                colibri: {routing: true}};
  const temperature = number("temperature", parseFloat);
  const maxTokens = number("max-tokens", (v) => parseInt(v, 10));
  const topP = number("top-p", parseFloat);
  const seed = number("seed", (v) => parseInt(v, 10));
  if (temperature !== undefined) body.temperature = temperature;
  if (maxTokens !== undefined) body.max_tokens = maxTokens;
  if (topP !== undefined) body.top_p = topP;
  if (seed !== undefined) body.seed = seed;
  if (state.chat) {
    const system = $("system").value.trim();
    body.messages = (system ? [{role: "system", content: system}] : [])
      .concat(state.messages, [{role: "user", content: text}]);
  } else {
    body.prompt = state.transcript + text;
  }
  return body;
}

function setBusy(busy) {
  $("send").disabled = busy || !state.card;
  $("stop").disabled = !busy;
  document.body.dataset.busy = busy ? "1" : "";
}

async function send(text) {
  if (state.busy || !state.card || !text) return;
  const body = requestBody(text);
  addMessage("user", text);
  const reply = addMessage("assistant", "");
  const ctl = new AbortController(), epoch = state.epoch;
  state.busy = ctl;
  setBusy(true);
  const t0 = performance.now();
  let content = "", tokens = 0, pending = [], finish = null, usage = null, failure = null;
  let stopped = false;
  try {
    const path = state.chat ? "/v1/chat/completions" : "/v1/completions";
    const resp = await api(path, {method: "POST", body: JSON.stringify(body), signal: ctl.signal});
    if (!resp.ok) throw new Error(await errorText(resp));
    for await (const chunk of sseChunks(resp)) {
      if (epoch !== state.epoch) break;       // reset while it ran
      if (chunk.error) throw new Error(chunk.error.message || "the server failed");
      if (chunk.usage) usage = chunk.usage;
      const c = chunk.choices && chunk.choices[0];
      if (!c) continue;
      for (const r of (c.colibri && c.colibri.routing) || []) {
        if (r && view.add(r)) { pending.push(r); tokens += 1; }
      }
      const piece = state.chat ? (c.delta && c.delta.content) || "" : c.text || "";
      if (piece) { appendToken(reply, piece, pending); pending = []; content += piece; }
      if (c.finish_reason) finish = c.finish_reason;
      const s = (performance.now() - t0) / 1000;
      $("status").textContent = `generating… ${tokens} tokens, ${(tokens / s).toFixed(1)} tokens/s`;
    }
  } catch (e) {
    if (e.name === "AbortError") stopped = true;
    else if (e instanceof NeedKey) failure = "The server needs an api key.";
    else if (e instanceof TypeError) failure = `Cannot reach the server (${e.message}).`;
    else failure = e.message;
  } finally {
    state.busy = null;
    setBusy(false);
  }
  if (epoch !== state.epoch) return;        // reset: its box and its history are gone
  view.flush();
  const seconds = (performance.now() - t0) / 1000;
  const parts = [`${tokens} tokens in ${seconds.toFixed(1)} s`];
  if (tokens && seconds > 0) parts.push(`${(tokens / seconds).toFixed(1)} tokens/s`);
  if (usage) parts.push(`prompt ${usage.prompt_tokens} tokens`);
  if (stopped) parts.push("stopped");
  else if (finish) parts.push(finish === "length" ? "finish: max tokens reached" : "finish: stop");
  reply.tail.textContent = parts.join(" · ");
  $("status").textContent = "";
  if (failure) {
    reply.box.classList.add("error");
    const err = document.createElement("div");
    err.className = "errmsg";
    err.textContent = failure;
    reply.body.appendChild(err);
  }
  reply.box.dataset.done = stopped ? "stopped" : failure ? "error" : "done";
  if (failure && !content) return;          // nothing happened: the history stays as it was
  if (state.chat) {
    state.messages.push({role: "user", content: text}, {role: "assistant", content});
  } else {
    state.transcript += text + content;
  }
}

function reset() {
  state.epoch += 1;
  if (state.busy) state.busy.abort();
  state.messages = [];
  state.transcript = "";
  $("log").textContent = "";
  $("status").textContent = "";
  view.reset();
}

// -- wiring ------------------------------------------------------------------------------------
$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("input").value;
  if (!text.trim() || state.busy || !state.card) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
    ev.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => { if (state.busy) state.busy.abort(); });
$("reset").addEventListener("click", reset);
$("settings-toggle").addEventListener("click", () => {
  const s = $("settings");
  s.hidden = !s.hidden;
  $("settings-toggle").setAttribute("aria-expanded", String(!s.hidden));
});
function useKey(key) {
  state.key = key.trim();
  if (state.key) sessionStorage.setItem(KEY_STORE, state.key);
  else sessionStorage.removeItem(KEY_STORE);
  $("api-key").value = state.key;
  connect();
}
$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  useKey($("key-input").value);
});
$("api-key").value = state.key;
$("api-key").addEventListener("change", () => useKey($("api-key").value));

connect();
