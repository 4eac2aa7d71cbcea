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

// Times as the device's clock shows them. The wearer asks by it ("forget from 14:00 to 14:10", "what was on the
// table at 14:03?") and the daemon reads such times in its own zone; a browser in another zone (travel, a remote
// operator) showed its own clock's times, which the device then read as other moments. Each status carries the
// device's clock (`clock`, as /v1/edgekv/clock gives it): its zone (its IANA name: the browser formats any moment in
// it, summer time included) or, without a name, its offset now; every time shown says its UTC offset. Read with every
// status: the zone may change while the daemon runs (a flight).
let clock = null;  // the status's `clock`, with `at`: Date.now() when it came
let zoneFormat = null;  // Intl.DateTimeFormat in the device's zone, or null: the offset now is used
function takeClock(given) {
  const zoneBefore = clock ? clock.zone : undefined;
  clock = {...given, at: Date.now()};
  if (clock.zone === zoneBefore) return;
  zoneFormat = null;
  if (clock.zone) {
    try {
      zoneFormat = new Intl.DateTimeFormat("en-US", {timeZone: clock.zone, hourCycle: "h23", year: "numeric",
        month: "2-digit", day: "2-digit", hour: "2-digit", minute: "2-digit", second: "2-digit"});
    } catch (e) { zoneFormat = null; }  // a name this browser does not know: the offset now
  }
}
function deviceNow() { return clock ? clock.unix + (Date.now() - clock.at) / 1000 : Date.now() / 1000; }
function clockParts(unix) {  // {date: "2026-12-06", time: "14:03:05", offset: minutes east of UTC} on the device
  const whole = Math.floor(unix);
  let shifted, offset;
  if (zoneFormat) {
    const p = Object.fromEntries(zoneFormat.formatToParts(new Date(whole * 1000)).map((x) => [x.type, x.value]));
    offset = Math.round((Date.UTC(+p.year, +p.month - 1, +p.day, +p.hour % 24, +p.minute, +p.second) -
                         whole * 1000) / 60000);
  } else {
    offset = clock ? Math.round(clock.utc_offset_s / 60) : -new Date(whole * 1000).getTimezoneOffset();
  }
  shifted = new Date((whole + offset * 60) * 1000).toISOString();  // the device's wall time, written as UTC
  return {date: shifted.slice(0, 10), time: shifted.slice(11, 19), offset};
}
function offsetText(minutes) {
  const a = Math.abs(minutes);
  return "UTC" + (minutes < 0 ? "\u2212" : "+") + String(Math.floor(a / 60)).padStart(2, "0") + ":" +
         String(a % 60).padStart(2, "0");
}
function deviceTime(unix, withOffset = true) {
  // "14:03:05 (UTC+01:00)", dated when not the device's today; without withOffset, the offset only where it is not
  // the one now (the header says that one: a time before the clocks changed says its own)
  const p = clockParts(unix), now = clockParts(deviceNow());
  return (p.date === now.date ? "" : p.date + " ") + p.time +
         (withOffset || p.offset !== now.offset ? " (" + offsetText(p.offset) + ")" : "");
}
function showClock() {
  const now = clockParts(deviceNow()), browser = -new Date().getTimezoneOffset();
  const zone = clock ? (clock.zone || clock.abbreviation || "") : "";
  $("clock").textContent = (clock ? "Times are the device's clock: " : "Times are this browser's clock: ") +
    `now ${now.time.slice(0, 5)}${zone ? " " + zone : ""} (${offsetText(now.offset)})` +
    (clock && browser !== now.offset ? ` — this browser is at ${offsetText(browser)}` : "") +
    ". Questions about a time of day are read by the device's clock.";
  $("clock").dataset.offset = String(now.offset);
}

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
      (r[key + "_unix"] ? "to " + deviceTime(r[key + "_unix"], false) + ", " : "") +
      spanText(Math.max(0, r.newest_t - r[key + "_t"]))]);
}
function setFigures(rows) {
  const table = $("figures");
  table.replaceChildren(...rows.map(([name, value]) => {
    const tr = document.createElement("tr"), a = document.createElement("td"), b = document.createElement("td");
    a.textContent = name; b.textContent = value; b.className = "v"; tr.append(a, b); return tr;
  }));
}
const STATE_TEXT = {starting: "starting", running: "live", degraded: "live, degraded", reconnecting: "reconnecting",
                    paused: "paused (privacy)", ended: "stream ended", stalled: "stalled", stopping: "daemon stopping",
                    unreachable: "daemon stopped", signedout: "signed out"};
