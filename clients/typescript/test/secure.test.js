// Secure sessions against a Go server: Noise NK under the server's static
// key, connect tokens, sealed frames; refusals; frames tampered with or
// replayed on the way, both ways, end the connection.

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { startServer, WebSocket, u32le, text, take, concat } from './helpers.js';
import { connect, RefusedError, DisconnectError, ClosedError, ProtocolError, WebSocketError } from '../dist/index.js';

let srv;
before(async () => {
  srv = await startServer();
});
after(async () => {
  await srv.stop();
});

async function dial(name, opts = {}) {
  const token = opts.token ?? (await srv.token(opts.client ?? 1, opts.data ?? ''));
  return connect(srv.secure, { WebSocket, serverKey: srv.serverKey, payload: name, ...opts, token });
}

const failure = (p) =>
  p.then(
    () => assert.fail('connected'),
    (e) => e,
  );

/**
 * A WebSocket with someone on the path: once armed, it hands each
 * message it sends to out, and each it receives to inc, which may change,
 * repeat or pass them.
 */
function onPath() {
  const path = { armed: false, out: null, inc: null, sent: [] };
  path.WebSocket = class extends WebSocket {
    send(data) {
      const b = new Uint8Array(data);
      path.sent.push(b.slice());
      if (path.armed && path.out) path.out(b, (x) => super.send(x));
      else super.send(b);
    }
    get onmessage() {
      return super.onmessage;
    }
    set onmessage(fn) {
      super.onmessage = (ev) => {
        if (path.armed && path.inc && ev.data instanceof ArrayBuffer) path.inc(new Uint8Array(ev.data), (b) => fn({ data: b.slice().buffer }));
        else fn(ev);
      };
    }
  };
  return path;
}

test('a secure session: the token and payload reach the Admit hook, every mode crosses sealed', async () => {
  const c = await dial('secure-1', { client: 42, data: 'team blue' });
  assert.equal(c.secure, true);
  assert.equal(text(c.reply), 'welcome secure-1 client 42 data "team blue"');
  const acc = await srv.accepted('secure-1');
  assert.equal(acc.secure, true);
  const sent = [];
  for (const [i, o] of [{ reliable: true }, { reliable: true, inOrder: true }, {}, { inOrder: true }, { contentId: 3 }, { priority: 4 }].entries()) {
    c.send(10, `mode ${i}`, o);
    sent.push(`mode ${i}`);
    await new Promise((r) => setImmediate(r));
  }
  const big = new Uint8Array(2 << 20).map((_, i) => i % 251);
  c.send(10, big, { reliable: true });
  const got = await take(c, sent.length + 1);
  assert.deepEqual(
    got.slice(0, -1).map((m) => text(m.payload)),
    sent,
  );
  assert.equal(got.at(-1).payload.length, big.length);
  assert.ok(got.at(-1).payload.every((x, i) => x === big[i]));
  assert.ok((await c.ping()) > 0);
  await c.close('done here', 12);
  const ev = await srv.ended('secure-1');
  assert.equal(ev.kind, 'disconnect');
  assert.equal(ev.code, 12);
  assert.equal(ev.reason, 'done here');
  assert.ok((await c.closed) instanceof ClosedError);
});

test('a large message sent the moment the connection opens', async () => {
  // The server takes frames of at most 4 KiB until the client's first
  // sealed frame has proved it holds the keys: the proof goes alone.
  const c = await dial('large-first');
  c.send(10, new Uint8Array(100000).fill(3), { reliable: true });
  const [m] = await take(c, 1);
  assert.equal(m.payload.length, 100000);
  await c.close();
});

test('a token gets in once: the second use is refused', async () => {
  const token = await srv.token(7);
  const c = await dial('once', { token });
  await c.close();
  const err = await failure(dial('twice', { token }));
  assert.ok(err instanceof RefusedError, String(err));
  assert.ok(err.tokenRejected);
  assert.match(err.reason, /already used/);
});

test('a secure server refuses a client without a token, a clear client, and one with another key', async () => {
  let err = await failure(connect(srv.secure, { WebSocket, serverKey: srv.serverKey, payload: 'no token' }));
  assert.ok(err instanceof RefusedError && err.tokenRejected, String(err));
  assert.match(err.reason, /missing/);

  err = await failure(connect(srv.secure, { WebSocket, payload: 'clear' }));
  assert.ok(err instanceof RefusedError, String(err));
  assert.match(err.reason, /takes no plaintext/);

  const other = new Uint8Array(32).fill(9);
  err = await failure(dial('other key', { serverKey: other }));
  assert.ok(err instanceof RefusedError, String(err));
  assert.equal(err.reason, 'knet: secure handshake failed');
});

