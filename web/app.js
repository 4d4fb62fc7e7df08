// omni_rt demo page: the OpenAI Realtime WebRTC flow (an ephemeral key from /v1/realtime/client_secrets,
// a call placed with POST /v1/realtime/calls), audio both ways, the events on the "oai-events" data channel.
"use strict";

const $ = (id) => document.getElementById(id);
const ui = {
  connect: $("connect"), status: $("status"), statusText: $("status-text"),
  transcript: $("transcript"), empty: $("empty"), composer: $("composer"), text: $("text"),
  speak: $("speak"), stop: $("stop"), voice: $("voice"), mic: $("mic"), player: $("player"),
  scope: $("scope"), speaking: $("speaking"), toast: $("toast"), listen: $("listen"),
  audible: $("m-audible"), ttfa: $("m-ttfa"), ttft: $("m-ttft"), median: $("m-median"), count: $("m-count"),
};

// The level that counts as "audible" on the analyser: about -34 dBFS peak, well above the codec's
// comfort noise and well below speech.
const AUDIBLE_PEAK = 0.02;

const state = {
  call: null, pc: null, dc: null, transceiver: null, micStream: null,
  audioCtx: null, source: null, analyser: null, samples: null,
  response: null,        // {id, bubble}
  audible: null,         // the reply whose first sound is awaited: {t0}; it may outlast response.done
  speaking: false,       // the track is playing a reply (it may outlast response.done)
  voice: null,           // the session's voice, as the server last said
  pending: null,         // a request sent, its response not created yet: {t0, eventIds}
  refused: null,         // the event ids of the last request the server refused (its errors toast once)
  voiceEventId: null,    // the last session.update that asked for a voice
  connected: false,      // WebRTC reached "connected" on this connection
  latencies: [],         // first-audible figures of this page's replies, ms
  doneWaiters: [],
  listen: "off",         // the spoken conversation: off | listening | speech | thinking | speaking
};
// Read by the browser test; handy in the console too. `cuts`: replies this page silenced on barge-in.
window.omni = { state, latencies: state.latencies, events: [], cuts: 0, listens: [] };

const LISTEN_TEXT = {
  off: "mic off", listening: "listening", speech: "speech detected", thinking: "thinking", speaking: "speaking",
};

// -- connection --------------------------------------------------------------------------------------

function setStatus(kind, text) {
  ui.status.dataset.kind = kind;
  ui.statusText.textContent = text;
  document.body.dataset.state = kind;
}

// OpenAI's WebRTC flow: the page mints an ephemeral key (the server's token, from the URL, is used for
// that alone), then places a call with the key: POST /v1/realtime/calls, the SDP offer in, the answer
// out (201, Location names the call); events travel on the "oai-events" data channel.
async function clientSecret() {
  const token = new URLSearchParams(location.search).get("token");
  const r = await fetch("/v1/realtime/client_secrets", {
    method: "POST",
    headers: { "Content-Type": "application/json", ...(token ? { Authorization: `Bearer ${token}` } : {}) },
    body: JSON.stringify({ expires_after: { anchor: "created_at", seconds: 60 } }),
  });
  if (!r.ok) throw new Error(r.status === 401 ? "the server refused the token in the URL" : `no key (HTTP ${r.status})`);
  return (await r.json()).value;
}

