// The tts demo: streams speech over the WebSocket protocol (docs/protocol.md) and plays it gaplessly.
// Test hooks live on window.ttsDemo (counters, last figures, state).
const SAMPLE_RATE = 24000;
const $ = (id) => document.getElementById(id);
const BUSY = ["starting", "speaking", "ending"];  // an utterance is open on the server
// A server started with --api-key wants one: open the page as http://HOST:PORT/#key=KEY (a fragment never
// leaves the browser, so the key stays out of server logs).
const API_KEY = new URLSearchParams(location.hash.slice(1)).get("key");

const demo = {
  state: "connecting",     // connecting | idle | starting | speaking | ending | stopping | closed
  chunksReceived: 0,       // binary frames received, all utterances
  chunksScheduled: 0,      // chunks the AudioWorklet has queued for playback
  samplesReceived: 0,
  bufferedSamples: 0,      // queued in the AudioWorklet, not yet played
  underruns: 0,            // times playback ran dry mid-utterance and rebuffered
  level: 0,                // peak of the output over the last ~21 ms
  utterances: 0,
  lastTtfaMs: null,        // text sent -> first audio frame, measured in the page
  lastDone: null,          // the server's last done event
  errors: [],              // every error event, {code, message}
  reconnects: 0,           // dropped connections resumed (the audio goes on where it stopped)
  reconnecting: false,
};
window.ttsDemo = demo;

let ws = null;
let audio = null;          // {ctx, node}
let waiting = null;        // resolves on the next ready (or rejects on error) while starting
let dropping = false;      // after cancel: skip frames still in flight, until done
let firstTextAt = 0;
let gotAudio = false;
let sentText = "";         // type-as-you-go: what of the text box has been sent
let pauseTimer = 0;
const levels = [];
// Resuming after a dropped connection (docs/protocol.md, Resume): what this session has received, what it has
// sent since the last done (the server may not have had it), and the token ready gave.
const RESUME_TRIES = 5;
const ACK_BYTES = 65536;
let session = newSession();

function newSession() {
  return { token: null, bytes: 0, events: 0, acked: 0, outbox: [], outboxBase: 0 };
}

function setState(state, note) {
  demo.state = state;
  $("status").textContent = note || state;
  $("status").dataset.state = state;
  const busy = BUSY.includes(state);
  $("stop").disabled = !busy && demo.bufferedSamples === 0;
  $("speak").textContent = $("live").checked && busy ? "End" : "Speak";
}

function showError(code, message) {
  demo.errors.push({ code, message });
  const box = $("error");
  box.hidden = false;
  box.textContent = `${code.replaceAll("_", " ")}: ${message}`;
}

function clearError() {
  $("error").hidden = true;
}

function updateCounters() {
  $("chunks").textContent = `${demo.chunksReceived} / ${demo.chunksScheduled}`;
}

// ---- audio ---------------------------------------------------------------------------------------
async function ensureAudio() {
  if (!audio) {
    const ctx = new AudioContext({ sampleRate: SAMPLE_RATE, latencyHint: "interactive" });
    await ctx.audioWorklet.addModule("player-worklet.js");
    const node = new AudioWorkletNode(ctx, "pcm-player", { outputChannelCount: [1] });
    node.port.onmessage = (event) => onWorklet(event.data);
    node.connect(ctx.destination);
    audio = { ctx, node };
  }
  if (audio.ctx.state !== "running") await audio.ctx.resume();
  return audio;
}

function onWorklet(msg) {
  if (msg.type === "queued") {
    demo.chunksScheduled = msg.chunks;
    updateCounters();
  } else if (msg.type === "level") {
    demo.bufferedSamples = msg.buffered;
    demo.underruns = msg.underruns;
    demo.level = msg.peak;
    $("stop").disabled = !BUSY.includes(demo.state) && msg.buffered === 0;
    levels.push(msg.peak);
    if (levels.length > 240) levels.shift();
    drawMeter();
  } else if (msg.type === "drained" && demo.state === "idle") {
    $("status").textContent = "idle";
  }
}

function drawMeter() {
  const canvas = $("meter");
  const g = canvas.getContext("2d");
  const { width, height } = canvas;
  g.clearRect(0, 0, width, height);
  const bar = width / 240;
  g.fillStyle = getComputedStyle(canvas).color;
  levels.forEach((peak, i) => {
    const h = Math.max(1, Math.min(1, peak * 1.5) * height);
    g.fillRect(i * bar, (height - h) / 2, Math.max(1, bar - 1), h);
  });
}

