// A small line chart drawn as inline SVG. Its numbers stay readable in the DOM: the
// element's data-series attribute holds every series' points (null where there was none).

const SVG = "http://www.w3.org/2000/svg";
const WIDTH = 300;
const HEIGHT = 100;
const KEEP = 60;
const COLOURS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea"];

export class Chart {
  constructor(parent, id, title, unit, names) {
    this.names = names;
    this.unit = unit;
    this.series = Object.fromEntries(names.map((name) => [name, []]));
    this.element = document.createElement("figure");
    this.element.className = "chart";
    this.element.dataset.chart = id;
    const caption = document.createElement("figcaption");
    caption.textContent = title;
    this.legend = document.createElement("div");
    this.legend.className = "legend";
    this.svg = document.createElementNS(SVG, "svg");
    this.svg.setAttribute("viewBox", `0 0 ${WIDTH} ${HEIGHT}`);
    this.lines = names.map((name, i) => {
      const line = document.createElementNS(SVG, "polyline");
      line.setAttribute("stroke", COLOURS[i % COLOURS.length]);
      line.setAttribute("fill", "none");
      line.setAttribute("stroke-width", "1.5");
      this.svg.appendChild(line);
      return line;
    });
    this.element.append(caption, this.svg, this.legend);
    parent.appendChild(this.element);
  }

  // values: {series name: number or null}
  push(values) {
    for (const name of this.names) {
      const points = this.series[name];
      points.push(values[name] ?? null);
      if (points.length > KEEP) points.shift();
    }
    this.render();
  }

  render() {
    const all = this.names.flatMap((name) => this.series[name]).filter((v) => v !== null);
    const top = Math.max(1e-9, ...all) * 1.1;
    this.names.forEach((name, i) => {
      const points = this.series[name];
      const xy = points
        .map((v, j) => (v === null ? null : `${(j / (KEEP - 1)) * WIDTH},${HEIGHT - (v / top) * HEIGHT}`))
        .filter((p) => p !== null);
      this.lines[i].setAttribute("points", xy.join(" "));
    });
    this.legend.replaceChildren(
      ...this.names.map((name, i) => {
        const item = document.createElement("span");
        const last = this.series[name][this.series[name].length - 1];
        item.style.color = COLOURS[i % COLOURS.length];
        item.textContent = `${name}: ${last === null ? "–" : format(last)}${this.unit}`;
        return item;
      }),
    );
    this.element.dataset.series = JSON.stringify(this.series);
  }
}

function format(value) {
  if (value === 0) return "0";
  if (Math.abs(value) >= 100) return value.toFixed(0);
  if (Math.abs(value) >= 1) return value.toFixed(2);
  return value.toPrecision(2);
}
