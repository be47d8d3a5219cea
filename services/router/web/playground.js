// The playground: a chat with streamed answers and the settings each request carries. Every answer
// shows TTFT and tokens/s as this page saw them, prompt and cached tokens, and the share of the
// full model's work computed; the latest answer's map of the prompt is drawn below.

import { postJson, streamChat } from "./api.js";
import { $, figureList } from "./dom.js";
import { drawMap } from "./map.js";

const LONG_MESSAGE = 1200; // characters past which a message is folded into a <details>
const MAX_FILE_BYTES = 4 * 1024 * 1024; // the gateway's body limit

// A model without a chat template (a base model) continues text: the conversation is one
// document, each message appended to it, sent to /v1/completions as its prompt.
let chatTemplate = true;
export function useChatTemplate(has) {
  chatTemplate = has;
}

// The conversation as the request carries it: chat messages, or the document a base model continues.
export function promptOf(messages) {
  return chatTemplate ? { messages } : { prompt: messages.map((message) => message.content).join("") };
}

// The request the settings describe, for these messages (without stream options).
export function requestFor(messages, pruning) {
  const body = {
    model: $("model").value,
    ...promptOf(messages),
    max_tokens: Number($("max-tokens").value) || 1,
    temperature: Number($("temperature").value),
  };
  if (pruning !== undefined) body.pruning = pruning;
  return body;
}

// The pruning the settings choose: a preset's name, or the schedule typed as JSON.
export function chosenPruning() {
  if ($("preset").value !== "schedule") return $("preset").value;
  try {
    return JSON.parse($("schedule").value);
  } catch (error) {
    throw new Error(`the schedule is not JSON: ${error.message}`);
  }
}

// The figures of one answer, in the order a person reads them.
export function answerFigures(result) {
  const usage = result.usage || {};
  const metrics = result.metrics || {};
  const entries = [["TTFT", `${result.ttftS.toFixed(2)} s`]];
  entries.push(["tokens/s", result.tokensPerS === null ? "–" : result.tokensPerS.toFixed(1)]);
  entries.push(["prompt tokens", String(usage.prompt_tokens ?? "–")]);
  entries.push(["cached tokens", String(usage.prompt_tokens_details?.cached_tokens ?? 0)]);
  const fraction = metrics.computed_fraction;
  entries.push(["computed", fraction === undefined ? "–" : `${(100 * fraction).toFixed(1)}%`]);
  entries.push(["pruning", metrics.pruning ?? "–"]);
  return entries;
}

function messageItem(role, text) {
  const item = document.createElement("li");
  item.className = `message ${role}`;
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = role === "user" ? "You" : "Model";
  const body = document.createElement("div");
  body.className = "text";
  if (text.length > LONG_MESSAGE) {
    const details = document.createElement("details");
    const summary = document.createElement("summary");
    summary.textContent = `${text.slice(0, 160)}… (${text.length.toLocaleString()} characters)`;
    const full = document.createElement("div");
    full.textContent = text;
    details.append(summary, full);
    body.append(details);
  } else {
    body.textContent = text;
  }
  item.append(who, body);
  return item;
}

export class Playground {
  constructor(status) {
    this.status = status; // GET /status: the model's layers, presets, return_token_depths' limit
    this.messages = [];
    this.reading = Promise.resolve(); // an attached file still being read
  }

  reset() {
    this.messages = [];
    $("conversation").replaceChildren();
    $("map").hidden = true;
  }

  async attach(file) {
    if (file.size > MAX_FILE_BYTES) throw new Error(`${file.name} is over 4 MiB, the server's limit for a request`);
    // Reading is asynchronous: a send started meanwhile waits for it, so it never goes without the file.
    this.reading = file.text().then((text) => {
      const box = $("message");
      box.value = box.value ? `${text}\n\n${box.value}` : text;
    });
    await this.reading;
  }

  // Resolves once an attached file is in the message box (a failed read was said already).
  settled() {
    return this.reading.catch(() => {});
  }

  // Send the message box's text as the next turn; stream the answer into the conversation.
  async send(controller) {
    await this.settled();
    const text = $("message").value;
    if (!text.trim()) return;
    const pruning = chosenPruning();
    const messages = [...this.messages, { role: "user", content: text }];
    // The prompt's tokens first (the map's text, and whether depths can be asked for it).
    const tokens = await postJson("/tokenize", { model: $("model").value, ...promptOf(messages), return_token_strs: true });
    const body = requestFor(messages, pruning);
    body.return_token_depths = tokens.count <= this.status.max_depth_tokens;

    $("message").value = "";
    $("conversation").append(messageItem("user", text));
    const answer = messageItem("assistant", "");
    answer.setAttribute("aria-busy", "true");
    $("conversation").append(answer);
    const out = answer.querySelector(".text");
    try {
      const result = await streamChat(body, (delta) => {
        out.textContent += delta;
        answer.scrollIntoView({ block: "end" });
      }, controller.signal);
      this.messages = [...messages, { role: "assistant", content: result.text }];
      const figures = document.createElement("dl");
      figures.className = "figures";
      figureList(figures, answerFigures(result));
      answer.append(figures);
      drawMap($("map"), tokens, result.metrics, this.status.model.num_layers, this.status.max_depth_tokens);
    } catch (error) {
      if (error.name === "AbortError") {
        // Stopped: the answer so far stays, as the conversation's last turn.
        this.messages = [...messages, { role: "assistant", content: out.textContent }];
        answer.append(Object.assign(document.createElement("p"), { className: "muted", textContent: "stopped" }));
        return;
      }
      $("message").value = text; // nothing is lost: the message goes back in the box
      answer.remove();
      $("conversation").lastChild?.remove();
      throw error;
    } finally {
      answer.removeAttribute("aria-busy");
    }
  }
}
