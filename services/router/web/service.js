// The service view: GET /status every few seconds while the view is shown (and the tab visible):
// requests in flight and waiting in the admission queue, the last minute's TTFT p50/p95, ITL p50,
// tokens/s and goodput (with service level targets set), the preset in force, whether shared state
// (Redis) answers, and the workers with their load, sequences, prefill queue and health.

import { getJson } from "./api.js";
import { $, figureList } from "./dom.js";

const PERIOD_MS = 3000;

function seconds(value) {
  return value === null || value === undefined ? "–" : `${value.toFixed(2)} s`;
}

// The share of the last minute's finished requests that met the targets, and their rate.
function goodput(figures) {
  if (!figures) return "no targets set";
  if (figures.share === null) return "–";
  return `${Math.round(figures.share * 100)}% (${figures.requests_per_s.toFixed(2)} req/s)`;
}

// What waits to be prefilled on a worker: predicted cost in full-model prompt tokens, for a
// decode worker the prompts waiting in its rounds, and the rate the worker last reported.
function prefillQueue(worker) {
  const parts = [`${Math.round(worker.prefill_queued).toLocaleString()} tokens`];
  if (worker.prefills_waiting !== null) parts.push(`${worker.prefills_waiting} waiting`);
  if (worker.prefill_rate) parts.push(`${Math.round(worker.prefill_rate).toLocaleString()} tok/s`);
  return parts.join(", ");
}

// Where shared state lives; while Redis does not answer the gateway serves degraded: on the
// workers it last saw, with its own counts (services/router/fallback.py).
function sharedState(status) {
  if (status.shared_state !== "redis") return "no Redis";
  return status.degraded ? "Redis down: degraded" : "Redis";
}

function cell(row, text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  row.append(td);
}

export function drawStatus(status) {
  const recent = status.recent;
  figureList($("service-figures"), [
    ["in flight", String(status.in_flight)],
    ["queued", `${status.queue.depth} of ${status.queue.max}`],
    ["oldest queued", status.queue.depth ? seconds(status.queue.oldest_wait_s) : "–"],
    ["TTFT p50 (last minute)", seconds(recent.ttft_p50_s)],
    ["TTFT p95 (last minute)", seconds(recent.ttft_p95_s)],
    ["ITL p50 (last minute)", seconds(recent.itl_p50_s)],
    ["tokens/s (last minute)", recent.tokens_per_s.toFixed(1)],
    ["requests (last minute)", String(recent.requests)],
    ["goodput (last minute)", goodput(recent.goodput)],
    ["pruning preset", status.pruning_preset],
    ["prefix caching", status.prefix_caching ? "on" : "off"],
    ["shared state", sharedState(status), status.degraded ? "bad" : ""],
  ]);
  const rows = status.workers.map((worker) => {
    const row = document.createElement("tr");
    row.dataset.role = worker.role;
    cell(row, worker.role);
    cell(row, worker.address);
    cell(row, worker.dtype ?? "–");
    cell(row, `${Math.round(worker.load).toLocaleString()} ${worker.load_unit}`);
    const held = worker.sequences === null ? "–" : String(Math.round(worker.sequences));
    cell(row, worker.max_sequences ? `${held} of ${worker.max_sequences}` : held);
    cell(row, prefillQueue(worker));
    const health = worker.healthy === null ? "not asked" : worker.healthy ? "healthy" : "not answering";
    cell(row, health, worker.healthy === false ? "bad" : worker.healthy ? "good" : "");
    return row;
  });
  $("workers").querySelector("tbody").replaceChildren(...rows);
  $("service-updated").textContent = `Updated ${new Date().toLocaleTimeString()}`;
}

export class ServiceView {
  constructor(onError) {
    this.onError = onError;
    this.timer = null;
  }

  async refresh() {
    try {
      drawStatus(await getJson("/status"));
    } catch (error) {
      this.onError(error);
    }
  }

  start() {
    if (this.timer !== null) return;
    this.refresh();
    this.timer = setInterval(() => {
      if (!document.hidden) this.refresh();
    }, PERIOD_MS);
  }

  stop() {
    clearInterval(this.timer);
    this.timer = null;
  }
}
