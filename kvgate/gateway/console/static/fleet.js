// The fleet's upstreams as /readyz reports them (health, breaker state, load, the last
// scraped figures), read every second. An embedded engine shows its replicas instead.

function cell(text) {
  const td = document.createElement("td");
  td.textContent = text;
  return td;
}

function percent(value) {
  return value === null || value === undefined ? "–" : `${(value * 100).toFixed(1)}%`;
}

function show(panel, readiness) {
  const summary = panel.querySelector("#fleet-summary");
  const body = panel.querySelector("#fleet-upstreams tbody");
  const upstreams = readiness.upstreams;
  if (!upstreams) {
    const replicas = readiness.replicas ?? [];
    summary.textContent = `Embedded engine: ${replicas.filter(Boolean).length} of ${replicas.length} replica(s) stepping; ready: ${readiness.ready}.`;
    body.replaceChildren();
    return;
  }
  const up = upstreams.filter((u) => u.state === "healthy").length;
  summary.textContent = `Fleet: ${up} of ${upstreams.length} upstream(s) taking calls; ready: ${readiness.ready}.`;
  body.replaceChildren(
    ...upstreams.map((u) => {
      const row = document.createElement("tr");
      row.dataset.url = u.url;
      row.dataset.state = u.state;
      row.className = u.state === "healthy" ? "up" : "down";
      const scraped = u.scraped ?? {};
      row.append(
        cell(u.index),
        cell(u.url),
        cell(u.state === "healthy" ? "up" : `down (${u.state})`),
        cell(u.in_flight),
        cell(scraped.running ?? "–"),
        cell(scraped.waiting ?? "–"),
        cell(percent(scraped.kv_usage)),
        cell(u.last_error ?? ""),
      );
      return row;
    }),
  );
}

export function startFleet(panel) {
  async function poll() {
    try {
      // 503 while nothing can serve: the body still says why
      const response = await fetch("/readyz");
      show(panel, await response.json());
    } catch (error) {
      panel.querySelector("#fleet-summary").textContent = `/readyz did not answer: ${error.message}`;
    }
  }
  poll();
  return setInterval(poll, 1000);
}
