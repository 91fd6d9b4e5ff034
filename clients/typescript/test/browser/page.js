// The browser test's page: the bundled client in Chromium against the Go
// test server that served the page. It posts what it saw to /report.

import { connect, DisconnectError, ClosedError } from './knet.js';

const q = new URLSearchParams(location.search);
const base = `ws://${location.host}`;
const text = (b) => new TextDecoder().decode(b);

async function take(conn, n) {
  const got = [];
  for await (const m of conn) {
    got.push(m);
    if (got.length === n) break;
  }
  return got;
}

async function run() {
  const rep = { userAgent: navigator.userAgent, globalWebSocket: typeof WebSocket === 'function' };

  // Plaintext: every mode echoed, a large message, the RTT, the server's close with a code.
  const plain = await connect(`${base}/plain`, { payload: 'browser-plain' });
  rep.plainReply = text(plain.reply);
  const modes = [{ reliable: true }, { reliable: true, inOrder: true }, {}, { inOrder: true, channel: 4 }, { contentId: 9 }, { priority: 3 }];
  const sent = [];
  for (const [i, o] of modes.entries()) {
    plain.send(10, `mode ${i}`, o);
    sent.push(`mode ${i}`);
    await new Promise((r) => setTimeout(r, 0));
  }
  const big = new Uint8Array(1 << 20).map((_, i) => (i * 13) & 0xff);
  plain.send(10, big, { reliable: true });
  const got = await take(plain, sent.length + 1);
  rep.echoed = got.slice(0, -1).map((m) => text(m.payload));
  rep.sent = sent;
  rep.bigOK = got.at(-1).payload.length === big.length && got.at(-1).payload.every((x, i) => x === big[i]);
  rep.rtt = await plain.ping();
  const kick = new Uint8Array(4 + 11);
  new DataView(kick.buffer).setUint32(0, 5, true);
  kick.set(new TextEncoder().encode('browser bye'), 4);
  plain.send(11, kick);
  const ended = await plain.closed;
  rep.plainEnd = { type: ended.name, code: ended.code, reason: ended.reason, isDisconnect: ended instanceof DisconnectError };

  // Secure: a token from the server's backend, sealed frames, our close with a code.
  const token = new Uint8Array(await (await fetch('/token?client=77&data=browser')).arrayBuffer());
  const sec = await connect(`${base}/secure`, { serverKey: q.get('key'), token, payload: 'browser-secure' });
  rep.secure = sec.secure;
  rep.secureReply = text(sec.reply);
  sec.send(10, 'sealed hello', { reliable: true });
  rep.secureEcho = text((await take(sec, 1))[0].payload);
  const closed = await sec.close('page done', 3);
  rep.secureEnd = { type: closed.name, isClosed: closed instanceof ClosedError };
  return rep;
}

run()
  .then((rep) => ({ ok: true, ...rep }))
  .catch((e) => ({ ok: false, error: `${e?.name}: ${e?.message}\n${e?.stack}` }))
  .then((rep) => {
    document.body.textContent = JSON.stringify(rep);
    return fetch('/report', { method: 'POST', body: JSON.stringify(rep) });
  });