// ---- the connection ------------------------------------------------------------------------------
function openSocket() {
  return new Promise((resolve, reject) => {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const query = API_KEY ? `?api_key=${encodeURIComponent(API_KEY)}` : "";
    const socket = new WebSocket(`${scheme}://${location.host}/v1/stream${query}`);
    socket.binaryType = "arraybuffer";
    socket.onopen = () => resolve(socket);
    socket.onclose = () => reject(new Error("connection failed"));
  });
}

function adopt(socket) {
  ws = socket;
  socket.onmessage = (event) => onMessage(event.data);
  socket.onclose = (event) => onClose(socket, event);
}

async function connect() {
  const socket = await openSocket();
  session = newSession();
  adopt(socket);
  setState("idle");
  return socket;
}

function onClose(socket, event) {
  if (ws !== socket) return;
  ws = null;
  if (!event.wasClean && session.token && BUSY.includes(demo.state)) return resumeSession();  // a drop
  setState("closed", `disconnected (${event.code}${event.reason ? " " + event.reason : ""}); Speak reconnects`);
  if (waiting) waiting.reject(new Error("connection closed"));
}

// A dropped connection mid-utterance: reconnect (a few tries, backing off), resume the session with what has
// arrived, and send again what the server had not received; the audio goes on where it stopped.
async function resumeSession() {
  demo.reconnecting = true;
  for (let attempt = 0; attempt < RESUME_TRIES; attempt++) {
    $("status").textContent = `connection lost: resuming (try ${attempt + 1} of ${RESUME_TRIES})`;
    await new Promise((r) => setTimeout(r, 200 * 2 ** attempt));
    let socket;
    try { socket = await openSocket(); } catch { continue; }
    const answer = await new Promise((resolve) => {
      socket.onmessage = (event) => resolve(JSON.parse(event.data));  // resumed, or an error
      socket.onclose = () => resolve(null);
      socket.send(JSON.stringify({ type: "resume", token: session.token,
                                   contexts: [{ bytes: session.bytes, events: session.events }] }));
    });
    if (answer && answer.type === "resumed") {
      session.token = answer.resume_token;
      adopt(socket);
      for (const text of session.outbox.slice(answer.received - session.outboxBase)) socket.send(text);
      demo.reconnects += 1;
      demo.reconnecting = false;
      setState(demo.state);
      return;
    }
    socket.close();
    if (answer && !["server_full", "client_limit"].includes(answer.code)) {
      showError(answer.code, answer.message);
      break;
    }
  }
  demo.reconnecting = false;
  session = newSession();
  setState("closed", "disconnected, and the session could not be resumed; Speak reconnects");
  if (waiting) waiting.reject(new Error("connection closed"));
}

async function socket() {
  if (demo.reconnecting) throw new Error("reconnecting");
  return ws && ws.readyState === WebSocket.OPEN ? ws : connect();
}

// Every message but acks is kept until its utterance's done, to be sent again after a resume.
function send(message) {
  const text = JSON.stringify(message);
  session.outbox.push(text);
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(text);
}

function acknowledge() {
  session.acked = session.bytes;
  if (ws && ws.readyState === WebSocket.OPEN) {
    ws.send(JSON.stringify({ type: "ack", bytes: session.bytes, events: session.events }));
  }
}

function onMessage(data) {
  if (data instanceof ArrayBuffer) {
    session.bytes += data.byteLength;
    if (session.bytes - session.acked >= ACK_BYTES) acknowledge();
    return onAudio(data);
  }
  const event = JSON.parse(data);
  if (event.type !== "queued") session.events += 1;
  if (event.type === "ready") {
    session.token = event.resume_token || null;
    if (waiting) waiting.resolve(event);
  } else if (event.type === "queued") {  // every slot is busy: the server keeps our place in its queue
    setState("starting", `waiting for a free slot (place ${event.position} in the queue)`);
  } else if (event.type === "done") {
    onDone(event);
  } else if (event.type === "error") {
    showError(event.code, event.message);
    if (waiting) waiting.reject(new Error(event.code));
  }
}

function onAudio(buffer) {
  if (dropping) return;
  demo.chunksReceived += 1;
  const chunk = new Float32Array(buffer);
  demo.samplesReceived += chunk.length;
  if (!gotAudio) {
    gotAudio = true;
    demo.lastTtfaMs = Math.round(performance.now() - firstTextAt);
    $("ttfa").textContent = `${demo.lastTtfaMs} ms`;
  }
  audio.node.port.postMessage(chunk, [chunk.buffer]);
  updateCounters();
}

