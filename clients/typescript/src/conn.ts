// A kNet connection over WebSocket, as Go's DialWebSocket makes one
// (stream.go, streamsession.go, stream_secure.go): the client's hello,
// the server's answer, then frames both ways, pings on a timer, and
// knet's close hello before the WebSocket's close.

import {
  ClosedError,
  DisconnectError,
  HandshakeError,
  KnetError,
  ProtocolError,
  RefusedError,
  TimeoutError,
  WebSocketError,
} from './errors.js';
import { StreamSeal, concat, randomKey, readMessage2, synPayload, writeMessage1, type Initiator, KEY_SIZE } from './noise.js';
import {
  Framer,
  HELLO_ACCEPT,
  HELLO_CLIENT,
  HELLO_CLOSE,
  HELLO_CLOSE_CODE,
  HELLO_REFUSE,
  HELLO_SECURE,
  HELLO_SECURE_ACCEPT,
  ID_PING_REPLY,
  ID_PING_REQUEST,
  encodeFrame,
  frameBody,
  helloPayload,
  parseHello,
  splitBody,
  withSize,
} from './wire.js';

/** The application's message IDs: the protocol reserves the others. */
export const MIN_MESSAGE_ID = 6;
export const MAX_MESSAGE_ID = 0x3ffffffa;
/** The longest close or refusal reason sent, in bytes (Go's MaxReasonLength). */
export const MAX_REASON_LENGTH = 256;

const DEFAULT_MAX_MESSAGE = 16 << 20;
/** The longest connect token (Go's maxTokenSize). */
const MAX_TOKEN_SIZE = 460;
/** Unreliable messages are dropped at the sender past this many bytes waiting (Go's streamUnreliableLimit). */
const UNRELIABLE_LIMIT = 64 << 10;
/** What one WebSocket message carries at most, unless one frame is larger (Go's streamWriteMax). */
const WRITE_MAX = 64 << 10;
const PING_INTERVAL = 3500;

/** The WebSocket a connection needs: the browser's, Node's, or the ws package's. */
export interface WebSocketLike {
  binaryType: string;
  readonly bufferedAmount: number;
  readonly readyState: number;
  send(data: Uint8Array): void;
  close(code?: number, reason?: string): void;
  onopen: ((ev: any) => void) | null;
  onmessage: ((ev: { data: unknown }) => void) | null;
  onclose: ((ev: { code: number; reason: string }) => void) | null;
  onerror: ((ev: any) => void) | null;
}

export type WebSocketConstructor = new (url: string) => WebSocketLike;

export interface ConnectOptions {
  /** The server's static public key (32 bytes, or 64 hex digits): a secure session, never in clear. */
  serverKey?: Uint8Array | string;
  /** A connect token from the game's backend (IssueToken), carried in the secure handshake. */
  token?: Uint8Array;
  /** The ConnectPayload the server's Admit hook reads. */
  payload?: Uint8Array | string;
  /** The largest message received or sent, in bytes (Go's MaxMessageSize, 16 MiB by default). */
  maxMessageSize?: number;
  /** How long the server may take to admit the connection, in ms (10000). */
  connectTimeout?: number;
  /** How long the server may stay silent before the connection is lost, in ms (15000). */
  lostTimeout?: number;
  /** How long a close waits for the server's answer, in ms (5000). */
  disconnectTimeout?: number;
  /** Called with each message received; without it, messages wait for the async iterator. */
  onmessage?: (m: Message) => void;
  /** Called with each receipt of a message sent (see Receipt). */
  onreceipt?: (r: Receipt) => void;
  /** The WebSocket class: the global one by default. */
  WebSocket?: WebSocketConstructor;
  /** Aborts the attempt while the server has not answered (connect rejects with a ClosedError). */
  signal?: AbortSignal;
}