async function connect() {
  if (state.call) return disconnect();
  setStatus("connecting", "Connecting…");
  ui.connect.disabled = true;
  // Created inside the click, so the browser lets it (and the <audio> element) play.
  state.audioCtx = state.audioCtx || new AudioContext();
  await state.audioCtx.resume();

  const pc = new RTCPeerConnection({ iceServers: [] });
  state.pc = pc;
  state.call = "pending";
  // One audio transceiver both ways: the reply comes down it, the microphone (when on) goes up it,
  // switched with replaceTrack so that toggling the mic needs no renegotiation.
  state.transceiver = pc.addTransceiver("audio", { direction: "sendrecv" });
  pc.ontrack = (e) => attachRemote(e.streams[0] || new MediaStream([e.track]));
  pc.onconnectionstatechange = () => {
    if (state.pc !== pc) return;
    const s = pc.connectionState;
    if (s === "connected" && !state.connected) onConnected();
    else if (s === "connected") setStatus("connected", "Connected");  // back after an interruption
    else if (s === "disconnected") setStatus("connecting", "Connection interrupted…");
    else if (s === "failed") teardown("Disconnected: WebRTC failed");
  };
  const dc = pc.createDataChannel("oai-events");
  state.dc = dc;
  dc.onmessage = (m) => onEvent(JSON.parse(m.data));
  dc.onclose = () => { if (state.dc === dc) teardown("Disconnected"); };

  try {
    await pc.setLocalDescription(await pc.createOffer());
    await iceGatheringComplete(pc, 3000);  // one complete offer: the server does not trickle
    const key = await clientSecret();
    const r = await fetch("/v1/realtime/calls", {
      method: "POST",
      headers: { "Content-Type": "application/sdp", Authorization: `Bearer ${key}` },
      body: pc.localDescription.sdp,
    });
    if (r.status !== 201) {
      const why = r.status === 503 ? "server busy" : `the call was refused (HTTP ${r.status})`;
      throw new Error(why);
    }
    state.call = { url: r.headers.get("Location"), key };
    await pc.setRemoteDescription({ type: "answer", sdp: await r.text() });
  } catch (err) {
    toast(err.message);
    teardown("Not connected");
    throw err;
  }
}

function iceGatheringComplete(pc, timeoutMs) {
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => { clearTimeout(timer); pc.removeEventListener("icegatheringstatechange", check); resolve(); };
    const check = () => { if (pc.iceGatheringState === "complete") done(); };
    const timer = setTimeout(done, timeoutMs);
    pc.addEventListener("icegatheringstatechange", check);
  });
}

function onConnected() {
  state.connected = true;
  setStatus("connected", "Connected");
  ui.connect.disabled = false;
  ui.connect.textContent = "Disconnect";
  ui.text.disabled = ui.speak.disabled = ui.mic.disabled = false;
  ui.text.placeholder = "Say something, or type a message…";
  ui.text.focus();
  sendVoice();
}

function disconnect() {
  teardown("Not connected");
}

function teardown(message) {
  const { call, pc, micStream, response } = state;
  state.call = state.pc = state.dc = state.transceiver = state.micStream = null;
  state.connected = false;
  if (call && call.url) {  // hang up: the server frees the session at once (keepalive: also on unload)
    fetch(`${call.url}/hangup`, { method: "POST", headers: { Authorization: `Bearer ${call.key}` }, keepalive: true })
      .catch(() => {});
  }
  if (pc) pc.close();
  if (micStream) micStream.getTracks().forEach((t) => t.stop());
  if (response) endBubble(response.bubble, "incomplete");  // the reply was cut by the disconnect
  detachRemote();
  state.response = state.pending = state.audible = null;
  state.doneWaiters.splice(0).forEach((w) => w());
  ui.mic.checked = false;
  setListen("off");
  const hadFocus = [ui.text, ui.speak, ui.stop, ui.mic].includes(document.activeElement);
  ui.text.disabled = ui.speak.disabled = ui.mic.disabled = true;
  ui.text.placeholder = "Connect first…";
  ui.connect.disabled = false;
  ui.connect.textContent = "Connect";
  if (hadFocus) ui.connect.focus();  // a disabled control drops the keyboard focus to the page
  setSpeaking(false);
  setStatus(message.startsWith("Not") ? "idle" : "error", message);
}

function attachRemote(stream) {
  // Chromium only drains its jitter buffer for a stream something plays: the <audio> element plays
  // it (and is covered by echo cancellation); the analyser beside it only listens.
  detachRemote();
  ui.player.srcObject = stream;
  ui.player.play().catch(() => {});
  const source = state.audioCtx.createMediaStreamSource(stream);
  const analyser = state.audioCtx.createAnalyser();
  analyser.fftSize = 512;
  source.connect(analyser);
  state.source = source;
  state.analyser = analyser;
  state.samples = new Float32Array(analyser.fftSize);
}

// The old connection's stream leaves the audio graph (and the scope) with it.
function detachRemote() {
  if (state.source) state.source.disconnect();
  state.source = state.analyser = state.samples = null;
  ui.player.srcObject = null;
  ui.scope.getContext("2d").clearRect(0, 0, ui.scope.width, ui.scope.height);
}

