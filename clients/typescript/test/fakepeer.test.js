// The client against scripted peers (the ws package's server): what the
// client writes first, and how it takes a server that breaks the rules
// or stays silent. Timeouts here are the client's own timers, short.

import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { WebSocketServer } from 'ws';
import { WebSocket, hex, toHex, concat } from './helpers.js';
import { connect, TimeoutError, ProtocolError, RefusedError, HandshakeError, DisconnectError, ClosedError } from '../dist/index.js';
import { encodeFrame, helloPayload } from '../dist/wire.js';

const peers = new Set();
// A test that failed left its peer up: end it, and its connections, so
// that the file ends.
after(async () => {
  for (const p of peers) await p.stop();
});

/** Runs a peer that hands each connection to script; resolves with its URL and a stop. */
async function peer(script) {
  const wss = new WebSocketServer({ port: 0, host: '127.0.0.1' });
  await new Promise((r) => wss.once('listening', r));
  wss.on('connection', (ws) => {
    const first = new Promise((r) => ws.once('message', (d) => r(new Uint8Array(d))));
    script(ws, first);
  });
  const p = {
    url: `ws://127.0.0.1:${wss.address().port}/`,
    stop: () => {
      peers.delete(p);
      for (const ws of wss.clients) ws.terminate();
      return new Promise((r) => wss.close(r));
    },
  };
  peers.add(p);
  return p;
}

const accept = (reply = '') => encodeFrame(2, helloPayload(2, new TextEncoder().encode(reply)));

test("the client's first write: its hello with the payload, then its first ping", async () => {
  let got;
  const p = await peer(async (ws, first) => {
    got = await first;
    ws.send(accept('hi'));
  });
  const c = await connect(p.url, { WebSocket, payload: 'abc' });
  // size 10, PingReply, 00 kNT 01, kind 1, 'abc'; then size 2, PingRequest, pingID 1
  assert.equal(toHex(got), '0a02006b4e54010161626302' + '0101');
  c.close();
  await p.stop();
});

test('a server that never answers: a connect timeout', async () => {
  const p = await peer(() => {});
  const err = await connect(p.url, { WebSocket, connectTimeout: 200 }).catch((e) => e);
  assert.ok(err instanceof TimeoutError, String(err));
  assert.equal(err.op, 'connect');
  await p.stop();
});

test('a server that goes silent: the connection is lost', async () => {
  const p = await peer(async (ws, first) => {
    await first;
    ws.send(accept());
  });
  const c = await connect(p.url, { WebSocket, lostTimeout: 300 });
  const e = await c.closed;
  assert.ok(e instanceof TimeoutError, String(e));
  assert.equal(e.op, '');
  await assert.rejects(c.receive(), TimeoutError);
  await p.stop();
});

test('a text message ends the connection', async () => {
  const p = await peer(async (ws, first) => {
    await first;
    ws.send(accept());
    ws.send('text');
  });
  const c = await connect(p.url, { WebSocket });
  const e = await c.closed;
  assert.ok(e instanceof ProtocolError, String(e));
  await p.stop();
});

test('a stream that ends inside a frame is a protocol error', async () => {
  const p = await peer(async (ws, first) => {
    await first;
    ws.send(concat(accept(), hex('0a0a41'))); // a frame of 10 bytes, 2 of them
    ws.close(1000);
  });
  const c = await connect(p.url, { WebSocket });
  const e = await c.closed;
  assert.ok(e instanceof ProtocolError, String(e));
  assert.match(e.message, /inside a frame/);
  await p.stop();
});

test("the server's end of the stream without a close hello: closed by the peer", async () => {
  const p = await peer(async (ws, first) => {
    await first;
    ws.send(concat(accept(), encodeFrame(20, hex('01'))));
    ws.close(1000);
  });
  const c = await connect(p.url, { WebSocket });
  const [m] = await (async () => {
    const got = [];
    for await (const m of c) got.push(m);
    return got;
  })();
  assert.equal(m.id, 20);
  const e = await c.closed;
  assert.ok(e instanceof DisconnectError, String(e));
  assert.equal(e.code, 0);
  assert.equal(e.reason, '');
  await p.stop();
});

test('a server of the reference wire (no hello): established, its first frame delivered; not with a payload', async () => {
  const p = await peer(async (ws, first) => {
    await first;
    ws.send(concat(encodeFrame(1, hex('01')), encodeFrame(30, hex('ff'))));
  });
  const c = await connect(p.url, { WebSocket });
  assert.equal(c.reference, true);
  const m = await c.receive();
  assert.equal(m.id, 30);
  c.close();
  const err = await connect(p.url, { WebSocket, payload: 'needs knet' }).catch((e) => e);
  assert.ok(err instanceof RefusedError, String(err));
  await p.stop();
});

test('a secure client never takes an answer in clear, nor one that does not authenticate', async () => {
  const key = new Uint8Array(32).fill(5);
  let p = await peer(async (ws, first) => {
    await first;
    ws.send(accept());
  });
  let err = await connect(p.url, { WebSocket, serverKey: key }).catch((e) => e);
  assert.ok(err instanceof HandshakeError, String(err));
  assert.match(err.message, /in clear/);
  await p.stop();

  p = await peer(async (ws, first) => {
    await first;
    ws.send(encodeFrame(2, helloPayload(6, new Uint8Array(60).fill(1))));
  });
  err = await connect(p.url, { WebSocket, serverKey: key }).catch((e) => e);
  assert.ok(err instanceof HandshakeError, String(err));
  assert.match(err.message, /did not prove/);
  await p.stop();
});

