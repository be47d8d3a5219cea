// The gateway's own API, as any client calls it: JSON requests, server-sent events for streams.
// The API key (when the server asks for one) lives in sessionStorage for this tab only and goes
// in the Authorization header; it never appears in an address.

const KEY = "lazyserve.apiKey";

export class ApiError extends Error {
  constructor(status, message, param) {
    super(message);
    this.status = status;
    this.param = param;
  }
}

export const apiKey = {
  get: () => sessionStorage.getItem(KEY),
  set: (key) => sessionStorage.setItem(KEY, key),
  forget: () => sessionStorage.removeItem(KEY),
};

function headers() {
  const result = { "Content-Type": "application/json" };
  const key = apiKey.get();
  if (key) result.Authorization = `Bearer ${key}`;
  return result;
}

async function failure(response) {
  let message = `${response.status} ${response.statusText}`;
  let param = null;
  try {
    const body = await response.json();
    if (body.error) {
      message = body.error.message || message;
      param = body.error.param || null;
    }
  } catch {
    // not JSON: the status line says enough
  }
  return new ApiError(response.status, message, param);
}

export async function getJson(path) {
  const response = await fetch(path, { headers: headers() });
  if (!response.ok) throw await failure(response);
  return response.json();
}

export async function postJson(path, body, signal) {
  const response = await fetch(path, { method: "POST", headers: headers(), body: JSON.stringify(body), signal });
  if (!response.ok) throw await failure(response);
  return response.json();
}

// Each `data:` event of a server-sent event stream, parsed, until [DONE].
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

// A streamed chat completion (a body with `messages`) or text completion (with `prompt`).
// onText(delta) is called as the answer arrives. Resolves to what a person wants to see about it:
// the text, its tokens (when logprobs were asked), the TTFT and tokens/s as this page saw them,
// usage and lazyserve's metrics.
export async function streamChat(body, onText, signal) {
  const request = { ...body, stream: true, stream_options: { include_usage: true } };
  const started = performance.now();
  const response = await fetch("prompt" in body ? "/v1/completions" : "/v1/chat/completions", {
    method: "POST",
    headers: headers(),
    body: JSON.stringify(request),
    signal,
  });
  if (!response.ok) throw await failure(response);
  const result = { text: "", tokens: [], usage: null, metrics: null, finishReason: null, ttftS: null };
  let firstAt = null;
  for await (const chunk of events(response)) {
    if (chunk.error) throw new ApiError(500, chunk.error.message, chunk.error.param);
    if (chunk.usage) result.usage = chunk.usage;
    if (chunk.metrics) result.metrics = chunk.metrics;
    for (const choice of chunk.choices || []) {
      const delta = choice.delta?.content ?? choice.text;
      if (delta) {
        if (firstAt === null) firstAt = performance.now();
        result.text += delta;
        onText(delta);
      }
      for (const item of choice.logprobs?.content || []) result.tokens.push(item.token);
      for (const token of choice.logprobs?.tokens || []) result.tokens.push(token); // /v1/completions' shape
      if (choice.finish_reason) result.finishReason = choice.finish_reason;
    }
  }
  const ended = performance.now();
  result.ttftS = ((firstAt ?? ended) - started) / 1000;
  const generated = result.usage?.completion_tokens ?? 0;
  const decodeS = firstAt === null ? 0 : (ended - firstAt) / 1000;
  result.tokensPerS = generated > 1 && decodeS > 0 ? (generated - 1) / decodeS : null;
  return result;
}