export interface SendOptions {
  /** Delivered unless the connection fails; an unreliable one may be dropped at the sender behind 64 KiB waiting. */
  reliable?: boolean;
  /** Never after a later in-order message of its channel (the stream keeps order; this holds priorities back). */
  inOrder?: boolean;
  /** The ordering channel of an in-order message, 0-255. */
  channel?: number;
  /** Latest state: a newer message with the same id and contentId replaces this one while it waits. */
  contentId?: number;
  /** Leaves before waiting messages of lower priority (-128 to 127), never before one it depends on. */
  priority?: number;
  /** Earlier messages (refs send returned) that must leave before this one. */
  dependsOn?: number[];
}

export interface Message {
  id: number;
  payload: Uint8Array;
  /** Always false: a stream carries no delivery flags (Go reads them so too). */
  reliable: boolean;
  /** Always false, as reliable. */
  inOrder: boolean;
}

/**
 * What became of a message sent: delivered once it was written to the
 * WebSocket (the stream delivers what it takes, unless the connection
 * fails first), lost when it was dropped (unreliable, behind a full
 * stream), replaced (contentId) or still waiting when the connection
 * ended. As Go's Receipt over a stream.
 */
export interface Receipt {
  ref: number;
  delivered: boolean;
}

export interface Stats {
  messagesSent: number;
  messagesReceived: number;
  droppedMessages: number;
  replacedMessages: number;
  bytesSent: number;
  bytesReceived: number;
}

interface OutMsg {
  ref: number;
  id: number;
  payload: Uint8Array;
  reliable: boolean;
  inOrder: boolean;
  channel: number;
  contentId: number;
  priority: number;
  after: number[];
}

type Phase = 'opening' | 'open' | 'ended';

const enc = new TextEncoder();

function bytesOf(p: Uint8Array | string | undefined): Uint8Array {
  if (p === undefined) return new Uint8Array(0);
  return typeof p === 'string' ? enc.encode(p) : p;
}

function keyOf(k: Uint8Array | string): Uint8Array {
  if (typeof k === 'string') {
    if (!/^[0-9a-fA-F]{64}$/.test(k)) throw new TypeError('knet: serverKey must be 32 bytes or 64 hex digits');
    const b = new Uint8Array(KEY_SIZE);
    for (let i = 0; i < KEY_SIZE; i++) b[i] = parseInt(k.slice(2 * i, 2 * i + 2), 16);
    return b;
  }
  if (k.length !== KEY_SIZE) throw new TypeError('knet: serverKey must be 32 bytes (X25519)');
  return k;
}

function reasonBytes(reason: string): Uint8Array {
  let b = enc.encode(reason);
  if (b.length > MAX_REASON_LENGTH) b = b.subarray(0, MAX_REASON_LENGTH);
  return b;
}

function now(): number {
  return performance.now();
}

/**
 * Connects to a kNet server over WebSocket, at a URL where a Go Listener's
 * WebSocketHandler serves ("ws://host/path", "wss://host/path"), and
 * resolves once the server admitted the connection, as DialWebSocket
 * returns. It rejects with a RefusedError when the server refused (its
 * reason), a HandshakeError when a secure server's answer did not
 * authenticate, a TimeoutError, a WebSocketError when the WebSocket
 * failed.
 */
export function connect(url: string, options: ConnectOptions = {}): Promise<Conn> {
  return new Promise((resolve, reject) => {
    const c = new Conn(url, options, resolve, reject);
    const sig = options.signal;
    if (sig) {
      const abort = () => {
        if (c.error === null) c.abort();
      };
      if (sig.aborted) abort();
      else sig.addEventListener('abort', abort, { once: true });
      void c.closed.then(() => sig.removeEventListener('abort', abort));
    }
  });
}

export class Conn implements AsyncIterable<Message> {
  /** The Admit hook's reply (Go's Conn.Handshake on the client's side). */
  reply: Uint8Array = new Uint8Array(0);
  /** The server's first frame was no knet hello: a peer of the reference's wire (never a knet WebSocket server). */
  reference = false;
  readonly stats: Stats = {
    messagesSent: 0,
    messagesReceived: 0,
    droppedMessages: 0,
    replacedMessages: 0,
    bytesSent: 0,
    bytesReceived: 0,
  };
  /** Resolves with how the connection ended, once it has (never rejects). */
  readonly closed: Promise<KnetError>;
  onmessage?: (m: Message) => void;
  onreceipt?: (r: Receipt) => void;

