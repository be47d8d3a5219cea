// "Where the prompt went": the prompt as its tokens, one cell each, shaded by its depth (the layers
// it was computed at when the request ended), revived tokens outlined; beside it the live tokens
// per layer, at prefill and at the end. Everything drawn comes from the API's response
// (metrics.token_depths, metrics.revived_positions, metrics.kept_per_layer) and from /tokenize's
// token_strs for the same messages; nothing is computed here that the server did not say.

const SVG = "http://www.w3.org/2000/svg";

// Pale yellow (depth 0) through teal to deep blue (every layer), so that a token cut after layer 18
// and one that went through all 30 read apart at a glance. The legend's ramp (style.css) has the
// same three stops.
const STOPS = [
  [0, 55, 90, 88],
  [0.5, 170, 55, 52],
  [1, 230, 65, 28],
];

export function shade(depth, numLayers) {
  const share = numLayers > 0 ? Math.min(Math.max(depth / numLayers, 0), 1) : 1;
  const upper = STOPS.findIndex(([at]) => at >= share);
  const [a, b] = upper <= 0 ? [STOPS[0], STOPS[0]] : [STOPS[upper - 1], STOPS[upper]];
  const t = b[0] === a[0] ? 0 : (share - a[0]) / (b[0] - a[0]);
  const mix = (i) => Math.round(a[i] + (b[i] - a[i]) * t);
  return `hsl(${mix(1)}, ${mix(2)}%, ${mix(3)}%)`;
}

// A token as it should read in a cell: whitespace kept (the text flows as the prompt did), an
// empty token made visible.
function shown(text) {
  return text === "" ? "\u2205" : text;
}

function cells(container, strs, depths, revived, numLayers) {
  container.replaceChildren();
  const fragment = document.createDocumentFragment();
  depths.forEach((depth, index) => {
    const cell = document.createElement("span");
    cell.className = "cell";
    cell.textContent = shown(strs?.[index] ?? `[${index}]`);
    cell.dataset.index = String(index);
    cell.dataset.depth = String(depth);
    cell.style.background = shade(depth, numLayers);
    if (depth > numLayers * 0.55) cell.classList.add("dark"); // white text on the darker half
    const wasRevived = revived.has(index);
    if (wasRevived) {
      cell.classList.add("revived");
      cell.dataset.revived = "true";
    }
    cell.title = `token ${index}: computed at ${depth} of ${numLayers} layers${wasRevived ? ", revived during decode" : ""}`;
    fragment.append(cell);
  });
  container.append(fragment);
}

function element(name, attributes, text) {
  const node = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

// Horizontal bars, one row per layer (layer 0 at the top): the lighter bar is the tokens live at
// the end (prefill plus what decode revived), the darker one what prefill computed.
function layers(svg, depths, keptPerLayer, numLayers) {
  const live = Array.from({ length: numLayers }, (_, layer) => depths.filter((d) => d > layer).length);
  const prompt = depths.length;
  const row = 9, left = 46, width = 180, top = 18;
  const height = top + numLayers * row + 26;
  svg.replaceChildren();
  svg.setAttribute("viewBox", `0 0 ${left + width + 50} ${height}`);
  svg.setAttribute("width", left + width + 50);
  svg.setAttribute("height", height);
  const end = live[numLayers - 1] ?? 0;
  svg.append(element("title", { id: "layers-title" },
    `Live tokens per layer: ${prompt} at layer 0, ${end} at layer ${numLayers - 1}`));
  svg.append(element("text", { x: left, y: 11, class: "axis" }, "live tokens per layer"));
  for (let layer = 0; layer < numLayers; layer++) {
    const y = top + layer * row;
    const scale = (count) => (prompt ? (count / prompt) * width : 0);
    const group = element("g", { class: "layer", "data-layer": layer, "data-live": live[layer] });
    group.append(element("title", {}, `layer ${layer}: ${keptPerLayer[layer] ?? "?"} at prefill, ${live[layer]} at the end`));
    group.append(element("rect", { x: left, y, width: scale(live[layer]), height: row - 2, class: "end" }));
    group.append(element("rect", { x: left, y, width: scale(keptPerLayer[layer] ?? 0), height: row - 2, class: "prefill" }));
    if (layer % 5 === 0 || layer === numLayers - 1) {
      group.append(element("text", { x: left - 6, y: y + row - 2, class: "label", "text-anchor": "end" }, `L${layer}`));
      group.append(element("text", { x: left + width + 6, y: y + row - 2, class: "label" }, String(live[layer])));
    }
    svg.append(group);
  }
  const legendY = top + numLayers * row + 14;
  svg.append(element("rect", { x: left, y: legendY - 8, width: 10, height: 8, class: "prefill" }));
  svg.append(element("text", { x: left + 14, y: legendY, class: "label" }, "at prefill"));
  svg.append(element("rect", { x: left + 80, y: legendY - 8, width: 10, height: 8, class: "end" }));
  svg.append(element("text", { x: left + 94, y: legendY, class: "label" }, "at the end"));
}

// Draw the map for one answer. `tokens`: /tokenize's reply for the same messages (or null);
// `metrics`: the answer's metrics, with token_depths when they were asked.
export function drawMap(figure, tokens, metrics, numLayers, maxTokens) {
  const summary = figure.querySelector("#map-summary");
  if (!metrics?.token_depths) {
    // Over return_token_depths' limit: say so rather than show nothing.
    figure.querySelector("#map-tokens").replaceChildren();
    figure.querySelector("#map-layers").replaceChildren();
    summary.textContent = `This prompt has ${tokens?.count ?? "too many"} tokens; the map is drawn for prompts of up to ${maxTokens}.`;
    figure.hidden = false;
    return;
  }
  const depths = metrics.token_depths;
  const revived = new Set(metrics.revived_positions || []);
  const strs = tokens && tokens.count === depths.length ? tokens.token_strs : null;
  cells(figure.querySelector("#map-tokens"), strs, depths, revived, numLayers);
  layers(figure.querySelector("#map-layers"), depths, metrics.kept_per_layer || [], numLayers);
  const full = depths.filter((d) => d >= numLayers).length;
  const percent = (100 * (metrics.computed_fraction ?? 1)).toFixed(1);
  const cached = metrics.cached_tokens
    ? ` The first ${metrics.cached_tokens} tokens' early layers came from the prefix cache, not computed again.`
    : "";
  summary.textContent =
    `${depths.length} prompt tokens under pruning "${metrics.pruning}": ${full} went through all ` +
    `${numLayers} layers, ${revived.size} revived during decode; ${percent}% of the full model's token-layers computed.${cached}`;
  figure.hidden = false;
}
