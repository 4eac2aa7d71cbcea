// The status page's script. A file, never inline: the page's Content-Security-Policy runs scripts from 'self' only
// (apps/server/page.py). Classic script, not a module: the tests call keptColour() and read window.paintedKept.
const $ = (id) => document.getElementById(id);
// One colour scale for the overlay and its legend: evicted (v = 0) -> kept (v = 1).
const EVICTED = [28, 36, 110], KEPT = [255, 214, 64], ALPHA = 110;
function keptColour(v) {
  const t = Math.max(0, Math.min(1, v));
  return [...EVICTED.map((c, i) => Math.round(c + (KEPT[i] - c) * t)), ALPHA];
}
function paint(canvas, cols, rows, valueAt) {
  canvas.width = cols; canvas.height = rows;
  const ctx = canvas.getContext("2d"), img = ctx.createImageData(cols, rows);
  for (let y = 0; y < rows; y++) {
    for (let x = 0; x < cols; x++) img.data.set(keptColour(valueAt(x, y)), 4 * (y * cols + x));
  }
  ctx.putImageData(img, 0, 0);
}
paint($("legend"), 64, 1, (x) => x / 63);
$("overlay").addEventListener("change", () => { $("heat").hidden = !$("overlay").checked; });

function fmt(x, digits = 1, unit = "") {
  return (x === null || x === undefined || Number.isNaN(x)) ? "—" : Number(x).toFixed(digits) + unit;
}
function spanText(seconds) {
  if (seconds < 120) return Math.round(seconds) + " s";
  if (seconds < 7200) return Math.round(seconds / 60) + " min";
  return (seconds / 3600).toFixed(1) + " h";
}
function reachRows(r) {  // how far back the memory goes (Daemon.reach): the cache, the archive, the pictures on disk
  if (!r || r.newest_t === null || r.newest_t === undefined) return [];
  return [["cache", "memory in the cache"], ["archive", "archive on flash"], ["frames", "pictures on disk"]]
    .filter(([key]) => r[key + "_t"] !== null && r[key + "_t"] !== undefined)
    .map(([key, name]) => [name + " reaches back",
      (r[key + "_unix"] ? "to " + new Date(r[key + "_unix"] * 1000).toLocaleTimeString() + ", " : "") +
      spanText(Math.max(0, r.newest_t - r[key + "_t"]))]);
}
function setFigures(rows) {
  const table = $("figures");
  table.replaceChildren(...rows.map(([name, value]) => {
    const tr = document.createElement("tr"), a = document.createElement("td"), b = document.createElement("td");
    a.textContent = name; b.textContent = value; b.className = "v"; tr.append(a, b); return tr;
  }));
}
const STATE_TEXT = {starting: "starting", running: "live", reconnecting: "reconnecting", paused: "paused (privacy)",
                    ended: "stream ended", stalled: "stalled", stopping: "daemon stopping",
                    unreachable: "daemon stopped"};