// -- events -------------------------------------------------------------------------------------------

function send(event) {
  const data = JSON.stringify(event);
  if (state.dc && state.dc.readyState === "open") state.dc.send(data);
}

function onEvent(ev) {
  window.omni.events.push(ev.type);
  switch (ev.type) {
    case "webrtc.answer":
      state.pc.setRemoteDescription({ type: "answer", sdp: ev.sdp }).catch((e) => toast(e.message));
      break;
    case "response.created": {
      const t0 = state.pending ? state.pending.t0 : performance.now();
      const audioEndMs = state.pending ? state.pending.audioEndMs : null;
      state.pending = null;
      state.response = { id: ev.response.id, bubble: addBubble("assistant", "") };
      state.audible = { t0, audioEndMs, id: ev.response.id };
      state.response.bubble.classList.add("streaming");
      updateStop();
      break;
    }
    case "response.output_audio_transcript.delta":
    case "response.output_text.delta":
      if (state.response && ev.response_id === state.response.id) appendText(state.response.bubble, ev.delta);
      break;
    case "input_audio_buffer.speech_started":
      setListen("speech");
      break;
    case "input_audio_buffer.speech_stopped":
      setListen("thinking");
      // The first-audible figure of a spoken turn counts from where the voice ended: speech_stopped
      // comes the silence window (or semantic_vad's wait) later, which response.done's
      // metrics.end_of_speech_ms tells (audio_end_ms - end_of_speech_ms).
      state.pending = { t0: performance.now(), audioEndMs: ev.audio_end_ms };
      break;
    case "input_audio_buffer.committed":
      addBubble("user", "(spoke)").classList.add("spoken");
      break;
    case "output_audio_buffer.started":
      ui.player.muted = false;  // a new reply: unmute after a barge-in's cut
      setSpeaking(true);
      if (state.micStream) setListen("speaking");
      break;
    case "output_audio_buffer.stopped":
      setSpeaking(false);
      if (state.listen === "speaking") setListen("listening");
      break;
    case "output_audio_buffer.cleared":
      // The server dropped the reply's unplayed audio (barge-in, stop): the ~100 ms the browser's
      // jitter buffer still holds is muted too, so the cut is heard at once.
      ui.player.muted = true;
      state.audible = null;  // what is still heard of it is not a first sound
      window.omni.cuts += 1;
      setSpeaking(false);
      if (state.listen === "speaking") setListen("listening");
      break;
    case "response.done": {
      const r = ev.response;
      const m = r.metrics || {};
      ui.ttfa.textContent = fmt(m.ttfa_ms);
      ui.ttft.textContent = fmt(m.ttft_ms);
      if (m.end_of_speech_ms != null) endOfSpeech(r.id, m.end_of_speech_ms);
      if (state.response && state.response.id === r.id) endBubble(state.response.bubble, r.status);
      state.response = null;
      updateStop();
      // A reply with no audio (text only, failed) never says output_audio_buffer.stopped.
      if (state.listen === "thinking") setListen(state.micStream ? "listening" : "off");
      state.doneWaiters.splice(0).forEach((w) => w());
      break;
    }
    case "error": {
      // An error for the request waiting for its response (a refused item or response.create):
      // nothing is pending any more. The same request's later errors follow from the first.
      const id = ev.error.event_id;
      if (id && id === state.voiceEventId && state.voice) ui.voice.value = state.voice;  // kept its voice
      if (id && state.refused && state.refused.includes(id)) break;
      if (id && state.pending && state.pending.eventIds && state.pending.eventIds.includes(id)) {
        state.refused = state.pending.eventIds;
        state.pending = null;
        state.doneWaiters.splice(0).forEach((w) => w());
      }
      toast(ev.error.message);
      break;
    }
    case "session.created":
      state.voice = ev.session.audio.output.voice;
      break;
    case "session.updated": {
      const voice = ev.session.audio.output.voice;
      // the conversation goes on: the replies from here on are in the new voice
      if (voice !== state.voice && state.voice) addDivider(`Voice: ${voice[0].toUpperCase() + voice.slice(1)}`);
      state.voice = voice;
      break;
    }
    case "conversation.item.done":
      if (state.pending && state.pending.itemId === ev.item.id) {
        send({ type: "response.create", event_id: state.pending.eventIds[1] });
      }
      break;  // the page shows its own copy of what it sent
    default:
      break;
  }
}

