// The client against a Go server over plaintext WebSocket: the opening,
// every delivery mode as it becomes over a stream, large messages,
// receipts, pings and RTT, refusals and closes both ways.

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { startServer, WebSocket, u32le, text, take, concat } from './helpers.js';
import { connect, RefusedError, DisconnectError, ClosedError, WebSocketError } from '../dist/index.js';

let srv;
before(async () => {
  srv = await startServer();
});
after(async () => {
  await srv.stop();
});

const dial = (name, opts = {}) => connect(srv.plain, { WebSocket, payload: name, ...opts });

test('the hello, the Admit reply, a plaintext session', async () => {
  const c = await dial('hello');
  assert.equal(text(c.reply), 'welcome hello');
  assert.equal(c.secure, false);
  assert.equal(c.reference, false);
  const acc = await srv.accepted('hello');
  assert.equal(acc.transport, 'websocket');
  assert.equal(acc.secure, false);
  c.send(13, '');
  const [info] = await take(c, 1);
  const i = JSON.parse(text(info.payload));
  assert.equal(i.payload, 'hello', 'the server read the ConnectPayload');
  await c.close();
});

test('every delivery mode crosses, in order, read as neither reliable nor in order', async () => {
  const c = await dial('modes');
  const modes = [
    { reliable: true },
    { reliable: true, inOrder: true },
    { reliable: true, inOrder: true, channel: 3 },
    {},
    { inOrder: true },
    { inOrder: true, channel: 9 },
    { contentId: 5 },
    { reliable: true, contentId: 6 },
    { priority: 5 },
  ];
  const sent = [];
  for (let round = 0; round < 20; round++) {
    for (const [i, o] of modes.entries()) {
      const p = `m${round}.${i}`;
      c.send(10, p, o);
      sent.push(p);
      // One message per turn of the event loop: nothing waits to be
      // replaced or reordered, so all come back as sent.
      await new Promise((r) => setImmediate(r));
    }
  }
  const got = await take(c, sent.length);
  assert.deepEqual(
    got.map((m) => text(m.payload)),
    sent,
  );
  for (const m of got) {
    assert.equal(m.id, 10);
    assert.equal(m.reliable, false);
    assert.equal(m.inOrder, false);
  }
  assert.equal(c.stats.messagesSent, sent.length);
  assert.equal(c.stats.messagesReceived, sent.length);
  await c.close();
});

test('latest state: a newer version replaces the one still queued', async () => {
  const c = await dial('latest');
  const receipts = new Map();
  c.onreceipt = (r) => receipts.set(r.ref, r.delivered);
  // Sent in one turn: all wait in the queue together.
  const refs = [1, 2, 3, 4].map((v) => c.send(10, `pos${v}`, { contentId: 7 }));
  const other = c.send(10, 'other', { contentId: 8 });
  const [a, b] = await take(c, 2);
  assert.deepEqual([text(a.payload), text(b.payload)], ['pos4', 'other']);
  assert.equal(c.stats.replacedMessages, 3);
  assert.deepEqual(
    refs.map((r) => receipts.get(r)),
    [false, false, false, true],
    'the replaced versions are lost, the last delivered',
  );
  assert.equal(receipts.get(other), true);
  await c.close();
});

test('priority orders what waits, never ahead of what a message depends on', async () => {
  const c = await dial('priority');
  c.send(10, 'low1', { reliable: true });
  const dep = c.send(10, 'low2', { reliable: true });
  c.send(10, 'io1', { reliable: true, inOrder: true, channel: 1 });
  c.send(10, 'high', { reliable: true, priority: 10 });
  c.send(10, 'io2', { reliable: true, inOrder: true, channel: 1, priority: 20 });
  c.send(10, 'after', { reliable: true, priority: 30, dependsOn: [dep] });
  // As Go's queue orders them: high passes everything; io2 stops behind
  // io1, its channel's; after behind low2, which it names.
  const got = (await take(c, 6)).map((m) => text(m.payload));
  assert.deepEqual(got, ['high', 'low1', 'low2', 'after', 'io1', 'io2']);
  await c.close();
});