function showState(state, detail, problems) {
  problems = problems || [];
  if (state === "running" && problems.length) state = "degraded";  // live, but something is wrong: say what
  $("state").dataset.state = state;
  document.body.dataset.state = state;
  $("state").textContent = STATE_TEXT[state] || state;
  const banner = $("banner");
  const said = (words) => (detail ? words + " (" + detail + ")" : words);
  let text = {
    degraded: problems.join(" · "),
    ended: said("The stream has ended") + ". No new frames are ingested; questions are answered about what was seen.",
    reconnecting: said(problems.length ? problems.join(" · ")  // "not reached yet" at start, or "lost"
                       : "The camera stopped delivering frames; reconnecting") + "…",
    paused: "Paused by the privacy switch: the camera is released and nothing is seen until it is resumed; " +
            "questions are answered about what was seen before.",
    stalled: said("No frame has gone into the memory for a while (video.stall_s)") + "; the daemon log says why.",
    stopping: "The daemon is shutting down; new questions are refused.",
    unreachable: "The daemon is not answering: it has stopped (or restarts). The page reconnects by itself.",
    signedout: "This session has ended (signed out, or the daemon restarted): sign in again.",
  }[state] || "";
  if (problems.length && !["degraded", "reconnecting"].includes(state)) text += " · " + problems.join(" · ");
  banner.textContent = text;
  banner.classList.toggle("show", Boolean(text));
  $("send").disabled = ["stopping", "unreachable", "signedout"].includes(state);
  const privacy = $("privacy");  // the privacy switch, while a stream runs (or is paused)
  privacy.hidden = !["running", "degraded", "reconnecting", "stalled", "paused"].includes(state);
  privacy.textContent = state === "paused" ? "Resume camera" : "Pause camera";
  privacy.dataset.action = state === "paused" ? "resume" : "pause";
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
    q.className = "q"; q.textContent = item.question; q.dir = "auto";  // right-to-left text reads so
    const a = document.createElement("div");
    a.dir = "auto";
    if (item.error) { a.className = "err"; a.textContent = "refused: " + item.error; }
    else { a.className = "a"; a.textContent = item.answer || "(empty answer)"; }
    const meta = document.createElement("div"); meta.className = "meta";
    const asked = item.asked_at != null ? "asked " + deviceTime(item.asked_at, false) : "";
    meta.textContent = item.error ? asked : [asked, `${item.tokens} tokens`,
      `TTFT ${fmt(item.ttft_s * 1000, 0, " ms")}`, fmt(item.decode_tok_s, 1, " tok/s")].filter(Boolean).join(" · ");
    li.append(src, q, a, meta); return li;
  }));
  $("questions").dataset.count = String(items.length);
}
const ALERT_FRAMES = /^\/v1\/alerts\/events\/[^/?#]+\/keyframe\.jpg$/;  // the daemon's own links only
function showAlerts(alerts) {  // the last alerts of the standing questions, newest first
  const items = alerts.events.map((event) => {
    const li = document.createElement("li"), when = document.createElement("span");
    const name = document.createElement("span");
    when.className = "when"; when.textContent = deviceTime(event.raised_unix, false);
    name.className = "rule"; name.textContent = event.name; name.dir = "auto";
    if (event.question !== event.name) name.title = event.question;
    li.append(when, name);
    if (event.camera) {
      const cam = document.createElement("span");
      cam.className = "src"; cam.textContent = event.camera; li.append(cam);
    }
    const meta = document.createElement("span");
    meta.className = "meta";
    meta.textContent = [`P(yes) ${fmt(event.p_yes, 2)}`,
      event.evidence_unix != null ? "evidence seen " + deviceTime(event.evidence_unix, false) : ""]
      .filter(Boolean).join(" · ");
    li.append(meta);
    if (event.keyframe_url && ALERT_FRAMES.test(event.keyframe_url)) {
      const a = document.createElement("a");
      a.href = event.keyframe_url; a.target = "_blank"; a.rel = "noopener"; a.textContent = "evidence frame";
      li.append(a);
    }
    return li;
  });
  if (!items.length) {
    const li = document.createElement("li");
    li.className = "none";
    li.textContent = alerts.rules ? `No alert yet (${alerts.rules} standing question${alerts.rules === 1 ? "" : "s"}).`
      : "No standing questions (alerts.rules in the config, or POST /v1/alerts).";
    items.push(li);
  }
  $("alerts").replaceChildren(...items);
  $("alerts").dataset.count = String(alerts.events.length);
}
function showEvidence(item) {  // when the answer's evidence was seen, and its frame while the daemon keeps it
  const box = $("evidence");
  if (!item) { box.replaceChildren(); return; }
  const line = document.createElement("div");
  const when = item.unix != null ? "seen " + deviceTime(item.unix) + " · " : "";
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
async function signedOut() {
  // the session cookie was refused: signed out elsewhere, or the daemon restarted (it forgets every session). Go to
  // the login form only when the daemon serves it, so that a daemon gone again meanwhile leaves this page (which
  // keeps trying) rather than the browser's error page, and nothing can reload in a loop.
  showState("signedout");
  try {
    const r = await fetch("/", {credentials: "same-origin"});
    if (r.ok && (await r.text()).includes('id="login"')) location.reload();
  } catch (e) { /* gone again: the next refresh says so */ }
}
async function refresh() {
  let s;
  try {
    const r = await fetch("/v1/edgekv/status", {credentials: "same-origin"});
    if (r.status === 401) { await signedOut(); return; }
    if (r.status === 429) return;  // server.reads_per_second (other pages open): the next turn
    if (!r.ok) throw new Error("HTTP " + r.status);
    s = await r.json();
  } catch (e) {
    if (++failures >= 3) { showState("unreachable"); clock = null; }  // it may come back in another zone
    return;
  }
  failures = 0;
  if (s.clock) takeClock(s.clock);
  showClock();
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
  if (s.alerts) showAlerts(s.alerts);
  const k = s.kept;
  if (k.rows) { paint($("heat"), k.cols, k.rows, (x, y) => k.kept[y][x]); window.paintedKept = k; }
  const cam = $("camera").hidden ? "" : "camera=" + encodeURIComponent($("camera").value) + "&";
  if (s.daemon.stream_state !== "ended" || !$("frame").src) $("frame").src = "/frame.jpg?" + cam + "t=" + Date.now();
}
async function post(path) {  // a JSON POST; its error message, or null
  try {
    const r = await fetch(path, {method: "POST", headers: {"Content-Type": "application/json"}, body: "{}",
                                 credentials: "same-origin"});
    if (r.ok) return null;
    const body = await r.json().catch(() => ({}));
    return (body.error && body.error.message) || "HTTP " + r.status;
  } catch (e) {
    return "the daemon did not answer (stopped?)";
  }
}
$("logout").addEventListener("click", async () => {
  const error = await post("/v1/edgekv/logout");
  if (error) { $("notice").textContent = "could not sign out: " + error; return; }
  location.reload();
});
$("privacy").addEventListener("click", async () => {
  const button = $("privacy"), action = button.dataset.action;
  button.disabled = true;
  $("notice").textContent = "";
  const error = await post("/v1/privacy/" + action);
  if (error) $("notice").textContent = `could not ${action} the camera: ${error}`;
  await refresh();
  button.disabled = false;
});
// "forget ..." typed as a question went to the model, which answered (and the wearer believed it forgotten); the
// form below forgets (apps/voice/commands.py refuses a spoken one that it does not understand, for the same reason)
const FORGET_WORDS = /^(please\s+)?((can|could|would)\s+you\s+)?(please\s+)?(forget|delete|erase|wipe)\b/i;
$("ask").addEventListener("submit", async (event) => {
  event.preventDefault();
  const q = $("question").value.trim();
  if (!q) return;
  if (FORGET_WORDS.test(q)) {
    $("answer").textContent = "Nothing was forgotten: questions go to the model, which cannot forget. Give the " +
      "window in “Forget what was seen” below, by the device's clock.";
    $("answer").dataset.done = "1";
    showEvidence(null);
    $("forget-from").focus();
    return;
  }
  $("answer").dataset.done = "0";
  $("answer").setAttribute("aria-busy", "true");  // read out once whole, not token by token
  $("answer").textContent = "…";
  showEvidence(null);
  let text = "", evidence = null;
  try {
    const r = await fetch("/v1/chat/completions", {method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify({messages: [{role: "user", content: q}], stream: true, evidence: 1,
                            ...($("camera").hidden ? {} : {camera: $("camera").value})}), credentials: "same-origin"});
    if (r.status === 401) {
      text = "error: this session has ended: sign in again";
      signedOut();
    } else if (!r.ok) {
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
  $("answer").setAttribute("aria-busy", "false");
  showEvidence(evidence);
  $("answer").dataset.done = "1";
  refresh();
});
$("forget").addEventListener("submit", async (event) => {
  event.preventDefault();
  const from = $("forget-from").value.trim(), to = $("forget-to").value.trim(), out = $("forget-result");
  if (!confirm(`Forget for good what was seen from ${from} to ${to} (the device's clock)?`)) return;
  $("forget-send").disabled = true;
  out.className = ""; out.textContent = "forgetting…";
  try {
    const r = await fetch("/v1/memory/forget", {method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify({from, to}), credentials: "same-origin"});
    const body = await r.json().catch(() => ({}));
    if (!r.ok) {
      out.className = "err";
      out.textContent = "Nothing was forgotten: " + ((body.error && body.error.message) || "HTTP " + r.status);
    } else {
      const span = body.wall ? ` seen from ${deviceTime(body.wall.from)} to ${deviceTime(body.wall.to)}` : "";
      const archived = body.archive && body.archive.pairs ? `, ${body.archive.pairs} from the archive` : "";
      const freed = body.cache_tokens_freed !== undefined ? `${body.cache_tokens_freed} cache tokens freed` : "from the cache";
      out.textContent = `Forgot ${body.pairs} frame pairs${span} (${freed}${archived}).`;
    }
  } catch (e) {
    out.className = "err"; out.textContent = "the daemon did not answer (stopped?): nothing is known to be forgotten";
  }
  $("forget-send").disabled = false;
  refresh();
});
async function poll() {  // one status at a time: a slow daemon is not sent a pile of them
  await refresh();
  setTimeout(poll, 1000);
}
poll();
