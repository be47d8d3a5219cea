// The two DOM helpers every view uses: an element by id, and a <dl> of figures.

export const $ = (id) => document.getElementById(id);

// Fill a <dl> with [term, value, class?] entries, each pair in a <div> (a <dl> may group them so);
// the class, if any, is the value's (bad: a figure to act on).
export function figureList(list, entries) {
  list.replaceChildren();
  for (const [name, value, className] of entries) {
    const term = document.createElement("dt");
    term.textContent = name;
    const detail = document.createElement("dd");
    detail.textContent = value;
    if (className) detail.className = className;
    const pair = document.createElement("div");
    pair.append(term, detail);
    list.append(pair);
  }
}