  private readonly ws: WebSocketLike;
  private readonly opts: Required<Pick<ConnectOptions, 'maxMessageSize' | 'connectTimeout' | 'lostTimeout' | 'disconnectTimeout'>>;
  private phase: Phase = 'opening';
  private resolveConnect?: (c: Conn) => void;
  private rejectConnect?: (e: unknown) => void;
  private resolveClosed!: (e: KnetError) => void;
  private err: KnetError | null = null;
  private readonly framer: Framer;
  private initiator: Initiator | null = null;
  private seal: StreamSeal | null = null;
  private needKnet: boolean;

  private q: OutMsg[] = [];
  private qBytes = 0;
  private ctrl: Uint8Array[] = []; // frame bodies in clear: pings, replies, the close hello
  private pumpScheduled = false;
  private pumpTimer: ReturnType<typeof setTimeout> | undefined;
  private lastRef = 0;

  private pingID = 0;
  private pingSent = -1;
  private nextPing: number;
  private pingEvery: number;
  private lastRecv: number;
  private rttMs = 0;
  private pingWaiters: { resolve: (rtt: number) => void; reject: (e: unknown) => void }[] = [];
  private timer: ReturnType<typeof setTimeout> | undefined;
  private deadline: number; // of the opening, or of the close

  private closing = false; // close was called: flush, say why, wait
  private byeSent = false;
  private reason: Uint8Array = new Uint8Array(0);
  private code = 0;
  private peerClose = false;
  private closeWhy = '';
  private closeCode = 0;

  private inbox: Message[] = [];
  private readers: { resolve: (r: IteratorResult<Message>) => void; reject: (e: unknown) => void }[] = [];
  private eof = false; // no more messages: the iterator ends (or throws err)

  /** @internal use connect(). */
  constructor(url: string, options: ConnectOptions, resolve: (c: Conn) => void, reject: (e: unknown) => void) {
    this.closed = new Promise((r) => (this.resolveClosed = r));
    this.opts = {
      maxMessageSize: options.maxMessageSize ?? DEFAULT_MAX_MESSAGE,
      connectTimeout: options.connectTimeout ?? 10000,
      lostTimeout: options.lostTimeout ?? 15000,
      disconnectTimeout: options.disconnectTimeout ?? 5000,
    };
    this.onmessage = options.onmessage;
    this.onreceipt = options.onreceipt;
    this.resolveConnect = resolve;
    this.rejectConnect = reject;
    this.framer = new Framer(this.opts.maxMessageSize + 4);
    this.pingEvery = Math.min(PING_INTERVAL, this.opts.lostTimeout / 3);
    const t = now();
    this.lastRecv = this.nextPing = t;
    this.deadline = t + this.opts.connectTimeout;
    const payload = bytesOf(options.payload);
    let first: Uint8Array;
    if (options.serverKey !== undefined) {
      const token = options.token ?? new Uint8Array(0);
      if (token.length > MAX_TOKEN_SIZE) throw new TypeError(`knet: a token of ${token.length} bytes: a connect token has at most ${MAX_TOKEN_SIZE}`);
      const key = keyOf(options.serverKey);
      let hs;
      try {
        hs = writeMessage1(key, randomKey(), synPayload(token, payload));
      } catch (e) {
        // A key no X25519 exchange can use (a low-order point).
        throw new TypeError(`knet: serverKey: ${(e as Error).message}`);
      }
      const { msg1, state } = hs;
      this.initiator = state;
      this.needKnet = true;
      // A secure ConnectSyn's content: no cookie (a length of 0), message 1.
      first = encodeFrame(ID_PING_REPLY, helloPayload(HELLO_SECURE, concat(Uint8Array.of(0), msg1)));
    } else {
      if (options.token !== undefined) throw new TypeError('knet: a token needs serverKey: it travels only in a secure handshake');
      this.needKnet = payload.length > 0;
      // The hello and the first ping, in one write.
      first = encodeFrame(ID_PING_REPLY, helloPayload(HELLO_CLIENT, payload));
      this.pingID = 1;
      this.pingSent = t;
      this.nextPing = t + this.pingEvery;
      first = concat(first, encodeFrame(ID_PING_REQUEST, Uint8Array.of(1)));
    }
    const WS = options.WebSocket ?? (globalThis as any).WebSocket;
    if (typeof WS !== 'function') throw new TypeError('knet: no WebSocket: pass options.WebSocket');
    this.ws = new WS(url);
    this.ws.binaryType = 'arraybuffer';
    this.ws.onopen = () => {
      if (this.phase === 'ended') return;
      // The first ping's time is its write's: the RTT leaves out the
      // WebSocket's own handshake, as Go's does.
      if (this.pingSent >= 0) this.pingSent = now();
      this.write(first);
    };
    this.ws.onmessage = (ev) => this.onData(ev.data);
    this.ws.onclose = (ev) => this.onClose(ev.code, ev.reason);
    this.ws.onerror = () => {}; // onclose follows with the code
    this.arm();
  }

