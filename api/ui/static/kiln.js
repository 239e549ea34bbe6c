// Kiln dashboard: the theme override, the submit form (plan preview, upload with progress) and the tune form.
// Everything else is server-rendered HTML swapped by htmx.
"use strict";

(function theme() {
  const select = document.querySelector("[data-theme-select]");
  if (!select) return;
  select.value = localStorage.getItem("kiln-theme") || "";
  select.addEventListener("change", () => {
    if (select.value) {
      localStorage.setItem("kiln-theme", select.value);
      document.documentElement.dataset.theme = select.value;
    } else {
      localStorage.removeItem("kiln-theme");
      delete document.documentElement.dataset.theme;
    }
  });
})();

// An error card (code, message, hint) in `box`, the same for every form.
function kilnShowError(box, body) {
  box.replaceChildren();
  const card = document.createElement("div");
  card.className = "card error-card";
  card.dataset.testid = "form-error";
  const line = document.createElement("p");
  line.textContent = (body.code ? body.code + ": " : "") + (body.message || "failed");
  card.append(line);
  if (body.hint) { const hint = document.createElement("p"); hint.className = "hint"; hint.textContent = body.hint; card.append(hint); }
  box.append(card);
}

// POSTs `data` (multipart) to `url` with upload progress; on 202 (or 200: an idempotent repeat)
// goes to the job's page, else shows the API's error in `errorBox`. XMLHttpRequest, not fetch:
// only it reports upload progress.
function kilnUpload(url, data, csrf, progress, button, errorBox) {
  const xhr = new XMLHttpRequest();
  xhr.open("POST", url);
  xhr.setRequestHeader("X-CSRF-Token", csrf);
  progress.hidden = false; progress.value = 0; button.disabled = true;
  xhr.upload.onprogress = (e) => { if (e.lengthComputable) progress.value = Math.round(100 * e.loaded / e.total); };
  xhr.onload = () => {
    let body = {};
    try { body = JSON.parse(xhr.responseText); } catch (e) { /* not JSON: shown as status below */ }
    if (xhr.status === 202 || xhr.status === 200) { progress.value = 100; window.location.assign("/ui/jobs/" + body.id); return; }
    button.disabled = false;
    kilnShowError(errorBox, body.code ? body : { code: "HTTP " + xhr.status, message: xhr.statusText });
  };
  xhr.onerror = () => { button.disabled = false; kilnShowError(errorBox, { code: "NETWORK", message: "the upload did not reach the server" }); };
  xhr.send(data);
}

(function submitForm() {
  const form = document.getElementById("submit-form");
  if (!form) return;
  const csrf = form.dataset.csrf || "";
  const preview = document.getElementById("plan-preview");
  const errorBox = document.getElementById("submit-error");
  const progress = document.getElementById("upload-progress");
  const button = document.getElementById("submit-button");
  const modelInput = document.getElementById("model");
  // [ending, format], longest ending first, from the format descriptors (services/descriptors).
  const EXT = JSON.parse(form.dataset.extensions || "[]");

  function setPath(obj, path, value) {
    const keys = path.split(".");
    let o = obj;
    keys.slice(0, -1).forEach((k) => { o = o[k] = o[k] || {}; });
    o[keys[keys.length - 1]] = value;
  }
  function merge(a, b) {
    for (const [k, v] of Object.entries(b)) {
      a[k] = v && typeof v === "object" && !Array.isArray(v) && a[k] && typeof a[k] === "object" ? merge(a[k], v) : v;
    }
    return a;
  }
  function el(tag, text, cls) { const e = document.createElement(tag); if (text) e.textContent = text; if (cls) e.className = cls; return e; }

  // Returns the spec the fields describe; throws with a message on unreadable JSON.
  function buildSpec() {
    const spec = {};
    const arrays = {};
    form.querySelectorAll("[data-spec]").forEach((input) => {
      const path = input.dataset.spec, kind = input.dataset.kind || "";
      if (kind === "array") { (arrays[path] = arrays[path] || []); if (input.checked) arrays[path].push(input.value); return; }
      if (kind === "boolean") { if (input.checked !== input.defaultChecked) setPath(spec, path, input.checked); return; }
      const raw = input.value.trim();
      if (!raw) return;
      // A choice left at its default inside a section (evaluation.metric) is not a request for
      // the section: sent alone, it would make the section and ask for its required fields.
      if (input.tagName === "SELECT" && path.includes(".") && input.selectedOptions[0] && input.selectedOptions[0].defaultSelected) return;
      if (kind === "json") {
        try { setPath(spec, path, JSON.parse(raw)); } catch (e) { throw new Error(path + " is not JSON: " + e.message); }
      } else if (kind === "integer" || kind === "number") { setPath(spec, path, Number(raw)); }
      else { setPath(spec, path, raw); }
    });
    // An empty choice inside an optional section (notify.events) leaves the section out.
    for (const [path, values] of Object.entries(arrays)) if (values.length || !path.includes(".")) setPath(spec, path, values);
    const advanced = document.getElementById("advanced").value.trim();
    if (advanced) {
      try { merge(spec, JSON.parse(advanced)); } catch (e) { throw new Error("advanced spec is not JSON: " + e.message); }
    }
    const calibration = document.getElementById("calibration");
    if (calibration && calibration.files.length) spec.calibration = calibration.files[0].name;
    const evaluation = document.getElementById("evaluation");
    if (evaluation && evaluation.files.length) setPath(spec, "evaluation.data", evaluation.files[0].name);
    return spec;
  }
  function guessFormat(spec) {
    if (spec.source_format) return spec.source_format;
    const file = modelInput.files[0];
    if (!file) return null;
    const name = file.name.toLowerCase();
    const hit = EXT.find(([ext]) => name.endsWith(ext));
    return hit ? hit[1] : null;
  }
  const showError = kilnShowError;

  let timer = null, seq = 0;
  async function refreshPlan() {
    let spec;
    try { spec = buildSpec(); } catch (e) { showError(preview, { code: "INVALID_SPEC", message: e.message }); return; }
    const format = guessFormat(spec);
    if (!format) { preview.textContent = modelInput.files.length ? "Set source_format under More options to preview the plan." : "Choose a model file to preview the plan."; return; }
    const mine = ++seq;
    const resp = await fetch("/plan", {
      method: "POST", credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf },
      body: JSON.stringify({ source_format: format, spec: spec }),
    });
    const body = await resp.json().catch(() => ({}));
    if (mine !== seq) return;
    if (!resp.ok) { showError(preview, body); return; }
    preview.replaceChildren();
    const list = el("ul");
    for (const [target, route] of Object.entries(body.routes)) list.append(el("li", target + ": " + route));
    preview.append(el("p", body.steps.length + " steps on " + body.queues.join(", ") + " (source " + body.source_format + ")"), list);
    if (body.engines_without_workers.length) {
      const warn = el("p", "⚠ No live worker for " + body.engines_without_workers.join(", ") + ": Kiln refuses such a job unless \"wait for workers\" is set; then those steps wait (up to KILN_WORKER_WAIT_SECONDS) for one.", "waiting");
      warn.dataset.testid = "no-worker-warning";
      preview.append(warn);
    }
  }
  form.addEventListener("input", () => { clearTimeout(timer); timer = setTimeout(refreshPlan, 250); });
  form.addEventListener("change", () => { clearTimeout(timer); timer = setTimeout(refreshPlan, 50); });

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    errorBox.replaceChildren();
    if (!modelInput.files.length) { showError(errorBox, { code: "SOURCE_UNREADABLE", message: "choose a model file" }); modelInput.focus(); return; }
    let spec;
    try { spec = buildSpec(); } catch (e) { showError(errorBox, { code: "INVALID_SPEC", message: e.message }); return; }
    const data = new FormData();
    data.append("model", modelInput.files[0]);
    data.append("spec", JSON.stringify(spec));
    const calibration = document.getElementById("calibration");
    if (calibration && calibration.files.length) data.append("calibration", calibration.files[0]);
    const evaluation = document.getElementById("evaluation");
    if (evaluation && evaluation.files.length) data.append("evaluation", evaluation.files[0]);
    kilnUpload("/compile", data, csrf, progress, button, errorBox);
  });
})();

