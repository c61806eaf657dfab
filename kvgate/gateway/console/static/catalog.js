// What is served: /v1/models (the model and its LoRA adapters) and the MCP tools (tools/list).

function row(...texts) {
  const tr = document.createElement("tr");
  for (const text of texts) {
    const td = document.createElement("td");
    td.textContent = text ?? "";
    tr.appendChild(td);
  }
  return tr;
}

export async function loadCatalog(panel, api, onRefusal) {
  const models = panel.querySelector("#catalog-models tbody");
  const tools = panel.querySelector("#catalog-tools tbody");
  models.replaceChildren();
  tools.replaceChildren();
  let listed;
  try {
    listed = await api.getJSON("/v1/models");
    models.replaceChildren(
      ...listed.data.map((m) => row(m.id, m.parent ?? "(base model)", m.max_model_len)),
    );
    const result = await api.mcp("tools/list");
    tools.replaceChildren(...result.tools.map((t) => row(t.name, t.description)));
  } catch (error) {
    onRefusal(error);
    return [];
  }
  return listed.data.map((m) => m.id);
}