  /** Whether the session is encrypted and the server authenticated (serverKey). */
  get secure(): boolean {
    return this.seal !== null;
  }

  /** The round-trip time of the last ping answered, in ms (0 before one). */
  get rtt(): number {
    return this.rttMs;
  }

  /** Bytes waiting to be written: queued messages and the WebSocket's buffer. */
  get bufferedAmount(): number {
    return this.qBytes + this.ws.bufferedAmount;
  }

  /** How the connection ended, or null while it is open. */
  get error(): KnetError | null {
    return this.phase === 'ended' ? this.err : null;
  }

  /** Sends a ping now and resolves with the round-trip time once the server answers it. */
  ping(): Promise<number> {
    if (this.phase !== 'open') return Promise.reject(this.err ?? new ClosedError());
    const p = new Promise<number>((resolve, reject) => this.pingWaiters.push({ resolve, reject }));
    this.sendPing(now());
    this.schedulePump();
    return p;
  }

  /**
   * Queues a message and returns its ref (for dependsOn, and its receipt).
   * It throws when the connection has ended or is closing, for an ID
   * outside 6..0x3FFFFFFA, or for a payload over maxMessageSize.
   */
  send(id: number, payload: Uint8Array | string, options: SendOptions = {}): number {
    if (this.phase !== 'open' || this.closing) {
      throw this.err ?? (this.peerClose ? new DisconnectError(this.closeCode, this.closeWhy) : new ClosedError());
    }
    if (!Number.isInteger(id) || id < MIN_MESSAGE_ID || id > MAX_MESSAGE_ID) {
      throw new RangeError(`knet: message ID ${id} is reserved (the application's are ${MIN_MESSAGE_ID} to ${MAX_MESSAGE_ID})`);
    }
    const p = typeof payload === 'string' ? enc.encode(payload) : payload.slice();
    if (p.length > this.opts.maxMessageSize) {
      throw new RangeError(`knet: message too large: ${p.length} bytes, the limit ${this.opts.maxMessageSize}`);
    }
    const priority = options.priority ?? 0;
    const channel = options.channel ?? 0;
    if (!Number.isInteger(priority) || priority < -128 || priority > 127) throw new RangeError('knet: priority is -128 to 127');
    if (!Number.isInteger(channel) || channel < 0 || channel > 255) throw new RangeError('knet: channel is 0 to 255');
    const after = options.dependsOn ?? [];
    if (after.length > 16) throw new RangeError('knet: at most 16 dependencies');
    for (const r of after) if (!(r > 0 && r <= this.lastRef)) throw new RangeError(`knet: dependency ${r} names no message sent`);
    const m: OutMsg = {
      ref: ++this.lastRef,
      id,
      payload: p,
      reliable: options.reliable ?? false,
      inOrder: options.inOrder ?? false,
      channel,
      contentId: (options.contentId ?? 0) >>> 0,
      priority,
      after,
    };
    this.enqueue(m);
    this.schedulePump();
    return m.ref;
  }