function showState(state, detail, problems) {
  $("state").dataset.state = state;
  document.body.dataset.state = state;
  $("state").textContent = STATE_TEXT[state] || state;
  const banner = $("banner");
  const text = (state === "running" && problems && problems.length) ? problems.join(" · ") : {
    ended: "The stream has ended" + (detail ? " (" + detail + ")" : "") +
           ". No new frames are ingested; questions are answered about what was seen.",
    reconnecting: (problems && problems.length ? problems.join(" · ")  // "not reached yet" at start, or "lost"
                   : "The camera stopped delivering frames; reconnecting") +
                  (detail ? " (" + detail + ")" : "") + "…",
    paused: "Paused by the privacy switch: the camera is released and nothing is seen until it is resumed; " +
            "questions are answered about what was seen before.",
    stalled: "No frame has gone into the memory for a while (video.stall_s); the daemon log says why.",
    stopping: "The daemon is shutting down; new questions are refused.",
    unreachable: "The daemon is not answering: it has stopped (or restarts). The page reconnects by itself.",
  }[state];
  banner.textContent = text || "";
  banner.classList.toggle("show", Boolean(text));
  $("send").disabled = state === "stopping" || state === "unreachable";
}
function drawMemory(series) {
  const values = series.rss_mb.filter((v) => v !== null && v !== undefined);
  const line = $("memory").querySelector("polyline");
  if (values.length < 2) { line.setAttribute("points", ""); return; }
  const lo = Math.min(...values), hi = Math.max(...values), span = Math.max(hi - lo, 1);
  line.setAttribute("points", values.map((v, i) =>
    `${(300 * i / (values.length - 1)).toFixed(1)},${(47 - 44 * (v - lo) / span).toFixed(1)}`).join(" "));
  const minutes = (series.ago_s[0] / 60).toFixed(1);
  $("memory-label").textContent = `process memory, last ${minutes} min: ${lo.toFixed(0)}–${hi.toFixed(0)} MiB ` +
    `(now ${values[values.length - 1].toFixed(0)} MiB)`;
}
function showQuestions(items) {
  $("questions").replaceChildren(...items.map((item) => {
    const li = document.createElement("li"), src = document.createElement("span"), q = document.createElement("span");
    src.className = "src"; src.textContent = item.source || "?";
    q.className = "q"; q.textContent = item.question;
    const a = document.createElement("div");
    if (item.error) { a.className = "err"; a.textContent = "refused: " + item.error; }
    else { a.className = "a"; a.textContent = item.answer || "(empty answer)"; }
    const meta = document.createElement("div"); meta.className = "meta";
    if (!item.error) meta.textContent = `${item.tokens} tokens · TTFT ${fmt(item.ttft_s * 1000, 0, " ms")} · ` +
      `${fmt(item.decode_tok_s, 1, " tok/s")}`;
    li.append(src, q, a, meta); return li;
  }));
  $("questions").dataset.count = String(items.length);
}
function showEvidence(item) {  // when the answer's evidence was seen, and its frame while the daemon keeps it
  const box = $("evidence");
  if (!item) { box.replaceChildren(); return; }
  const line = document.createElement("div");
  const when = item.unix != null ? "seen " + new Date(item.unix * 1000).toLocaleString() + " · " : "";
  const t = item.t != null ? `stream ${item.t.toFixed(1)} s` : "stream time unknown";
  line.textContent = `evidence: ${when}${t} (frame pair ${item.pair})` +
    (item.frame ? "" : "; its frame is no longer kept");
  const parts = [line];
  if (item.frame) {
    const img = document.createElement("img");
    img.src = item.frame; img.alt = "the frame the answer attended most";
    parts.push(img);
  }
  box.replaceChildren(...parts);
}
function showCameras(cameras) {  // video.sources: a picker for the picture and the questions, a row per camera
  const pick = $("camera");
  if (pick.hidden) {
    for (const name of Object.keys(cameras)) {
      const o = document.createElement("option");
      o.value = o.textContent = name;
      pick.append(o);
    }
    pick.hidden = false;
  }
  const rows = Object.entries(cameras).map(([name, c]) =>
    [`camera ${name}`, `${STATE_TEXT[c.stream_state] || c.stream_state} · ${c.frames ?? "—"} frames · ` +
                       `${c.cache_tokens ?? "—"} / ${c.cache_capacity_tokens ?? "—"} tokens`]);
  for (const [name, value] of rows) {
    const tr = document.createElement("tr"), a = document.createElement("td"), b = document.createElement("td");
    a.textContent = name; b.textContent = value; b.className = "v"; tr.append(a, b); $("figures").append(tr);
  }
}
let failures = 0;
async function refresh() {
  let s;
  try {
    const r = await fetch("/v1/edgekv/status", {credentials: "same-origin"});
    if (r.status === 401) { location.reload(); return; }
    if (!r.ok) throw new Error("HTTP " + r.status);
    s = await r.json();
  } catch (e) {
    if (++failures >= 3) showState("unreachable");
    return;
  }
  failures = 0;
  $("logout").hidden = !s.auth;
  showState(s.daemon.stream_state, s.daemon.stream_detail, s.daemon.problems);
  const st = s.stats, m = s.monitor || {}, rates = s.rates;
  if (st) setFigures([
    ["frames (pairs)", `${st.frames} (${st.frame_pairs})`],
    ["ingest rate", fmt(rates.ingest_fps, 2, " fps")],
    ["last pair ingest", fmt(st.ingest_ms_last, 1, " ms")],
    ["last answer TTFT", fmt(rates.ttft_s === null ? null : rates.ttft_s * 1000, 0, " ms")],
    ["last answer decode", fmt(rates.decode_tok_s, 1, " tok/s")],
    ["cache", `${st.cache_tokens} / ${st.cache_capacity_tokens} tokens`],
    ["cache bytes (fixed)", (st.cache_capacity_bytes / 1048576).toFixed(2) + " MiB"],
    ["policy", String(st.policy)], ["compressions", String(st.compressions)],
    ["questions answered", String(st.questions)],
    ["waiting", String(s.daemon.questions_waiting ?? "—")],
    ...reachRows(s.daemon.reach),
    ["process RSS", fmt(m.process_rss_mb, 0, " MiB")],
    ["power", m.power_w === null || m.power_w === undefined ? "no sensor" : fmt(m.power_w, 1, " W")],
  ]);
  if (s.cameras) showCameras(s.cameras);
  drawMemory(s.series);
  showQuestions(s.questions);
  const k = s.kept;
  if (k.rows) { paint($("heat"), k.cols, k.rows, (x, y) => k.kept[y][x]); window.paintedKept = k; }
  const cam = $("camera").hidden ? "" : "camera=" + encodeURIComponent($("camera").value) + "&";
  if (s.daemon.stream_state !== "ended" || !$("frame").src) $("frame").src = "/frame.jpg?" + cam + "t=" + Date.now();
}
$("logout").addEventListener("click", async () => {
  await fetch("/v1/edgekv/logout", {method: "POST", headers: {"Content-Type": "application/json"}, body: "{}"});
  location.reload();
});
$("ask").addEventListener("submit", async (event) => {
  event.preventDefault();
  const q = $("question").value.trim();
  if (!q) return;
  $("answer").dataset.done = "0";
  $("answer").textContent = "…";
  showEvidence(null);
  let text = "", evidence = null;
  try {
    const r = await fetch("/v1/chat/completions", {method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify({messages: [{role: "user", content: q}], stream: true, evidence: 1,
                            ...($("camera").hidden ? {} : {camera: $("camera").value})}), credentials: "same-origin"});
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      text = "error: " + ((body.error && body.error.message) || "HTTP " + r.status);
    } else {
      const reader = r.body.getReader(), dec = new TextDecoder();
      let buf = "";
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        buf += dec.decode(value, {stream: true});
        const events = buf.split("\n\n"); buf = events.pop();
        for (const ev of events) {
          const data = ev.replace(/^data: /, "");
          if (data === "[DONE]") continue;
          const msg = JSON.parse(data);
          if (msg.error) { text += "\n[error] " + msg.error.message; continue; }
          if (msg.choices.length) text += msg.choices[0].delta.content || "";
          if (msg.edgekv && msg.edgekv.evidence) evidence = msg.edgekv.evidence[0] || null;  // on the last chunk
        }
        $("answer").textContent = text;
      }
      text = text || "(empty answer)";
    }
  } catch (e) {
    text = "error: the daemon did not answer (stopped?)";
  }
  $("answer").textContent = text;
  showEvidence(evidence);
  $("answer").dataset.done = "1";
  refresh();
});
refresh(); setInterval(refresh, 1000);
