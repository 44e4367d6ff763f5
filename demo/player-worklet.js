// AudioWorklet processor: plays float32 chunks back to back, sample-exact, so chunk boundaries are gapless.
// A small jitter buffer: playback (re)starts once PREBUFFER samples are queued, or the utterance is final.
// Messages in:  a Float32Array (a chunk to queue); {type: "final"} (no more chunks: play out the rest);
//               {type: "clear"} (drop everything queued: silence now).
// Messages out: {type: "queued", chunks, buffered}, {type: "level", peak, rms, buffered, played, underruns},
//               {type: "drained"} once the queue runs dry after playing.
const LEVEL_EVERY = 4; // render quanta between level reports (4 x 128 samples = ~21 ms at 24 kHz)
const PREBUFFER = 2400; // 100 ms at 24 kHz

class PcmPlayer extends AudioWorkletProcessor {
  constructor() {
    super();
    this.queue = [];
    this.offset = 0;      // read position in queue[0]
    this.buffered = 0;    // samples queued, not yet played
    this.played = 0;
    this.chunks = 0;
    this.playing = false;
    this.waiting = true;  // filling the jitter buffer
    this.final = false;
    this.underruns = 0;
    this.resetLevel();
    this.port.onmessage = (event) => this.receive(event.data);
  }

  receive(data) {
    if (data instanceof Float32Array) {
      this.queue.push(data);
      this.buffered += data.length;
      this.chunks += 1;
      this.final = false;
      this.port.postMessage({ type: "queued", chunks: this.chunks, buffered: this.buffered });
    } else if (data && data.type === "final") {
      this.final = true;
    } else if (data && data.type === "clear") {
      this.queue = [];
      this.offset = 0;
      this.buffered = 0;
      this.playing = false;
      this.waiting = true;
    }
  }

  resetLevel() {
    this.peak = 0;
    this.sumSquares = 0;
    this.count = 0;
    this.quanta = 0;
  }

  fill(out) {
    let written = 0;
    while (written < out.length && this.queue.length) {
      const head = this.queue[0];
      const n = Math.min(out.length - written, head.length - this.offset);
      out.set(head.subarray(this.offset, this.offset + n), written);
      written += n;
      this.offset += n;
      if (this.offset >= head.length) {
        this.queue.shift();
        this.offset = 0;
      }
    }
    out.fill(0, written); // an underrun plays silence rather than stale samples
    return written;
  }

  measure(out) {
    for (let i = 0; i < out.length; i++) {
      const s = out[i];
      this.peak = Math.max(this.peak, Math.abs(s));
      this.sumSquares += s * s;
    }
    this.count += out.length;
    if (++this.quanta < LEVEL_EVERY) return;
    this.port.postMessage({
      type: "level", peak: this.peak, rms: Math.sqrt(this.sumSquares / this.count),
      buffered: this.buffered, played: this.played, underruns: this.underruns,
    });
    this.resetLevel();
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    if (this.waiting && (this.buffered >= PREBUFFER || (this.final && this.buffered > 0))) this.waiting = false;
    let written = 0;
    if (this.waiting) out.fill(0);
    else written = this.fill(out);
    this.buffered -= written;
    this.played += written;
    if (written) this.playing = true;
    if (this.playing && !this.queue.length) {
      this.playing = false;
      this.waiting = true;
      if (this.final) this.port.postMessage({ type: "drained", played: this.played });
      else this.underruns += 1;  // the network or the generator fell behind: rebuffer
    }
    this.measure(out);
    return true;
  }
}

registerProcessor("pcm-player", PcmPlayer);