  /**
   * Closes the connection, telling the server why (a reason, and a code
   * other than 0 as Go's CloseWithError does): what is queued is written
   * first. Resolves once the server answered, or the disconnect timeout
   * passed.
   */
  close(reason = '', code = 0): Promise<KnetError> {
    if (!Number.isInteger(code) || code < 0 || code > 0xffffffff) throw new RangeError('knet: a close code is a u32');
    if (this.phase === 'opening') {
      this.fail(new ClosedError('knet: closed before the server answered'));
    } else if (this.phase === 'open' && !this.closing) {
      this.closing = true;
      this.reason = reasonBytes(reason);
      this.code = code;
      this.schedulePump();
    }
    return this.closed;
  }

  /** @internal connect's AbortSignal: ends an attempt not yet answered. */
  abort(): void {
    if (this.phase === 'opening') this.fail(new ClosedError('knet: the attempt was aborted'));
  }

  /** The next message; it rejects with how the connection ended, once it has and every message was read. */
  async receive(): Promise<Message> {
    const r = await this.next();
    if (r.done) throw this.err ?? new ClosedError();
    return r.value;
  }

  [Symbol.asyncIterator](): AsyncIterator<Message> {
    return { next: () => this.next(), return: async () => ({ done: true, value: undefined }) };
  }

  /** The iterator's next: messages in arrival order; done after a graceful end, rejected after a failure. */
  private next(): Promise<IteratorResult<Message>> {
    const m = this.inbox.shift();
    if (m) return Promise.resolve({ done: false, value: m });
    if (this.eof) return this.endOfMessages();
    return new Promise((resolve, reject) => this.readers.push({ resolve, reject }));
  }

  private endOfMessages(): Promise<IteratorResult<Message>> {
    const e = this.err;
    if (e && !(e instanceof ClosedError || e instanceof DisconnectError)) return Promise.reject(e);
    return Promise.resolve({ done: true, value: undefined });
  }

  private deliver(m: Message): void {
    this.stats.messagesReceived++;
    if (this.onmessage) {
      try {
        this.onmessage(m);
      } catch (e) {
        // The application's failure, not the connection's: reported
        // as an event handler's would be, and the stream goes on.
        const report = (globalThis as any).reportError;
        if (typeof report === 'function') report(e);
        else
          queueMicrotask(() => {
            throw e;
          });
      }
      return;
    }
    const r = this.readers.shift();
    if (r) r.resolve({ done: false, value: m });
    else this.inbox.push(m);
  }

  private endMessages(): void {
    if (this.eof) return;
    this.eof = true;
    for (const r of this.readers.splice(0)) this.endOfMessages().then(r.resolve, r.reject);
  }

  // --- Receiving ---

  private onData(data: unknown): void {
    if (this.phase === 'ended') return;
    if (!(data instanceof ArrayBuffer)) {
      // Go closes on a text message (1003).
      this.fail(new ProtocolError('a text message on a binary stream'));
      return;
    }
    const p = new Uint8Array(data);
    this.stats.bytesReceived += p.length;
    this.lastRecv = now();
    this.framer.feed(p);
    try {
      for (let body = this.framer.next(); body; body = this.framer.next()) {
        this.frame(body);
        if ((this.phase as Phase) === 'ended') return;
      }
    } catch (e) {
      this.fail(e instanceof KnetError ? e : new ProtocolError(String(e)));
      return;
    }
    this.schedulePump();
  }

  private frame(body: Uint8Array): void {
    if (this.framer.sealed) {
      const pt = this.seal!.open(body);
      if (!pt) throw new ProtocolError('a sealed frame did not authenticate (tampered with, replayed, reordered or another key)');
      body = pt;
    }
    const [id, payload] = splitBody(body);
    if (this.phase === 'opening') {
      this.first(id, payload);
      return;
    }
    this.dispatch(id, payload);
  }

