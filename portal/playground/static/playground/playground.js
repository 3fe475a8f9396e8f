// The playground page: posts the chat to the portal (session + CSRF token, no API key) and reads the
// gateway's answer: an SSE stream of chat chunks, or an OpenAI-shaped error shown as its message.
"use strict";

(function () {
  const root = document.getElementById("playground");
  if (!root) return;
  const $ = (id) => document.getElementById(id);
  const log = $("pg-log"), input = $("pg-input"), errorBox = $("pg-error"), usageBox = $("pg-usage");
  const send = $("pg-send"), stop = $("pg-stop");
  const csrf = root.querySelector("input[name=csrfmiddlewaretoken]").value;
  const maxMessages = parseInt(root.dataset.maxMessages, 10);
  let history = [];  // [{role, content}] of finished turns
  let controller = null;

  function settings() {
    return {
      model: $("pg-model").value,
      max_tokens: Number($("pg-max-tokens").value),
      temperature: Number($("pg-temperature").value),
      system: $("pg-system").value,
    };
  }

  function addMessage(role, text) {
    const box = document.createElement("div");
    box.className = "pg-msg " + role;
    const label = document.createElement("span");
    label.className = "pg-role";
    label.textContent = role;
    const body = document.createElement("span");
    body.className = "pg-text";
    body.textContent = text;
    box.append(label, body);
    log.append(box);
    return box;
  }

  function showError(message) {
    errorBox.textContent = message;
    errorBox.hidden = false;
  }

  // The gateway's error body is {"error": {"message", "type", "code"}}: its message is written for
  // people, so it is shown alone (codes are for programs). Anything else (a proxy's page) is told
  // in words by its status, never as a broken page.
  async function errorOf(response) {
    try {
      const data = await response.json();
      if (data && data.error && data.error.message) return sentence(data.error.message);
    } catch (e) { /* not JSON */ }
    if (response.status === 429) return "Too many requests for now: wait a moment and send again.";
    if (response.status >= 500) return "The portal could not answer just now: try again in a moment.";
    return "The portal refused the request: reload the page and try again.";
  }

  function sentence(text) {
    text = String(text).trim();
    return /[.!?]$/.test(text) ? text : text + ".";
  }

  // The max_tokens input follows the model picked: the team's clamp within the model's context.
  function boundMaxTokens() {
    const option = $("pg-model").selectedOptions[0];
    if (!option) return;
    const most = parseInt(option.dataset.maxTokens, 10);
    const field = $("pg-max-tokens");
    field.max = String(most);
    if (Number(field.value) > most) field.value = String(most);
    $("pg-max-tokens-hint").textContent = "1 to " + most
      + (option.dataset.contextBound === "1" ? ", less the prompt (the model's context)" : " (the team's clamp)");
  }

  async function chat(event) {
    event.preventDefault();
    const text = input.value;
    if (!text.trim() || controller) return;
    if (history.length + 1 > maxMessages) {
      showError("At most " + maxMessages + " messages: clear the chat to go on.");
      return;
    }
    errorBox.hidden = true;
    usageBox.textContent = "";
    const s = settings();
    const messages = history.concat([{ role: "user", content: text }]);
    addMessage("user", text);
    const reply = addMessage("assistant", "");
    reply.classList.add("streaming");
    const replyText = reply.querySelector(".pg-text");
    input.value = "";
    controller = new AbortController();
    send.disabled = true;
    stop.hidden = false;
    let answer = "", failed = null;
    try {
      const response = await fetch(root.dataset.chatUrl, {
        method: "POST",
        headers: { "Content-Type": "application/json", "X-CSRFToken": csrf, "Accept": "text/event-stream" },
        body: JSON.stringify({ ...s, messages }),
        credentials: "same-origin",
        signal: controller.signal,
      });
      const type = response.headers.get("content-type") || "";
      if (response.redirected) {  // to the login page: the session ended
        failed = "You are signed out: reload the page and sign in again.";
      } else if (!response.ok || !type.startsWith("text/event-stream")) {
        failed = await errorOf(response);
      } else {
        failed = await readStream(response, (piece) => { answer += piece; replyText.textContent = answer; });
      }
    } catch (e) {
      failed = e.name === "AbortError" ? "Stopped." : "The connection to the portal failed: " + e.message;
    } finally {
      reply.classList.remove("streaming");
      controller = null;
      send.disabled = false;
      stop.hidden = true;
    }
    if (failed) {
      showError(failed);
      if (!answer) { reply.remove(); input.value = text; log.lastElementChild.remove(); return; }
    }
    history = messages.concat([{ role: "assistant", content: answer }]);
    renderCode();
  }

  // Reads `data: {...}` events until `[DONE]`; returns an error message, or null.
  async function readStream(response, onText) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      buffer += decoder.decode(value || new Uint8Array(), { stream: !done });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") return null;
          let chunk;
          try { chunk = JSON.parse(data); } catch (e) { continue; }
          if (chunk.error) return sentence(chunk.error.message || "The answer stopped with an error.");
          if (chunk.usage) {
            usageBox.textContent = chunk.usage.prompt_tokens + " prompt + " + chunk.usage.completion_tokens
              + " completion tokens";
          }
          for (const choice of chunk.choices || []) {
            if (choice.delta && choice.delta.content) onText(choice.delta.content);
          }
        }
      }
      if (done) return buffer.trim() ? "The stream ended mid-event." : null;
    }
  }

  // --- copy as code -------------------------------------------------------------------------------
  function requestBody() {
    const s = settings();
    const messages = (s.system.trim() ? [{ role: "system", content: s.system }] : []).concat(history);
    if (input.value.trim()) messages.push({ role: "user", content: input.value });
    if (!messages.some((m) => m.role === "user")) messages.push({ role: "user", content: "Hello!" });
    return { model: s.model, messages, max_tokens: s.max_tokens, temperature: s.temperature, stream: true };
  }

  function indent(text, spaces) {
    return text.split("\n").join("\n" + " ".repeat(spaces));
  }

  function renderCode() {
    const body = requestBody();
    const base = root.dataset.gatewayUrl;
    const json = JSON.stringify(body, null, 2).replaceAll("'", "'\\''");  // inside a '...' shell string
    $("pg-code-curl").textContent =
      "curl -N " + base + "/chat/completions \\\n" +
      "  -H \"Authorization: Bearer YOUR_API_KEY\" \\\n" +
      "  -H \"Content-Type: application/json\" \\\n" +
      "  -d '" + json + "'";
    // JSON of strings, lists and objects is a valid Python literal.
    $("pg-code-python").textContent =
      "from openai import OpenAI\n\n" +
      "client = OpenAI(base_url=\"" + base + "\", api_key=\"YOUR_API_KEY\")\n" +
      "stream = client.chat.completions.create(\n" +
      "    model=" + JSON.stringify(body.model) + ",\n" +
      "    messages=" + indent(JSON.stringify(body.messages, null, 4), 4) + ",\n" +
      "    max_tokens=" + body.max_tokens + ",\n" +
      "    temperature=" + body.temperature + ",\n" +
      "    stream=True,\n" +
      ")\n" +
      "for chunk in stream:\n" +
      "    if chunk.choices:\n" +
      "        print(chunk.choices[0].delta.content or \"\", end=\"\", flush=True)\n" +
      "print()\n";
  }

  async function copy(text, button) {
    try {
      await navigator.clipboard.writeText(text);
    } catch (e) {  // no clipboard API (plain http on another host): copy through a selection
      const area = document.createElement("textarea");
      area.value = text;
      document.body.append(area);
      area.select();
      document.execCommand("copy");
      area.remove();
    }
    const label = button.textContent;
    button.textContent = "Copied";
    setTimeout(() => { button.textContent = label; }, 1500);
  }

  $("pg-compose").addEventListener("submit", chat);
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) $("pg-compose").requestSubmit();
  });
  stop.addEventListener("click", () => controller && controller.abort());
  $("pg-clear").addEventListener("click", () => {
    if (controller) controller.abort();
    history = [];
    log.replaceChildren();
    errorBox.hidden = true;
    usageBox.textContent = "";
    renderCode();
  });
  $("pg-code-toggle").addEventListener("click", (e) => {
    const code = $("pg-code");
    code.hidden = !code.hidden;
    e.target.setAttribute("aria-expanded", String(!code.hidden));
    renderCode();
  });
  for (const button of root.querySelectorAll(".pg-copy")) {
    button.addEventListener("click", () => copy($(button.dataset.target).textContent, button));
  }
  $("pg-model").addEventListener("change", boundMaxTokens);
  boundMaxTokens();
  for (const id of ["pg-model", "pg-max-tokens", "pg-temperature", "pg-system", "pg-input"]) {
    $(id).addEventListener("input", renderCode);
  }
  renderCode();
})();