let requests = 0;  // numbers this page's event ids, so an error can be matched to its request
async function speak(text) {
  if (state.response || state.pending) {
    // Barge-in: stop the current reply, then ask for the new one once it has ended.
    const ended = new Promise((resolve) => state.doneWaiters.push(resolve));
    send({ type: "response.cancel" });
    await Promise.race([ended, new Promise((r) => setTimeout(r, 2000))]);
  }
  addBubble("user", text);
  requests += 1;
  const eventIds = [`item_${requests}`, `create_${requests}`];
  const itemId = `item_page_${Date.now()}_${requests}`;
  state.pending = { t0: performance.now(), eventIds, itemId };
  // response.create waits for the item's conversation.item.done: a response.create with no new input
  // answers the conversation as it stands, so one sent after a refused item would reply to nothing.
  send({
    type: "conversation.item.create",
    event_id: eventIds[0],
    item: { id: itemId, type: "message", role: "user", content: [{ type: "input_text", text }] },
  });
}

function sendVoice() {
  requests += 1;
  state.voiceEventId = `voice_${requests}`;
  const session = { type: "realtime", audio: { output: { voice: ui.voice.value } } };
  send({ type: "session.update", event_id: state.voiceEventId, session });
}

// -- microphone ----------------------------------------------------------------------------------------

async function setMic(on) {
  const transceiver = state.transceiver;
  if (!transceiver) return;
  if (on) {
    let stream;
    try {
      stream = await navigator.mediaDevices.getUserMedia({
        audio: { echoCancellation: true, noiseSuppression: true, autoGainControl: true },
      });
    } catch (err) {
      ui.mic.checked = false;
      return toast(`Microphone unavailable: ${err.message}`);
    }
    // Switched off again, or disconnected, while the browser opened it: close it, never leave it live.
    if (!ui.mic.checked || state.transceiver !== transceiver) {
      stream.getTracks().forEach((t) => t.stop());
      return;
    }
    if (state.micStream) state.micStream.getTracks().forEach((t) => t.stop());
    state.micStream = stream;
    await transceiver.sender.replaceTrack(stream.getAudioTracks()[0]);
    setListen(state.speaking ? "speaking" : "listening");
  } else {
    if (state.micStream) state.micStream.getTracks().forEach((t) => t.stop());
    state.micStream = null;
    await transceiver.sender.replaceTrack(null);
    setListen("off");
  }
}

// The server detects the turns (server VAD): the page only shows where the conversation is.
function setListen(kind) {
  state.listen = kind;
  window.omni.listens.push(kind);
  ui.listen.textContent = LISTEN_TEXT[kind];
  ui.listen.dataset.kind = kind;
  document.body.dataset.listen = kind;
}

// -- measuring and drawing -------------------------------------------------------------------------------

// Polled on a timer, not per animation frame: a hidden or headless tab still measures.
setInterval(() => {
  if (!state.analyser) return;
  state.analyser.getFloatTimeDomainData(state.samples);
  let peak = 0;
  for (const v of state.samples) peak = Math.max(peak, Math.abs(v));
  // Measured until the reply is heard, not until response.done: its audio may be heard after that.
  if (state.audible && peak > AUDIBLE_PEAK) {
    const ms = performance.now() - state.audible.t0;
    state.heard = { ...state.audible, ms };
    state.audible = null;
    state.latencies.push(ms);
    ui.audible.textContent = fmt(ms);
    ui.median.textContent = fmt(median(state.latencies));
    ui.count.textContent = state.latencies.length;
    document.body.dataset.audible = "true";
  }
  draw(peak);
}, 5);