  /** The server's first frame: its answer to the hello. */
  private first(id: number, payload: Uint8Array): void {
    const h = id === ID_PING_REPLY ? parseHello(payload) : null;
    if (this.initiator) {
      if (h?.kind === HELLO_SECURE_ACCEPT) {
        const { payload: p, send, recv } = readMessage2(this.initiator, h.content);
        if (p.length < 4) throw new HandshakeError('no connection ID');
        this.initiator = null;
        this.reply = p.slice(4);
        this.seal = new StreamSeal(send, recv);
        this.framer.sealed = true;
        // A sealed ping at once: the server establishes the connection
        // on the first frame that opens under the keys. It goes alone in
        // its WebSocket message: until it has read it, the server takes
        // frames of at most 4 KiB, and reads no message after the one
        // that carries it; a large message right behind it in the same
        // WebSocket message would end the connection.
        this.sendPing(now());
        this.write(withSize(this.seal.seal(this.ctrl.pop()!)));
        this.established();
      } else if (h?.kind === HELLO_REFUSE) {
        throw new RefusedError(new TextDecoder().decode(h.content));
      } else {
        throw new HandshakeError('the server answered in clear (a server without Config.PrivateKey?)');
      }
      return;
    }
    if (h?.kind === HELLO_ACCEPT) {
      this.reply = h.content.slice();
      this.established();
    } else if (h?.kind === HELLO_REFUSE) {
      throw new RefusedError(new TextDecoder().decode(h.content));
    } else if (this.needKnet) {
      throw new RefusedError('the server speaks kNet without knet\'s hello, and so cannot read the payload');
    } else {
      // The reference's wire: established from the start, the frame as any.
      this.reference = true;
      this.established();
      this.dispatch(id, payload);
    }
  }

  private established(): void {
    this.phase = 'open';
    const r = this.resolveConnect!;
    this.resolveConnect = this.rejectConnect = undefined;
    this.arm();
    r(this);
  }

  private dispatch(id: number, payload: Uint8Array): void {
    switch (id) {
      case ID_PING_REQUEST:
        if (payload.length >= 1 && this.ctrl.length < 64) this.ctrl.push(frameBody(ID_PING_REPLY, payload.subarray(0, 1)));
        return;
      case ID_PING_REPLY: {
        const h = parseHello(payload);
        if (h) {
          this.hello(h.kind, h.content);
        } else if (payload.length >= 1 && payload[0] === this.pingID && this.pingSent >= 0) {
          // Only the reply to the last request counts.
          this.rttMs = now() - this.pingSent;
          this.pingSent = -1;
          for (const w of this.pingWaiters.splice(0)) w.resolve(this.rttMs);
        }
        return;
      }
      default:
        // Every other ID is the application's, reserved ones included.
        // payload is the frame's own copy (Framer.next, or the
        // decryption's output): the application may keep it.
        this.deliver({ id, payload, reliable: false, inOrder: false });
    }
  }

  /** A knet hello once open: the server's close, with its reason and code. */
  private hello(kind: number, content: Uint8Array): void {
    if (kind === HELLO_CLOSE_CODE) {
      if (content.length < 4) {
        content = new Uint8Array(0);
      } else {
        this.closeCode = new DataView(content.buffer, content.byteOffset, 4).getUint32(0, true);
        content = content.subarray(4);
      }
      kind = HELLO_CLOSE;
    }
    if (kind !== HELLO_CLOSE && kind !== HELLO_REFUSE) return;
    if (this.peerClose) return;
    this.peerClose = true;
    this.closeWhy = new TextDecoder().decode(content.subarray(0, MAX_REASON_LENGTH));
    // The peer's end of the stream follows what came before it: the
    // iterator ends, and our side closes once what is queued is written.
    this.endMessages();
    this.closing = true;
    this.schedulePump();
  }