test('unreliable messages are dropped at the sender behind 64 KiB waiting, reliable ones never', async () => {
  const c = await dial('dropping');
  const receipts = new Map();
  c.onreceipt = (r) => receipts.set(r.ref, r.delivered);
  const big = new Uint8Array(200 << 10);
  const rel = c.send(10, big, { reliable: true });
  const unrel = [];
  for (let i = 0; i < 10; i++) unrel.push(c.send(10, `u${i}`));
  const last = c.send(10, 'last', { reliable: true });
  const got = await take(c, 2);
  assert.equal(got[0].payload.length, big.length);
  assert.equal(text(got[1].payload), 'last');
  assert.equal(c.stats.droppedMessages, 10);
  assert.ok(unrel.every((r) => receipts.get(r) === false));
  assert.equal(receipts.get(rel), true);
  assert.equal(receipts.get(last), true);
  await c.close();
});

test('large messages: megabytes each way, cut across WebSocket messages', async () => {
  const c = await dial('large');
  const big = new Uint8Array(3 << 20);
  for (let i = 0; i < big.length; i++) big[i] = (i * 31) & 0xff;
  c.send(10, big, { reliable: true });
  c.send(10, 'behind it', { reliable: true });
  const [m, n] = await take(c, 2);
  assert.equal(m.payload.length, big.length);
  assert.ok(m.payload.every((x, i) => x === big[i]));
  assert.equal(text(n.payload), 'behind it');
  // The server's burst: 40 messages of 100 KB, in order.
  c.send(12, u32le(40, 100000));
  const burst = await take(c, 40);
  burst.forEach((m, i) => {
    assert.equal(m.id, 12);
    assert.equal(m.payload.length, 100000);
    assert.equal(new DataView(m.payload.buffer, m.payload.byteOffset).getUint32(0, true), i);
  });
  await c.close();
});

test('a message over maxMessageSize is refused by the sender, and the receiver ends on one', async () => {
  const c = await dial('toolarge', { maxMessageSize: 1000 });
  assert.throws(() => c.send(10, new Uint8Array(1001)), RangeError);
  assert.throws(() => c.send(5, 'reserved'), RangeError);
  c.send(12, u32le(1, 5000)); // the server sends 5000 bytes: over our limit
  const err = await c.closed;
  assert.match(err.message, /over the limit/);
  await assert.rejects(c.receive(), /over the limit/);
  const ev = await srv.ended('toolarge');
  assert.notEqual(ev.kind, 'disconnect');
});

test('pings measure the RTT', async () => {
  const c = await dial('ping');
  const rtt = await c.ping();
  assert.ok(rtt > 0, `rtt ${rtt}`);
  assert.equal(c.rtt, rtt);
  await c.close();
});

test("the client answers the server's pings: the server measures an RTT", async () => {
  const c = await dial('pinged');
  // The server pings as soon as it admits the client; our ping goes
  // after our answer to it on the stream, so once ours is answered the
  // server has read its own.
  await c.ping();
  c.send(13, '');
  const [info] = await take(c, 1);
  assert.ok(JSON.parse(text(info.payload)).rttMs > 0);
  await c.close();
});

test('a refusal, with the Admit hook\'s reason', async () => {
  const err = await dial('refuse:no room for you').then(
    () => null,
    (e) => e,
  );
  assert.ok(err instanceof RefusedError, String(err));
  assert.equal(err.reason, 'no room for you');
  assert.equal(err.tokenRejected, false);
});

test('a token needs a secure session', async () => {
  await assert.rejects(connect(srv.plain, { WebSocket, token: new Uint8Array(10) }), /serverKey/);
});

