// The stream wire of kNet (docs/PROTOCOL.md §9): frames of
// size VLE-1.7/1.7/16, MessageID VLE-1.7/1.7/16, payload, back to back,
// and knet's hello, a PingReply that answers no ping.

import { ProtocolError } from './errors.js';

/** The largest value a VLE-1.7/1.7/16 holds: 2^30 - 1. */
export const MAX_VLE32 = 0x3fffffff;

export const ID_PING_REQUEST = 1;
export const ID_PING_REPLY = 2;

/** The AEAD tag a sealed frame carries after its body. */
export const TAG_SIZE = 16;

/** knet's hello kinds (§9.2, §9.7). */
export const HELLO_CLIENT = 1;
export const HELLO_ACCEPT = 2;
export const HELLO_REFUSE = 3;
export const HELLO_CLOSE = 4;
export const HELLO_SECURE = 5;
export const HELLO_SECURE_ACCEPT = 6;
export const HELLO_CLOSE_CODE = 7;

const MAGIC = [0x00, 0x6b, 0x4e, 0x54, 0x01]; // pingID 0, "kNT", version 1

export function sizeVLE32(v: number): number {
  return v < 0x80 ? 1 : v < 0x4000 ? 2 : 4;
}

/** Writes v at b[o] in the shortest form and returns the offset after it. */
export function putVLE32(b: Uint8Array, o: number, v: number): number {
  if (v < 0x80) {
    b[o] = v;
    return o + 1;
  }
  if (v < 0x4000) {
    b[o] = 0x80 | (v & 0x7f);
    b[o + 1] = v >>> 7;
    return o + 2;
  }
  if (v > MAX_VLE32) throw new RangeError(`knet: ${v} does not fit a VLE-1.7/1.7/16`);
  const w = v >>> 14;
  b[o] = 0x80 | (v & 0x7f);
  b[o + 1] = 0x80 | ((v >>> 7) & 0x7f);
  b[o + 2] = w & 0xff;
  b[o + 3] = w >>> 8;
  return o + 4;
}

/**
 * Reads a VLE-1.7/1.7/16 at b[o]: [value, length], the length -1 when b
 * ends first. Longer forms than needed are accepted, as Go does.
 */
export function readVLE32(b: Uint8Array, o: number): [number, number] {
  const n = b.length - o;
  if (n < 1) return [0, -1];
  const b0 = b[o];
  if (b0 < 0x80) return [b0, 1];
  if (n < 2) return [0, -1];
  const b1 = b[o + 1];
  if (b1 < 0x80) return [(b0 & 0x7f) | (b1 << 7), 2];
  if (n < 4) return [0, -1];
  return [(b0 & 0x7f) | ((b1 & 0x7f) << 7) | ((b[o + 2] | (b[o + 3] << 8)) * 0x4000), 4];
}

/** The plaintext of a frame after its size field: MessageID, payload. */
export function frameBody(id: number, payload: Uint8Array, extra = 0): Uint8Array {
  const b = new Uint8Array(sizeVLE32(id) + payload.length + extra);
  b.set(payload, putVLE32(b, 0, id));
  return b;
}

/** A whole frame in clear. */
export function encodeFrame(id: number, payload: Uint8Array): Uint8Array {
  return withSize(frameBody(id, payload));
}

/** Puts the size field before body. */
export function withSize(body: Uint8Array): Uint8Array {
  if (body.length > MAX_VLE32) throw new RangeError('knet: frame too large');
  const b = new Uint8Array(sizeVLE32(body.length) + body.length);
  b.set(body, putVLE32(b, 0, body.length));
  return b;
}

/** Splits a frame body in clear into its MessageID and payload. */
export function splitBody(body: Uint8Array): [number, Uint8Array] {
  const [id, k] = readVLE32(body, 0);
  if (k < 0) throw new ProtocolError("a frame's MessageID runs past its size");
  return [id, body.subarray(k)];
}

/** The payload of a knet hello of kind with content (a PingReply's). */
export function helloPayload(kind: number, content: Uint8Array): Uint8Array {
  const b = new Uint8Array(MAGIC.length + 1 + content.length);
  b.set(MAGIC);
  b[MAGIC.length] = kind;
  b.set(content, MAGIC.length + 1);
  return b;
}

/** Reads a PingReply's payload as a knet hello, or null if it is none. */
export function parseHello(p: Uint8Array): { kind: number; content: Uint8Array } | null {
  const n = MAGIC.length;
  if (p.length <= n) return null;
  for (let i = 0; i < n; i++) if (p[i] !== MAGIC[i]) return null;
  const kind = p[n];
  if (kind < HELLO_CLIENT || kind > HELLO_CLOSE_CODE) return null;
  return { kind, content: p.subarray(n + 1) };
}

/**
 * Cuts frames out of a byte stream that arrives in pieces (WebSocket
 * messages carry runs of whole or partial frames). It grows with what
 * arrived, never with what a size field announces, and its first error
 * is final: a stream cannot be resynchronised.
 */
export class Framer {
  private buf = new Uint8Array(0);
  private off = 0;
  private end = 0;
  /** From here on, frames are sealed: their limit counts the tag too. */
  sealed = false;

  constructor(public maxFrame: number) {}

  feed(p: Uint8Array): void {
    if (this.off === this.end) this.off = this.end = 0;
    const need = this.end - this.off + p.length;
    if (this.end + p.length > this.buf.length) {
      if (need <= this.buf.length && this.buf.length <= 2 * need) {
        this.buf.copyWithin(0, this.off, this.end);
      } else {
        // Doubling while a large frame comes in pieces, but never past
        // the largest frame (unless this piece needs it); a buffer far
        // larger than what is held is let go.
        const held = 4 + this.maxFrame + TAG_SIZE;
        const grow = need > this.buf.length ? Math.min(2 * this.buf.length, held) : 0;
        const nb = new Uint8Array(Math.max(need, grow, Math.min(4096, held)));
        nb.set(this.buf.subarray(this.off, this.end));
        this.buf = nb;
      }
      this.end -= this.off;
      this.off = 0;
    }
    this.buf.set(p, this.end);
    this.end += p.length;
  }

  /** The next frame's body (after its size field), or null until it is whole. */
  next(): Uint8Array | null {
    const avail = this.buf.subarray(this.off, this.end);
    const [size, k] = readVLE32(avail, 0);
    if (k < 0) return null;
    const limit = this.maxFrame + (this.sealed ? TAG_SIZE : 0);
    if (size === 0) throw new ProtocolError('a frame of size 0');
    if (size > limit) throw new ProtocolError(`a frame of size ${size}, over the limit ${limit}`);
    if (avail.length < k + size) return null;
    this.off += k + size;
    return avail.slice(k, k + size);
  }

  /** Bytes received and not yet returned: a frame begun. */
  buffered(): number {
    return this.end - this.off;
  }
}