  /** The WebSocket ended: a graceful end of the stream, or a failure (Go's streamEOF). */
  private onClose(code: number, reason: string): void {
    if (this.phase === 'ended') return;
    let e: KnetError;
    if (this.phase === 'opening') {
      if (this.framer.buffered() > 0) {
        e = new ProtocolError(`the stream ended inside the server's first frame (${this.framer.buffered()} bytes of it)`);
      } else if (code === 1000 || code === 1001) {
        e = new RefusedError('the server closed the stream before it answered');
      } else {
        e = new WebSocketError(code, reason);
      }
    } else if (code !== 1000 && code !== 1001 && !(this.peerClose || this.byeSent)) {
      e = new WebSocketError(code, reason);
    } else if (this.framer.buffered() > 0) {
      e = new ProtocolError(`the stream ended inside a frame (${this.framer.buffered()} bytes of it)`);
    } else if (this.seal && !this.peerClose && !this.byeSent) {
      // A secure server says it closes in a sealed frame first: an end
      // without it was cut on the path.
      e = new ProtocolError("the secure stream ended without the peer's sealed close: cut on the path");
    } else if (this.peerClose) {
      e = new DisconnectError(this.closeCode, this.closeWhy);
    } else if (this.byeSent) {
      e = new ClosedError();
    } else {
      e = new DisconnectError(0, '');
    }
    this.finish(e, false);
  }

  // --- Sending ---

  private enqueue(m: OutMsg): void {
    if (!m.reliable && this.qBytes + this.ws.bufferedAmount > UNRELIABLE_LIMIT) {
      this.stats.droppedMessages++;
      this.receipt(m.ref, false);
      return;
    }
    if (m.contentId !== 0 && !m.inOrder && m.after.length === 0) {
      const i = this.q.findIndex(
        (o) => o.id === m.id && o.contentId === m.contentId && o.reliable === m.reliable && !o.inOrder && o.after.length === 0,
      );
      if (i >= 0) {
        // Latest state: the newer replaces the one still queued.
        const [o] = this.q.splice(i, 1);
        this.qBytes -= o.payload.length;
        this.stats.replacedMessages++;
        this.receipt(o.ref, false);
      }
    }
    // Ahead of queued messages of lower priority, never ahead of one it
    // depends on: an earlier in-order one of its channel, or one it names.
    let i = this.q.length;
    while (i > 0 && this.q[i - 1].priority < m.priority && !dependsOn(m, this.q[i - 1])) i--;
    this.q.splice(i, 0, m);
    this.qBytes += m.payload.length;
    this.stats.messagesSent++;
  }

  private receipt(ref: number, delivered: boolean): void {
    this.onreceipt?.({ ref, delivered });
  }

  private sendPing(t: number): void {
    this.pingID = (this.pingID + 1) & 0xff;
    this.pingSent = t;
    this.ctrl.push(frameBody(ID_PING_REQUEST, Uint8Array.of(this.pingID)));
    this.nextPing = t + this.pingEvery;
  }

  private schedulePump(): void {
    if (this.pumpScheduled) return;
    this.pumpScheduled = true;
    queueMicrotask(() => {
      this.pumpScheduled = false;
      this.pump();
    });
  }

