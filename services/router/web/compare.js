// Compare: the message (after the conversation so far) sent twice, unpruned and with the chosen
// pruning, one after the other so neither slows the other; both answers streamed side by side with
// their TTFTs, and where they first differ, token by token (from the answers' logprobs tokens).
// Neither answer joins the conversation: the message stays in the box, to be sent if wanted.

import { streamChat } from "./api.js";
import { $, figureList } from "./dom.js";
import { answerFigures, chosenPruning, requestFor } from "./playground.js";

const SEED = 20240718; // both sides sample with the same seed when the temperature is above 0

function label(pruning) {
  return typeof pruning === "string" ? pruning : "schedule";
}

function commonPrefix(a, b) {
  let index = 0;
  while (index < a.length && index < b.length && a[index] === b[index]) index++;
  return index;
}

// What a person reads about the two token lists: the same, or where and how they part.
export function difference(off, pruned) {
  const at = commonPrefix(off, pruned);
  if (at === off.length && at === pruned.length) return { at: null, text: `Same answer, token for token (${off.length} tokens).` };
  const show = (token) => (token === undefined ? "the end" : JSON.stringify(token));
  return {
    at,
    text: `The answers first differ at token ${at + 1}: ${show(off[at])} unpruned, ${show(pruned[at])} pruned.`,
  };
}

// Mark an answer's text from the first character where it leaves the other one.
function markFrom(answer, text, other) {
  const at = commonPrefix(text, other);
  answer.replaceChildren(document.createTextNode(text.slice(0, at)));
  if (at < text.length) {
    const rest = document.createElement("mark");
    rest.textContent = text.slice(at);
    answer.append(rest);
  }
}

async function side(article, body, signal) {
  const answer = article.querySelector(".answer");
  const figures = article.querySelector(".figures");
  answer.replaceChildren();
  figures.replaceChildren();
  article.setAttribute("aria-busy", "true");
  try {
    const result = await streamChat(body, (delta) => answer.append(delta), signal);
    answer.textContent = result.text;
    figureList(figures, answerFigures(result));
    return result;
  } finally {
    article.removeAttribute("aria-busy");
  }
}

export async function compare(history, controller) {
  const text = $("message").value;
  if (!text.trim()) throw new Error("type a message to compare");
  const pruning = chosenPruning();
  if (pruning === "off") throw new Error("choose a pruning preset or a schedule to compare against unpruned");
  const messages = [...history, { role: "user", content: text }];
  const section = $("comparison");
  section.hidden = false;
  $("comparison-title").textContent = `Compare: unpruned and ${label(pruning)}`;
  $("compare-pruned").querySelector("h3").textContent = `Pruned (${label(pruning)})`;
  $("difference").textContent = "";
  const request = (choice) => {
    const body = { ...requestFor(messages, choice), logprobs: true };
    if (body.temperature > 0) body.seed = SEED;
    return body;
  };
  const off = await side($("compare-off"), request("off"), controller.signal);
  const pruned = await side($("compare-pruned"), request(pruning), controller.signal);
  markFrom($("compare-off").querySelector(".answer"), off.text, pruned.text);
  markFrom($("compare-pruned").querySelector(".answer"), pruned.text, off.text);
  $("difference").textContent = difference(off.tokens, pruned.tokens).text;
  section.scrollIntoView({ block: "start" });
}
