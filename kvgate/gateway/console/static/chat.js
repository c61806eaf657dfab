// The chat playground: a conversation streamed from /v1/chat/completions, with an example
// tool the model may call and an optional JSON schema its answer must follow.

const EXAMPLE_TOOL = {
  type: "function",
  function: {
    name: "get_weather",
    description: "The current weather in a city",
    parameters: {
      type: "object",
      properties: { city: { type: "string" } },
      required: ["city"],
    },
  },
};

export class ChatPanel {
  constructor(panel, api, onRefusal) {
    this.panel = panel;
    this.api = api;
    this.onRefusal = onRefusal;
    this.messages = [];
    this.log = panel.querySelector("#chat-log");
    panel.querySelector("#chat-form").addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
    panel.querySelector("#chat-clear").addEventListener("click", () => {
      this.messages = [];
      this.log.replaceChildren();
    });
  }

  setModels(ids) {
    const select = this.panel.querySelector("#chat-model");
    select.replaceChildren(
      ...ids.map((id) => {
        const option = document.createElement("option");
        option.value = option.textContent = id;
        return option;
      }),
    );
  }

  bubble(role, text) {
    const div = document.createElement("div");
    div.className = `message ${role}`;
    div.dataset.role = role;
    div.textContent = text;
    this.log.appendChild(div);
    return div;
  }

  request() {
    const value = (id) => this.panel.querySelector(id).value;
    const body = {
      model: value("#chat-model"),
      messages: this.messages,
      max_tokens: Number(value("#chat-max-tokens")),
      temperature: Number(value("#chat-temperature")),
    };
    if (this.panel.querySelector("#chat-tools").checked) {
      body.tools = [EXAMPLE_TOOL];
      body.tool_choice = "auto";
    }
    const schema = value("#chat-schema").trim();
    if (schema) {
      body.response_format = {
        type: "json_schema",
        json_schema: { name: "answer", schema: JSON.parse(schema) },
      };
    }
    return body;
  }

  async send() {
    const input = this.panel.querySelector("#chat-input");
    const text = input.value.trim();
    if (!text) return;
    input.value = "";
    this.messages.push({ role: "user", content: text });
    this.bubble("user", text);
    const answer = this.bubble("assistant", "");
    answer.dataset.state = "streaming";
    const calls = [];
    let content = "";
    try {
      await this.api.streamChat(this.request(), (chunk) => {
        const delta = chunk.choices[0]?.delta ?? {};
        if (delta.content) content += delta.content;
        for (const call of delta.tool_calls ?? []) {
          calls[call.index] ??= { name: "", arguments: "" };
          calls[call.index].name += call.function?.name ?? "";
          calls[call.index].arguments += call.function?.arguments ?? "";
        }
        const called = calls.map((c) => `\n→ ${c.name}(${c.arguments})`).join("");
        answer.textContent = content + called;
      });
      this.messages.push({ role: "assistant", content });
      answer.dataset.state = "done";
    } catch (error) {
      answer.dataset.state = "failed";
      answer.remove();
      this.messages.pop();
      this.onRefusal(error);
    }
  }
}