test('the server closes a secure session with a code: a sealed close hello', async () => {
  const c = await dial('secure-kick');
  c.send(11, concat(u32le(99), new TextEncoder().encode('round over')));
  const e = await c.closed;
  assert.ok(e instanceof DisconnectError, String(e));
  assert.equal(e.code, 99);
  assert.equal(e.reason, 'round over');
});

test('a frame tampered with on the way to the server ends the connection', async () => {
  const path = onPath();
  const c = await dial('tamper-out', { WebSocket: path.WebSocket });
  c.send(10, 'clean', { reliable: true });
  await take(c, 1);
  path.out = (b, pass) => {
    b[b.length - 1] ^= 1; // the last frame's tag
    pass(b);
  };
  path.armed = true;
  c.send(10, 'changed on the way', { reliable: true });
  const ev = await srv.ended('tamper-out');
  assert.equal(ev.kind, 'protocol', ev.err);
  assert.match(ev.err, /did not authenticate/);
  assert.ok(ev.invalid >= 1);
  const e = await c.closed;
  assert.ok(e instanceof ProtocolError, String(e));
  assert.match(e.message, /without the peer's sealed close/);
});

test('a frame replayed to the server ends the connection', async () => {
  const path = onPath();
  const c = await dial('replay-out', { WebSocket: path.WebSocket });
  path.out = (b, pass) => {
    pass(b);
    pass(b); // again: its nonce is spent
  };
  path.armed = true;
  c.send(10, 'once', { reliable: true });
  const ev = await srv.ended('replay-out');
  assert.equal(ev.kind, 'protocol', ev.err);
  assert.ok(ev.invalid >= 1);
  // The first copy was read and echoed; then the end, a failure: the
  // server's end comes without its sealed close (a ProtocolError), or,
  // when the server's WebSocket library drops the TCP connection without
  // the close handshake while it writes the echo, abnormally (1006), as
  // Go's DialWebSocket reads it too.
  const got = [];
  const e = await (async () => {
    try {
      for await (const m of c) got.push(text(m.payload));
    } catch (e) {
      return e;
    }
    return null;
  })();
  assert.ok(e instanceof ProtocolError || (e instanceof WebSocketError && e.code === 1006), String(e));
  assert.equal(await c.closed, e);
  assert.ok(got.length <= 1);
});

test('a frame tampered with on the way to the client ends the connection', async () => {
  const path = onPath();
  const c = await dial('tamper-in', { WebSocket: path.WebSocket });
  path.inc = (b, pass) => {
    b[b.length - 1] ^= 1;
    pass(b);
  };
  path.armed = true;
  c.send(10, 'echo me', { reliable: true });
  const e = await c.closed;
  assert.ok(e instanceof ProtocolError, String(e));
  assert.match(e.message, /did not authenticate/);
  await assert.rejects(c.receive(), ProtocolError);
  const ev = await srv.ended('tamper-in');
  assert.equal(ev.kind, 'protocol', 'the client ended without its sealed close: a cut, for the server');
});

test('a frame replayed to the client ends the connection', async () => {
  const path = onPath();
  const c = await dial('replay-in', { WebSocket: path.WebSocket });
  path.inc = (b, pass) => {
    pass(b);
    pass(b);
  };
  path.armed = true;
  c.send(10, 'echo me', { reliable: true });
  const e = await c.closed;
  assert.ok(e instanceof ProtocolError, String(e));
  assert.match(e.message, /did not authenticate/);
  await srv.ended('replay-in');
});

test('the first frames: a secure client says kind 5 and nothing else until the answer', async () => {
  const path = onPath();
  const c = await dial('first', { WebSocket: path.WebSocket });
  assert.ok(path.sent.length >= 2);
  const first = path.sent[0];
  // size, PingReply, pingID 0, "kNT", version 1, kind 5, no cookie
  assert.deepEqual([...first.subarray(first[0] < 0x80 ? 1 : 2, (first[0] < 0x80 ? 1 : 2) + 8)], [2, 0, 0x6b, 0x4e, 0x54, 1, 5, 0]);
  await c.close();
});