test('a secure client at a plaintext server is refused, never falls back', async () => {
  const err = await connect(srv.plain, { WebSocket, serverKey: srv.serverKey }).then(
    () => null,
    (e) => e,
  );
  assert.ok(err instanceof RefusedError, String(err));
  assert.match(err.reason, /no secure sessions/);
});

test('the client closes with a reason, and with a code: the server reads both', async () => {
  const c = await dial('bye-reason');
  c.send(10, 'before the close', { reliable: true });
  const e = await c.close('going home');
  assert.ok(e instanceof ClosedError, String(e));
  let ev = await srv.ended('bye-reason');
  assert.equal(ev.kind, 'disconnect');
  assert.equal(ev.code, 0);
  assert.equal(ev.reason, 'going home');

  const d = await dial('bye-code');
  await d.close('kicked myself', 4001);
  ev = await srv.ended('bye-code');
  assert.equal(ev.kind, 'disconnect');
  assert.equal(ev.code, 4001);
  assert.equal(ev.reason, 'kicked myself');
  assert.throws(() => d.send(10, 'x'), ClosedError);

  const q = await dial('bye-quiet');
  await q.close();
  ev = await srv.ended('bye-quiet');
  assert.equal(ev.kind, 'peerclosed', 'no reason, no code: the end of the stream');
});

test('the server closes with a code and a reason: a DisconnectError after its last messages', async () => {
  const c = await dial('kicked');
  c.send(10, 'one', { reliable: true });
  c.send(11, concat(u32le(7), new TextEncoder().encode('banned for a day')));
  const got = [];
  for await (const m of c) got.push(text(m.payload));
  assert.deepEqual(got, ['one'], 'the iterator ends after what came before the close');
  const e = await c.closed;
  assert.ok(e instanceof DisconnectError, String(e));
  assert.equal(e.code, 7);
  assert.equal(e.reason, 'banned for a day');
  assert.throws(() => c.send(10, 'x'), DisconnectError);
  const ev = await srv.ended('kicked');
  assert.equal(ev.kind, 'closed', 'the server closed it');

  const d = await dial('kicked-reason');
  d.send(11, concat(u32le(0), new TextEncoder().encode('see you')));
  const e2 = await d.closed;
  assert.ok(e2 instanceof DisconnectError);
  assert.equal(e2.code, 0);
  assert.equal(e2.reason, 'see you');
});

test('messages by callback instead of the iterator; an exception in it is not the connection\'s', async () => {
  let got;
  const two = new Promise((r) => (got = r));
  const seen = [];
  const c = await dial('callback', {
    onmessage: (m) => {
      seen.push(text(m.payload));
      if (seen.length === 2) got();
      throw new Error('the application failed');
    },
  });
  // Reported as a browser reports an event handler's exception.
  const uncaught = [];
  const had = globalThis.reportError;
  globalThis.reportError = (e) => uncaught.push(e);
  c.send(10, 'one', { reliable: true });
  c.send(10, 'two', { reliable: true });
  await two;
  globalThis.reportError = had;
  assert.deepEqual(seen, ['one', 'two']);
  assert.equal(c.error, null, 'still open');
  assert.equal(uncaught.length, 2);
  assert.ok(uncaught.every((e) => e.message === 'the application failed'));
  await c.close();
});

test('receipts: delivered once written', async () => {
  const c = await dial('receipts');
  const receipts = [];
  c.onreceipt = (r) => receipts.push(r);
  const a = c.send(10, 'a', { reliable: true });
  const b = c.send(10, 'b');
  await take(c, 2);
  assert.deepEqual(receipts, [
    { ref: a, delivered: true },
    { ref: b, delivered: true },
  ]);
  await c.close();
});

test('a WebSocket that cannot connect fails with its code', async () => {
  const err = await connect(srv.http.replace('http', 'ws') + '/nothing-here', { WebSocket }).then(
    () => null,
    (e) => e,
  );
  assert.ok(err instanceof WebSocketError, String(err));
  assert.equal(err.code, 1006);
});