  /**
   * Writes what waits, as Go's stream writer does: control frames first,
   * then the queue in order, one WebSocket message of up to 64 KiB (or one
   * larger frame) at a time while the WebSocket holds less than that.
   * Once a closing connection has written everything, it says its close
   * hello (or, after the server's, ends the WebSocket).
   */
  private pump(): void {
    if (this.phase !== 'open') return;
    if (this.byeSent) {
      // Nothing goes after our close hello, as nothing goes after Go's
      // (pings the server sends meanwhile go unanswered).
      this.ctrl.length = 0;
      return;
    }
    const parts: Uint8Array[] = [];
    let n = 0;
    const add = (body: Uint8Array) => {
      const f = this.seal ? withSize(this.seal.seal(body)) : withSize(body);
      parts.push(f);
      n += f.length;
    };
    for (const b of this.ctrl) add(b);
    this.ctrl.length = 0;
    const sent: number[] = [];
    while (this.q.length > 0 && this.ws.bufferedAmount + n < WRITE_MAX) {
      const m = this.q.shift()!;
      this.qBytes -= m.payload.length;
      add(frameBody(m.id, m.payload));
      sent.push(m.ref);
    }
    if (this.closing && this.q.length === 0 && !this.peerClose && !this.byeSent) {
      // The server hears of the close, and why, in a frame: a WebSocket
      // has no half-close to say it with; over a secure stream an end
      // without it is a cut.
      let content: Uint8Array = this.reason;
      let kind = HELLO_CLOSE;
      if (this.code !== 0) {
        kind = HELLO_CLOSE_CODE;
        content = concat(new Uint8Array(4), this.reason);
        new DataView(content.buffer).setUint32(0, this.code, true);
      }
      add(frameBody(ID_PING_REPLY, helloPayload(kind, content)));
      this.byeSent = true;
      this.deadline = now() + this.opts.disconnectTimeout;
      this.arm();
    }
    if (n > 0) this.write(parts.length === 1 ? parts[0] : concat(...parts));
    for (const r of sent) this.receipt(r, true);
    if (this.q.length > 0) {
      // Browsers tell nothing when the WebSocket's buffer drains: look again shortly.
      if (this.pumpTimer === undefined) {
        this.pumpTimer = setTimeout(() => {
          this.pumpTimer = undefined;
          this.pump();
        }, 4);
      }
    } else if (this.closing && this.peerClose) {
      // The server closed first: once what we had is written, our end
      // of the stream answers its close.
      this.ws.close(1000);
    }
  }

  private write(b: Uint8Array): void {
    this.stats.bytesSent += b.length;
    this.ws.send(b);
  }

  // --- Timers and the end ---

  /** Sets the one timer: the next ping, the silence limit, the opening's or the close's deadline. */
  private arm(): void {
    clearTimeout(this.timer);
    if (this.phase === 'ended') return;
    let at = this.lastRecv + this.opts.lostTimeout;
    if (this.phase === 'opening' || this.byeSent) at = Math.min(at, this.deadline);
    if (this.phase === 'open' && !this.byeSent) at = Math.min(at, this.nextPing);
    this.timer = setTimeout(() => this.tick(), Math.max(0, at - now()) + 1);
  }

  private tick(): void {
    if (this.phase === 'ended') return;
    const t = now();
    if (this.phase === 'opening' && t >= this.deadline) {
      this.fail(new TimeoutError('connect', this.opts.connectTimeout));
      return;
    }
    if (this.byeSent && t >= this.deadline) {
      this.fail(new TimeoutError('disconnect', this.opts.disconnectTimeout));
      return;
    }
    if (t - this.lastRecv >= this.opts.lostTimeout) {
      this.fail(new TimeoutError('', t - this.lastRecv));
      return;
    }
    if (this.phase === 'open' && !this.byeSent && t >= this.nextPing) {
      this.sendPing(t);
      this.schedulePump();
    }
    this.arm();
  }

  /** Ends the connection on a failure: the WebSocket closes as Go's does (1000). */
  private fail(e: KnetError): void {
    this.finish(e, true);
  }

  private finish(e: KnetError, closeWS: boolean): void {
    if (this.phase === 'ended') return;
    const wasOpening = this.phase === 'opening';
    this.phase = 'ended';
    this.err = e;
    clearTimeout(this.timer);
    clearTimeout(this.pumpTimer);
    if (closeWS) {
      try {
        this.ws.close(1000);
      } catch {
        // already closing
      }
    }
    for (const m of this.q.splice(0)) this.receipt(m.ref, false);
    this.qBytes = 0;
    this.endMessages();
    for (const w of this.pingWaiters.splice(0)) w.reject(e);
    if (wasOpening && this.rejectConnect) {
      const r = this.rejectConnect;
      this.resolveConnect = this.rejectConnect = undefined;
      r(e);
    }
    this.resolveClosed(e);
  }
}

function dependsOn(m: OutMsg, o: OutMsg): boolean {
  return (m.inOrder && o.inOrder && m.channel === o.channel) || m.after.includes(o.ref);
}
