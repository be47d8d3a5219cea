// The two DOM helpers every view uses: an element by id, and a <dl> of figures.

export const $ = (id) => document.getElementById(id);

// Fill a <dl> with [term, value] pairs, each pair in a <div> (a <dl> may group them so).
export function figureList(list, entries) {
  list.replaceChildren();
  for (const [name, value] of entries) {
    const term = document.createElement("dt");
    term.textContent = name;
    const detail = document.createElement("dd");
    detail.textContent = value;
    const pair = document.createElement("div");
    pair.append(term, detail);
    list.append(pair);
  }
}