function onDone(event) {
  // The server has had every message up to the end or cancel that ended this utterance (a start sent since,
  // after a Stop, belongs to the next one).
  const ended = session.outbox.findIndex((text) => /^\{"type":"(end|cancel)"/.test(text)) + 1;
  session.outbox.splice(0, ended);
  session.outboxBase += ended;
  demo.lastDone = event;
  dropping = false;
  audio?.node.port.postMessage({ type: "final" });
  if (event.rtf != null) $("rtf").textContent = event.rtf.toFixed(2);
  $("audio-seconds").textContent = `${event.audio_seconds.toFixed(2)} s${event.cancelled ? " (stopped)" : ""}`;
  if (demo.state !== "starting") setState("idle", event.cancelled ? "stopped" : "playing out…");
}

// ---- utterances ----------------------------------------------------------------------------------
async function start() {
  clearError();
  setState("starting");  // before any await: input that arrives meanwhile must not start a second one
  const ready = new Promise((resolve, reject) => { waiting = { resolve, reject }; });
  try {
    await ensureAudio();
    await socket();
    send({ type: "start", voice: $("voice").value || null, format: "f32le", speed: Number($("speed").value) });
    await ready;
  } catch (err) {
    setState("idle", "could not start");
    throw err;
  } finally {
    waiting = null;
  }
  demo.utterances += 1;
  gotAudio = false;
  firstTextAt = 0;
  setState("speaking");
}

function sendText(text) {
  if (!text) return;
  if (!firstTextAt) firstTextAt = performance.now();
  send({ type: "text", text });
}

async function speak() {
  if ($("live").checked && demo.state === "speaking") return endLive();
  if (BUSY.includes(demo.state)) stop();
  await start();
  sendText($("text").value);
  send({ type: "end" });
  setState("ending", "speaking");
}

function stop() {
  audio?.node.port.postMessage({ type: "clear" });  // silence at once
  demo.bufferedSamples = 0;
  if (!BUSY.includes(demo.state) || (!ws && !demo.reconnecting)) return;
  dropping = true;
  send({ type: "cancel" });
  if (waiting) waiting.reject(new Error("stopped"));  // a start still waiting in the server's queue
  sentText = "";
  setState("stopping");
}

// ---- type as you go ------------------------------------------------------------------------------
async function onTyping() {
  if (!$("live").checked) return;
  const text = $("text").value;
  if (demo.state !== "speaking") {
    if (demo.state !== "idle" || !text.trim()) return;
    sentText = "";
    await start();
  }
  const current = $("text").value;
  const fresh = current.startsWith(sentText) ? current.slice(sentText.length) : "";
  sentText = current;  // edits before what was sent cannot be unsaid
  sendText(fresh);
  clearTimeout(pauseTimer);
  pauseTimer = setTimeout(() => { if (demo.state === "speaking") send({ type: "flush" }); }, 1000);
}

function endLive() {
  clearTimeout(pauseTimer);
  send({ type: "end" });
  sentText = "";
  setState("ending", "finishing…");
}

// ---- a simulated LLM: the text box's words arrive as tokens, and are spoken as they come --------
async function simulateLlm() {
  if (BUSY.includes(demo.state)) stop();
  const tokens = $("text").value.match(/\S+\s*/g) || [];
  const out = $("llm-out");
  out.textContent = "";
  await start();
  for (const token of tokens) {
    if (demo.state !== "speaking") return;
    out.textContent += token;
    sendText(token);
    await new Promise((r) => setTimeout(r, 40 + Math.random() * 60));
  }
  if (demo.state === "speaking") {
    send({ type: "end" });
    setState("ending");
  }
}

// ---- page set-up ---------------------------------------------------------------------------------
async function loadVoices() {
  const response = await fetch("/v1/voices", API_KEY ? { headers: { Authorization: `Bearer ${API_KEY}` } } : {});
  if (!response.ok) throw new Error(`GET /v1/voices: HTTP ${response.status}`);
  const { voices, default: preferred } = await response.json();
  const select = $("voice");
  for (const voice of voices) {
    const option = new Option(`${voice.name} — ${voice.description}`, voice.name);
    option.selected = voice.name === preferred;
    select.add(option);
  }
  demo.voices = voices.map((v) => v.name);
}

function run(action) {
  return () => action().catch((err) => {
    if (err.message === "stopped") return;
    if (!demo.errors.length || demo.errors.at(-1).code !== err.message) showError("client", err.message);
  });
}

$("speed").addEventListener("input", () => { $("speed-value").textContent = `${Number($("speed").value).toFixed(2)}×`; });
$("speak").addEventListener("click", run(speak));
$("stop").addEventListener("click", stop);
$("llm").addEventListener("click", run(simulateLlm));
$("text").addEventListener("input", run(onTyping));
$("live").addEventListener("change", () => { document.body.classList.toggle("live", $("live").checked); setState(demo.state); });
loadVoices().then(connect).catch((err) => showError("voices", err.message));