(function tuneForm() {
  const form = document.getElementById("tune-form");
  if (!form) return;
  const csrf = form.dataset.csrf || "";
  const errorBox = document.getElementById("tune-error");
  const progress = document.getElementById("upload-progress");
  const button = document.getElementById("tune-button");
  const modelInput = document.getElementById("model");
  const value = (id) => document.getElementById(id).value.trim();
  const checked = (name) => Array.from(form.querySelectorAll("input[name=" + name + "]:checked")).map((i) => i.value);

  const showError = (body) => kilnShowError(errorBox, body);
  // Returns the `tune` part; throws with a message the user can act on.
  function buildTune() {
    const tune = { objective: value("objective"), targets: checked("target"), precisions: checked("precision") };
    if (!tune.targets.length) throw new Error("choose at least one target");
    if (!tune.precisions.length) throw new Error("choose at least one precision");
    const batch = value("batch").split(",").map((s) => s.trim()).filter(Boolean).map(Number);
    if (!batch.length || batch.some((b) => !Number.isInteger(b) || b < 1)) throw new Error("batch sizes are whole numbers of 1 or more, e.g. 1 or 1,8");
    tune.batch = batch;
    for (const [id, key] of [["max-p99", "max_p99_ms"], ["budget", "budget_s"], ["rounds", "rounds"]]) if (value(id)) tune[key] = Number(value(id));
    return tune;
  }
  function buildSpec() {
    const raw = value("spec");
    let spec = {};
    if (raw) { try { spec = JSON.parse(raw); } catch (e) { throw new Error("compile settings are not JSON: " + e.message); } }
    if (value("name")) spec.name = value("name");
    const calibration = document.getElementById("calibration");
    if (calibration.files.length) spec.calibration = calibration.files[0].name;
    return spec;
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    errorBox.replaceChildren();
    if (!modelInput.files.length) { showError({ code: "SOURCE_UNREADABLE", message: "choose a model file" }); modelInput.focus(); return; }
    let tune, spec;
    try { tune = buildTune(); spec = buildSpec(); } catch (e) { showError({ code: "INVALID_SPEC", message: e.message }); return; }
    const data = new FormData();
    data.append("model", modelInput.files[0]);
    data.append("tune", JSON.stringify(tune));
    data.append("spec", JSON.stringify(spec));
    const calibration = document.getElementById("calibration");
    if (calibration.files.length) data.append("calibration", calibration.files[0]);
    kilnUpload("/tune", data, csrf, progress, button, errorBox);
  });
})();
