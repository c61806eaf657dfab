// The console: tabs, the API key, and each panel started once.

import * as api from "./api.js";
import { loadCatalog } from "./catalog.js";
import { ChatPanel } from "./chat.js";
import { startFleet } from "./fleet.js";
import { startMetrics } from "./metrics.js";

const $ = (selector) => document.querySelector(selector);

function refusalShower(id) {
  return (error) => {
    const p = $(id);
    p.textContent = `Refused: ${error.message}`;
    p.hidden = false;
  };
}

function clearRefusals() {
  for (const p of document.querySelectorAll(".refusal")) p.hidden = true;
}

for (const button of document.querySelectorAll("#tabs button")) {
  button.addEventListener("click", () => {
    for (const other of document.querySelectorAll("#tabs button, .panel")) {
      other.classList.remove("active");
    }
    button.classList.add("active");
    $(`#${button.dataset.tab}`).classList.add("active");
  });
}

const chat = new ChatPanel($("#chat"), api, refusalShower("#chat-refusal"));

async function refreshCatalog() {
  clearRefusals();
  const models = await loadCatalog($("#catalog"), api, (error) => {
    refusalShower("#catalog-refusal")(error);
    refusalShower("#chat-refusal")(error);
  });
  chat.setModels(models);
  document.body.dataset.catalog = models.length ? "loaded" : "refused";
}

$("#api-key").value = api.apiKey();
$("#key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  api.setApiKey($("#api-key").value.trim());
  refreshCatalog();
});

refreshCatalog();
startMetrics($("#metrics"), api.getText, () => {});
startFleet($("#fleet"));
