// Live charts of the server's own /metrics (vLLM's names), read every second: token rates
// from the counters, TTFT and ITL percentiles from the histograms' last 10 s, the gauges.

import { Chart } from "./chart.js";
import { buckets, difference, parse, quantile, total } from "./prometheus.js";

const WINDOW_S = 10;

function windowed(history, now, name, q) {
  const before = history.find((h) => now.time - h.time <= WINDOW_S * 1000) ?? history[0];
  if (!before || before === now) return null;
  return quantile(q, difference(buckets(now.samples, name), buckets(before.samples, name)));
}

function rate(now, before, name) {
  const a = total(now.samples, name);
  const b = total(before.samples, name);
  return a === null || b === null ? null : Math.max(0, (a - b) / ((now.time - before.time) / 1000));
}

export function startMetrics(panel, getText, onError) {
  const parent = panel.querySelector("#charts");
  const charts = {
    tokens: new Chart(parent, "tokens", "Tokens per second", "/s", ["generation", "prompt"]),
    ttft: new Chart(parent, "ttft", "Time to first token", " s", ["p50", "p99"]),
    itl: new Chart(parent, "itl", "Inter-token latency", " s", ["p50", "p99"]),
    requests: new Chart(parent, "requests", "Requests", "", ["running", "waiting", "tasks"]),
    kv: new Chart(parent, "kv", "KV cache usage", "%", ["usage"]),
    prefix: new Chart(parent, "prefix", "Prefix cache hit rate (10 s)", "%", ["hits"]),
  };
  const history = [];

  async function poll() {
    let now;
    try {
      now = { time: performance.now(), samples: parse(await getText("/metrics")) };
    } catch (error) {
      onError(error);
      return;
    }
    const before = history[history.length - 1];
    history.push(now);
    while (history.length && now.time - history[0].time > (WINDOW_S + 2) * 1000) history.shift();
    const s = now.samples;
    charts.tokens.push(
      before
        ? {
            generation: rate(now, before, "vllm:generation_tokens_total"),
            prompt: rate(now, before, "vllm:prompt_tokens_total"),
          }
        : {},
    );
    const latency = (name) => ({
      p50: windowed(history, now, name, 0.5),
      p99: windowed(history, now, name, 0.99),
    });
    charts.ttft.push(latency("vllm:time_to_first_token_seconds"));
    charts.itl.push(latency("vllm:inter_token_latency_seconds"));
    charts.requests.push({
      running: total(s, "vllm:num_requests_running"),
      waiting: total(s, "vllm:num_requests_waiting"),
      tasks: total(s, "kvgate_tasks_running"),
    });
    const usage = total(s, "vllm:kv_cache_usage_perc");
    charts.kv.push({ usage: usage === null ? null : usage * 100 });
    const first = history[0];
    const queries = (total(s, "vllm:prefix_cache_queries_total") ?? 0) -
      (total(first.samples, "vllm:prefix_cache_queries_total") ?? 0);
    const hits = (total(s, "vllm:prefix_cache_hits_total") ?? 0) -
      (total(first.samples, "vllm:prefix_cache_hits_total") ?? 0);
    charts.prefix.push({ hits: queries > 0 ? (100 * hits) / queries : null });
  }

  poll();
  return setInterval(poll, 1000);
}
