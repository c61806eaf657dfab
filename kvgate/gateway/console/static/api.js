// Calls to the gateway's own API, with the API key typed into the page (sessionStorage: it
// lasts as long as the tab). A refused call throws Refusal, which a panel shows instead of data.

const KEY = "kvgate.apiKey";
const MCP_VERSION = "2026-07-28";

export class Refusal extends Error {
  constructor(status, message) {
    super(`${status}: ${message}`);
    this.status = status;
  }
}

export function apiKey() {
  return sessionStorage.getItem(KEY) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
}

function headers(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function refusal(response) {
  const text = await response.text();
  let message = text;
  try {
    const body = JSON.parse(text);
    message = body.error?.message ?? body.error ?? text;
  } catch {
    // a plain-text answer: shown as it is
  }
  return new Refusal(response.status, String(message).trim() || response.statusText);
}

export async function getJSON(path) {
  const response = await fetch(path, { headers: headers() });
  if (!response.ok) throw await refusal(response);
  return response.json();
}

export async function getText(path) {
  const response = await fetch(path, { headers: headers() });
  if (!response.ok) throw await refusal(response);
  return response.text();
}

// One MCP request on the modern wire (no session: every request stands alone).
export async function mcp(method, params = {}) {
  const meta = {
    "io.modelcontextprotocol/protocolVersion": MCP_VERSION,
    "io.modelcontextprotocol/clientInfo": { name: "kvgate-console", version: "1" },
    "io.modelcontextprotocol/clientCapabilities": {},
  };
  const response = await fetch("/mcp", {
    method: "POST",
    headers: headers({
      "Content-Type": "application/json",
      Accept: "application/json, text/event-stream",
      "MCP-Protocol-Version": MCP_VERSION,
      "Mcp-Method": method,
    }),
    body: JSON.stringify({ jsonrpc: "2.0", id: 1, method, params: { ...params, _meta: meta } }),
  });
  if (!response.ok) throw await refusal(response);
  const body = await response.json();
  if (body.error) throw new Refusal(body.error.code, body.error.message);
  return body.result;
}

// A streamed chat completion: onChunk gets every parsed SSE chunk, in order.
export async function streamChat(body, onChunk) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: headers({ "Content-Type": "application/json" }),
    body: JSON.stringify({ ...body, stream: true }),
  });
  if (!response.ok) throw await refusal(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let pending = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    pending += value;
    const events = pending.split("\n\n");
    pending = events.pop();
    for (const event of events) {
      const data = event.startsWith("data: ") ? event.slice(6) : "";
      if (data === "[DONE]") return;
      if (data) {
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Refusal(chunk.error.code ?? 500, chunk.error.message);
        onChunk(chunk);
      }
    }
  }
}