// A spoken reply's figure moves back to where the voice ended, whether its sound is still awaited
// or was already heard (its first audio usually comes before response.done).
function endOfSpeech(id, endMs) {
  for (const r of [state.audible, state.heard]) {
    if (!r || r.id !== id || r.audioEndMs == null || r.shifted) continue;
    r.shifted = true;
    const wait = r.audioEndMs - endMs;
    if (r === state.audible) {
      r.t0 -= wait;
    } else {
      r.ms += wait;
      state.latencies[state.latencies.length - 1] = r.ms;
      ui.audible.textContent = fmt(r.ms);
      ui.median.textContent = fmt(median(state.latencies));
    }
    window.omni.endOfSpeech = { id, waitMs: wait };
  }
}

let lastDraw = 0;
function draw(peak) {
  const now = performance.now();
  if (now - lastDraw < 33) return;
  lastDraw = now;
  const c = ui.scope, g = c.getContext("2d");
  const w = c.width, h = c.height, data = state.samples;
  g.clearRect(0, 0, w, h);
  g.lineWidth = 2;
  g.strokeStyle = peak > AUDIBLE_PEAK ? "#7c9cff" : "#2a3244";
  g.beginPath();
  for (let i = 0; i < data.length; i++) {
    const x = (i / (data.length - 1)) * w;
    const y = h / 2 - data[i] * (h / 2) * 0.9;
    if (i === 0) g.moveTo(x, y); else g.lineTo(x, y);
  }
  g.stroke();
}

// -- small helpers ------------------------------------------------------------------------------------

function addBubble(role, text) {
  ui.empty.hidden = true;
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  el.innerHTML = `<span class="who"></span><span class="text"></span>`;
  el.querySelector(".who").textContent = role === "user" ? "You" : "omni_rt";
  el.querySelector(".text").textContent = text;
  ui.transcript.appendChild(el);
  ui.transcript.scrollTop = ui.transcript.scrollHeight;
  return el;
}

function addDivider(text) {
  const el = document.createElement("div");
  el.className = "divider";
  el.textContent = text;
  ui.transcript.appendChild(el);
  ui.transcript.scrollTop = ui.transcript.scrollHeight;
}

function appendText(bubble, delta) {
  bubble.querySelector(".text").textContent += delta;
  ui.transcript.scrollTop = ui.transcript.scrollHeight;
}

function endBubble(bubble, status) {
  bubble.classList.remove("streaming");
  if (status !== "completed") bubble.dataset.status = status;
  // A reply can be all audio: the tiny preset's random weights rarely make printable text.
  const empty = { completed: "♪", cancelled: "(stopped)", incomplete: "(disconnected)" };
  if (!bubble.querySelector(".text").textContent) appendText(bubble, empty[status] || "—");
}

function setSpeaking(on) {
  state.speaking = on;
  ui.speaking.textContent = on ? "speaking" : "silent";
  ui.speaking.classList.toggle("on", on);
  updateStop();
}

// Stop works while a reply is generated and while its audio still plays (playout is real time).
function updateStop() {
  ui.stop.disabled = !state.connected || !(state.response || state.speaking);
}

function stop() {
  if (state.response) send({ type: "response.cancel" });
  else if (state.speaking) send({ type: "output_audio_buffer.clear" });
}

function fmt(ms) {
  return typeof ms === "number" && isFinite(ms) ? Math.round(ms).toString() : "—";
}

function median(xs) {
  const s = [...xs].sort((a, b) => a - b);
  const m = s.length >> 1;
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
}

let toastTimer = null;
function toast(message) {
  ui.toast.textContent = message;
  ui.toast.hidden = false;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => { ui.toast.hidden = true; }, 5000);
}

// -- wiring --------------------------------------------------------------------------------------------

ui.connect.addEventListener("click", () => connect().catch((e) => console.error(e)));
ui.composer.addEventListener("submit", (e) => {
  e.preventDefault();
  const text = ui.text.value.trim();
  if (!text || !state.connected) return;
  ui.text.value = "";
  document.getElementById("text-limit").hidden = true;
  speak(text);
});
ui.stop.addEventListener("click", stop);
// The box stops at its maxlength without a word; say so when a message reaches it (a paste cut short).
ui.text.addEventListener("input", () => {
  document.getElementById("text-limit").hidden = ui.text.value.length < ui.text.maxLength;
});
ui.voice.addEventListener("change", () => { if (state.connected) sendVoice(); });
ui.mic.addEventListener("change", () => setMic(ui.mic.checked));