test('a refusal before an answer: the WebSocket closed', async () => {
  const p = await peer(async (ws, first) => {
    await first;
    ws.close(1000);
  });
  const err = await connect(p.url, { WebSocket }).catch((e) => e);
  assert.ok(err instanceof RefusedError, String(err));
  await p.stop();
});

test('an attempt aborted while the server has not answered', async () => {
  const ac = new AbortController();
  let seen;
  const helloSeen = new Promise((r) => (seen = r));
  const p = await peer(async (ws, first) => {
    await first;
    seen();
  });
  const attempt = connect(p.url, { WebSocket, signal: ac.signal });
  await helloSeen;
  ac.abort();
  await assert.rejects(attempt, (e) => e instanceof ClosedError && /aborted/.test(e.message));
  await p.stop();
});

test('a ping waiting for its answer fails with the connection', async () => {
  let peerWS;
  const p = await peer(async (ws, first) => {
    await first;
    peerWS = ws;
    ws.send(accept());
  });
  const c = await connect(p.url, { WebSocket });
  const waiting = c.ping();
  peerWS.send(hex('00')); // a frame of size 0
  await assert.rejects(waiting, ProtocolError);
  await p.stop();
});

test('keys and tokens the client cannot use are refused before anything is sent', async () => {
  await assert.rejects(connect('ws://127.0.0.1:1/', { WebSocket, serverKey: new Uint8Array(31) }), /32 bytes/);
  await assert.rejects(connect('ws://127.0.0.1:1/', { WebSocket, serverKey: 'zz' }), /hex/);
  await assert.rejects(connect('ws://127.0.0.1:1/', { WebSocket, serverKey: new Uint8Array(32) }), /serverKey/, 'the zero point');
  await assert.rejects(
    connect('ws://127.0.0.1:1/', { WebSocket, serverKey: new Uint8Array(32).fill(9), token: new Uint8Array(461) }),
    /at most 460/,
  );
});

test('a close the server never answers: the close hello on the wire, then a disconnect timeout', async () => {
  let closeHello;
  const gotIt = new Promise((r) => (closeHello = r));
  const p = await peer(async (ws, first) => {
    await first;
    ws.on('message', (d) => {
      const b = new Uint8Array(d);
      if (b[1] === 2 && b[2] === 0) closeHello(b); // a PingReply with pingID 0: a hello
    });
    ws.send(accept());
  });
  const c = await connect(p.url, { WebSocket, disconnectTimeout: 300 });
  const closing = c.close('later', 258);
  // size 16, PingReply, 00 kNT 01, kind 7, code 258 little-endian, "later"
  assert.equal(toHex(await gotIt), '1002006b4e54010702010000' + '6c61746572');
  const e = await closing;
  assert.ok(e instanceof TimeoutError, String(e));
  assert.equal(e.op, 'disconnect');
  assert.throws(() => c.send(10, 'x'), TimeoutError);
  await p.stop();
});

test('nothing goes after the close hello: a ping that comes then goes unanswered', async () => {
  let closeHello, later;
  const gotHello = new Promise((r) => (closeHello = r));
  const gotLater = new Promise((r) => (later = r));
  const p = await peer(async (ws, first) => {
    await first;
    let bye = false;
    ws.on('message', (d) => {
      const b = new Uint8Array(d);
      if (bye) later(b);
      else if (b[1] === 2 && b[2] === 0) {
        bye = true;
        closeHello(ws);
      }
    });
    ws.send(accept());
  });
  const c = await connect(p.url, { WebSocket, disconnectTimeout: 300 });
  const closing = c.close('bye');
  const ws = await gotHello;
  // A ping after the close, and no end from us: the client gives up
  // waiting and ends its WebSocket, after which no answer can come; any
  // answer to the ping would have come before.
  ws.send(encodeFrame(1, hex('09')));
  const e = await closing;
  assert.ok(e instanceof TimeoutError && e.op === 'disconnect', String(e));
  const answered = await Promise.race([gotLater.then(() => true), new Promise((r) => ws.once('close', () => r(false)))]);
  assert.equal(answered, false);
  await p.stop();
});

test('receipts: messages still waiting when the connection ends are lost', async () => {
  // A WebSocket whose buffer never drains (a stalled network): nothing
  // the client queues can be written.
  class Stalled extends WebSocket {
    get bufferedAmount() {
      return 1 << 20;
    }
  }
  let peerWS;
  const p = await peer(async (ws, first) => {
    await first;
    peerWS = ws;
    ws.send(accept());
  });
  const receipts = [];
  const c = await connect(p.url, { WebSocket: Stalled, onreceipt: (r) => receipts.push(r) });
  const a = c.send(10, 'a', { reliable: true });
  const b = c.send(10, 'b', { reliable: true, priority: 1 });
  const u = c.send(10, 'u'); // unreliable behind a full stream: dropped at once
  assert.deepEqual(receipts, [{ ref: u, delivered: false }]);
  peerWS.close(1000);
  const e = await c.closed;
  assert.ok(e instanceof DisconnectError, String(e));
  assert.deepEqual(receipts.slice(1), [
    { ref: b, delivered: false },
    { ref: a, delivered: false },
  ]);
  assert.equal(c.stats.droppedMessages, 1);
});
