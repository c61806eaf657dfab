// The Prometheus text format, read in the page: samples by name, sums over label sets,
// histogram buckets and Prometheus's histogram_quantile (linear within a bucket).

const SAMPLE = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
const LABEL = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;

// name -> [{labels, value}]
export function parse(text) {
  const samples = new Map();
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = SAMPLE.exec(line);
    if (!match) continue;
    const labels = {};
    for (const [, key, value] of (match[2] ?? "").matchAll(LABEL)) labels[key] = value;
    const list = samples.get(match[1]) ?? [];
    list.push({ labels, value: Number(match[3]) });
    samples.set(match[1], list);
  }
  return samples;
}

// The sum of a family's samples (every model, every label set); null when it is absent.
export function total(samples, name) {
  const list = samples.get(name);
  return list ? list.reduce((sum, s) => sum + s.value, 0) : null;
}

// A histogram's cumulative buckets summed over label sets: [{le, count}] by le.
export function buckets(samples, name) {
  const byBound = new Map();
  for (const { labels, value } of samples.get(`${name}_bucket`) ?? []) {
    const le = labels.le === "+Inf" ? Infinity : Number(labels.le);
    byBound.set(le, (byBound.get(le) ?? 0) + value);
  }
  return [...byBound].map(([le, count]) => ({ le, count })).sort((a, b) => a.le - b.le);
}

// What was observed between two readings of the same histogram.
export function difference(now, before) {
  const old = new Map(before.map((b) => [b.le, b.count]));
  return now.map((b) => ({ le: b.le, count: b.count - (old.get(b.le) ?? 0) }));
}

// histogram_quantile(q, ...): null when nothing was observed.
export function quantile(q, cumulative) {
  const count = cumulative.length ? cumulative[cumulative.length - 1].count : 0;
  if (count <= 0) return null;
  const rank = q * count;
  let lower = 0;
  let below = 0;
  for (const { le, count: atMost } of cumulative) {
    if (atMost >= rank) {
      if (le === Infinity) return lower;
      if (atMost === below) return le;
      return lower + ((le - lower) * (rank - below)) / (atMost - below);
    }
    lower = le;
    below = atMost;
  }
  return lower;
}
