// The secure handshake (SECURE.md, docs/PROTOCOL.md §9.7): Noise NK,
// Noise_NK_25519_AESGCM_SHA256 with knet's prologue, the client the
// initiator, as github.com/flynn/noise runs it for the Go side. The
// primitives are @noble's; this file only strings them together as the
// Noise specification (revision 34) says.

import { x25519 } from '@noble/curves/ed25519.js';
import { gcm } from '@noble/ciphers/aes.js';
import { sha256 } from '@noble/hashes/sha2.js';
import { hmac } from '@noble/hashes/hmac.js';
import { HandshakeError } from './errors.js';

const enc = new TextEncoder();
const PROTOCOL = enc.encode('Noise_NK_25519_AESGCM_SHA256');
/** Mixed into the handshake hash by both sides (secure.go, noisePrologue). */
const PROLOGUE = enc.encode('kNet-over-UDP secure v1');

export const KEY_SIZE = 32;

function concat(...parts: Uint8Array[]): Uint8Array {
  let n = 0;
  for (const p of parts) n += p.length;
  const b = new Uint8Array(n);
  n = 0;
  for (const p of parts) {
    b.set(p, n);
    n += p.length;
  }
  return b;
}

/** Noise's AESGCM nonce: 32 zero bits, then n as a big-endian 64-bit integer. */
export function nonce(n: number): Uint8Array {
  const b = new Uint8Array(12);
  const v = new DataView(b.buffer);
  v.setUint32(4, Math.floor(n / 0x100000000));
  v.setUint32(8, n >>> 0);
  return b;
}

/** Noise's HKDF with two outputs. */
function hkdf2(ck: Uint8Array, ikm: Uint8Array): [Uint8Array, Uint8Array] {
  const tk = hmac(sha256, ck, ikm);
  const o1 = hmac(sha256, tk, Uint8Array.of(1));
  const o2 = hmac(sha256, tk, concat(o1, Uint8Array.of(2)));
  return [o1, o2];
}

/** The initiator's handshake state between message 1 and message 2. */
export interface Initiator {
  ck: Uint8Array;
  h: Uint8Array;
  eph: Uint8Array; // the ephemeral private key
}

/**
 * Writes Noise NK message 1 (e, es, then payload encrypted) to the server
 * whose static public key is serverKey, with the ephemeral private key
 * eph (random, except in the test vectors).
 */
export function writeMessage1(serverKey: Uint8Array, eph: Uint8Array, payload: Uint8Array): { msg1: Uint8Array; state: Initiator } {
  // The name is 28 bytes: it is h, padded with zeros to the hash's length.
  let h: Uint8Array = new Uint8Array(32);
  h.set(PROTOCOL);
  let ck = h;
  h = sha256(concat(h, PROLOGUE));
  h = sha256(concat(h, serverKey)); // the pre-message: <- s
  const e = x25519.getPublicKey(eph);
  h = sha256(concat(h, e));
  let k: Uint8Array;
  [ck, k] = hkdf2(ck, x25519.getSharedSecret(eph, serverKey));
  const ct = gcm(k, nonce(0), h).encrypt(payload);
  h = sha256(concat(h, ct));
  return { msg1: concat(e, ct), state: { ck, h, eph } };
}

/**
 * Reads Noise NK message 2 (e, ee, then the payload): it proves the server
 * holds the private key, and gives the payload and the transport keys,
 * send (client to server) and recv.
 */
export function readMessage2(st: Initiator, msg2: Uint8Array): { payload: Uint8Array; send: Uint8Array; recv: Uint8Array } {
  if (msg2.length < KEY_SIZE + 16) throw new HandshakeError("the server's answer is too short");
  const re = msg2.subarray(0, KEY_SIZE);
  let h = sha256(concat(st.h, re));
  let ck: Uint8Array, k: Uint8Array;
  let payload: Uint8Array;
  try {
    [ck, k] = hkdf2(st.ck, x25519.getSharedSecret(st.eph, re));
    const ct = msg2.subarray(KEY_SIZE);
    payload = gcm(k, nonce(0), h).decrypt(ct);
    h = sha256(concat(h, ct));
  } catch {
    throw new HandshakeError("the server's answer did not prove it holds the private key of serverKey");
  }
  const [send, recv] = hkdf2(ck, new Uint8Array(0));
  return { payload, send, recv };
}

/** The payload of message 1: the token's length (u16 little-endian), the token, the ConnectPayload. */
export function synPayload(token: Uint8Array, payload: Uint8Array): Uint8Array {
  if (token.length > 0xffff) throw new RangeError('knet: token too long');
  return concat(Uint8Array.of(token.length & 0xff, token.length >>> 8), token, payload);
}

/**
 * Seals and opens a secure stream's frames: AES-256-GCM under each
 * direction's key, the nonce the frame's number in its direction, counted
 * from 0 (nothing of it on the wire), no associated data.
 */
export class StreamSeal {
  sendN = 0;
  recvN = 0;
  constructor(
    private readonly sendKey: Uint8Array,
    private readonly recvKey: Uint8Array,
  ) {}

  seal(body: Uint8Array): Uint8Array {
    if (this.sendN >= Number.MAX_SAFE_INTEGER) throw new HandshakeError('the frame counter would wrap');
    return gcm(this.sendKey, nonce(this.sendN++)).encrypt(body);
  }

  /** Opens a sealed frame's body, or returns null: it did not authenticate. */
  open(body: Uint8Array): Uint8Array | null {
    let pt: Uint8Array;
    try {
      pt = gcm(this.recvKey, nonce(this.recvN)).decrypt(body);
    } catch {
      return null;
    }
    this.recvN++;
    return pt;
  }
}

export function randomKey(): Uint8Array {
  return crypto.getRandomValues(new Uint8Array(KEY_SIZE));
}

export { concat };
