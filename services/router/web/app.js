// The page's entry: asks the server what it serves (/status, /v1/models), asks for an API key when
// the server wants one, and wires the controls: tabs, Send (Enter; Shift+Enter is a new line),
// Compare, Stop, a file to paste, and the service view.

import { ApiError, apiKey, getJson } from "./api.js";
import { compare } from "./compare.js";
import { $ } from "./dom.js";
import { Playground, useChatTemplate } from "./playground.js";
import { ServiceView } from "./service.js";

let running = null; // the AbortController of the request in progress
let wired = false; // the controls are wired once; a new key only shows the views again

function showError(error) {
  if (error instanceof ApiError && error.status === 401) {
    askForKey(apiKey.get() ? "The server refused this key." : "");
    return;
  }
  $("composer-error").textContent = error.message;
}

function askForKey(message) {
  $("key-panel").hidden = false;
  $("views").hidden = true;
  $("key-error").textContent = message;
  $("api-key").focus();
}

// Run one request at a time: Send and Compare wait, Stop can end it.
async function exclusive(task) {
  if (running) return;
  running = new AbortController();
  $("composer-error").textContent = "";
  for (const id of ["send", "compare"]) $(id).disabled = true;
  $("stop").hidden = false;
  try {
    await task(running);
  } catch (error) {
    if (error.name !== "AbortError") showError(error);
  } finally {
    running = null;
    for (const id of ["send", "compare"]) $(id).disabled = false;
    $("stop").hidden = true;
  }
}

function options(select, values, chosen) {
  select.replaceChildren(
    ...values.map(([value, text]) => {
      const option = new Option(text, value);
      option.selected = value === chosen;
      return option;
    }),
  );
}

function wireTabs(service) {
  const tabs = [...document.querySelectorAll('[role="tab"]')];
  const choose = (tab) => {
    for (const other of tabs) {
      const chosen = other === tab;
      other.setAttribute("aria-selected", String(chosen));
      other.tabIndex = chosen ? 0 : -1;
      $(other.getAttribute("aria-controls")).hidden = !chosen;
    }
    if (tab.id === "tab-service") service.start();
    else service.stop();
  };
  tabs.forEach((tab, index) => {
    tab.addEventListener("click", () => choose(tab));
    tab.addEventListener("keydown", (event) => {
      const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
      if (!step) return;
      const next = tabs[(index + step + tabs.length) % tabs.length];
      next.focus();
      choose(next);
    });
  });
}

function wireComposer(playground) {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    exclusive((controller) => playground.send(controller));
  });
  $("message").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("compare").addEventListener("click", () =>
    exclusive(async (controller) => {
      await playground.settled();
      await compare(playground.messages, controller);
    }),
  );
  $("stop").addEventListener("click", () => running?.abort());
  $("new-chat").addEventListener("click", () => playground.reset());
  $("file").addEventListener("change", async (event) => {
    const [file] = event.target.files;
    if (!file) return;
    try {
      await playground.attach(file);
    } catch (error) {
      showError(error);
    }
    event.target.value = "";
  });
  $("preset").addEventListener("change", () => {
    $("schedule-row").hidden = $("preset").value !== "schedule";
  });
}

async function start() {
  let status;
  try {
    status = await getJson("/status");
  } catch (error) {
    if (error instanceof ApiError && error.status === 401) return askForKey(apiKey.get() ? "The server refused this key." : "");
    $("key-panel").hidden = true;
    $("composer-error").textContent = `The server's status could not be read: ${error.message}`;
    return;
  }
  $("key-panel").hidden = true;
  $("views").hidden = false;
  $("forget-key").hidden = !apiKey.get();
  if (wired) return;
  wired = true;
  const models = await getJson("/v1/models");
  $("model-name").textContent = `${status.model.name} · ${status.model.num_layers} layers`;
  options($("model"), models.data.map((card) => [card.id, card.id]), status.model.name);
  const presets = status.pruning_presets.map((name) => [name, name === status.pruning_preset ? `${name} (server default)` : name]);
  options($("preset"), [...presets, ["schedule", "schedule (JSON)"]], status.pruning_preset);
  // A schedule that fits this model: one cut at 60% depth keeping a fifth, as `default` does.
  let cut = Math.min(Math.round(0.6 * status.model.num_layers), status.model.num_layers - 2);
  // A model with sliding-window layers prunes only at its global layers: the first at or after it.
  const allowed = (status.model.stage_layers || []).filter((layer) => layer < status.model.num_layers - 1);
  if (allowed.length) cut = allowed.find((layer) => layer >= cut) ?? allowed[allowed.length - 1];
  $("schedule").value = JSON.stringify({ stages: [[cut, 0.2]], granularity: "block", block_size: 32 });

  useChatTemplate(status.model.chat_template);
  if (!status.model.chat_template) $("model-name").textContent += " · no chat template: the conversation is text it continues";
  const playground = new Playground(status);
  const service = new ServiceView(showError);
  wireTabs(service);
  wireComposer(playground);
  document.body.dataset.ready = "true"; // for tests: the controls are wired
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("api-key").value.trim();
  if (!key) return;
  apiKey.set(key);
  $("api-key").value = "";
  start();
});
$("forget-key").addEventListener("click", () => {
  apiKey.forget();
  location.reload();
});

start();
