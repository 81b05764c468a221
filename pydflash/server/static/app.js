// The chat page: streams replies from /v1/chat/completions (server-sent events) and shows tok/s and the
// acceptance length the server reports in each reply's final chunk (`timings`).
"use strict";

const log = document.getElementById("log");
const input = document.getElementById("input");
const form = document.getElementById("form");
const sendButton = document.getElementById("send");
const apiKey = document.getElementById("apikey");
const thinking = document.getElementById("thinking");
let model = null;
let history = [];              // the conversation sent with every request (multi-turn)

apiKey.value = localStorage.getItem("pydflash-api-key") || "";
apiKey.addEventListener("change", () => { localStorage.setItem("pydflash-api-key", apiKey.value); loadModel(); });

function headers() {
  const h = { "Content-Type": "application/json" };
  if (apiKey.value) h["Authorization"] = "Bearer " + apiKey.value;
  return h;
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const body = await r.json();
    model = r.ok ? body.data[0].id : null;
    document.getElementById("model").textContent = model || (body.error && body.error.message) || "?";
  } catch (e) {
    document.getElementById("model").textContent = "server unreachable";
  }
}

function bubble(cls, text) {
  const div = document.createElement("div");
  div.className = "msg " + cls;
  div.textContent = text || "";
  log.appendChild(div);
  log.scrollTop = log.scrollHeight;
  return div;
}

// Yields the JSON payloads of a server-sent-event stream, ending at [DONE].
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    const lines = buffer.split(/\r?\n/);
    buffer = lines.pop();
    for (const line of lines) {
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

function statsLine(timings, seconds) {
  if (!timings) return "";
  const parts = [`${timings.predicted_n} tokens`, `${timings.predicted_per_second.toFixed(1)} tok/s`];
  if (timings.acceptance_length != null) parts.push(`acceptance length ${timings.acceptance_length.toFixed(2)}`);
  parts.push(`first token ${(timings.prompt_ms / 1000).toFixed(2)} s`);
  if (timings.reused_tokens) parts.push(`${timings.reused_tokens} prompt tokens reused`);
  return parts.join(" · ");
}

async function send(text) {
  history.push({ role: "user", content: text });
  bubble("user", text);
  const reply = bubble("assistant", "");
  const content = document.createElement("span");
  const stats = document.createElement("div");
  stats.className = "stats";
  let reasoning = null;
  reply.appendChild(content);
  reply.appendChild(stats);
  const body = { messages: history, stream: true, chat_template_kwargs: { enable_thinking: thinking.checked } };
  if (model) body.model = model;
  const started = performance.now();
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body) });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || `HTTP ${r.status}`);
    }
    let answer = "";
    for await (const chunk of events(r)) {
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      if (delta.reasoning_content) {
        if (!reasoning) {
          reasoning = document.createElement("details");
          reasoning.className = "reasoning";
          reasoning.open = true;
          reasoning.innerHTML = "<summary>thinking</summary>";
          reply.insertBefore(reasoning, content);
        }
        reasoning.appendChild(document.createTextNode(delta.reasoning_content));
      }
      if (delta.content) {
        answer += delta.content;
        content.textContent = answer;
      }
      if (chunk.timings) stats.textContent = statsLine(chunk.timings, (performance.now() - started) / 1000);
      log.scrollTop = log.scrollHeight;
    }
    history.push({ role: "assistant", content: answer });
  } catch (e) {
    history.pop();
    reply.remove();
    bubble("error", String(e.message || e));
  }
}

form.addEventListener("submit", async (event) => {
  event.preventDefault();
  const text = input.value.trim();
  if (!text) return;
  input.value = "";
  sendButton.disabled = true;
  try { await send(text); } finally { sendButton.disabled = false; input.focus(); }
});

input.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); form.requestSubmit(); }
});

document.getElementById("reset").addEventListener("click", () => { history = []; log.innerHTML = ""; });

loadModel();
