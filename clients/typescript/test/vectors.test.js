// The shared vectors (testdata/vectors, made by Go's encoders and checked
// by its TestVectors): the client must make and read the same bytes.

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { repoDir, hex, toHex, concat } from './helpers.js';
import { putVLE32, readVLE32, sizeVLE32, encodeFrame, helloPayload, parseHello, Framer, splitBody, frameBody, withSize } from '../dist/wire.js';
import { writeMessage1, readMessage2, synPayload, StreamSeal } from '../dist/noise.js';
import { tokenServers } from '../dist/index.js';

const load = (name) => JSON.parse(readFileSync(join(repoDir, 'testdata', 'vectors', name), 'utf8'));
const frames = load('frames.json');
const secure = load('secure.json');
const token = load('token.json');

test('VLE-1.7/1.7/16 values', () => {
  for (const v of frames.vle) {
    const b = new Uint8Array(sizeVLE32(v.value));
    assert.equal(putVLE32(b, 0, v.value), b.length);
    assert.equal(toHex(b), v.hex, `value ${v.value}`);
    assert.deepEqual(readVLE32(hex(v.hex), 0), [v.value, b.length]);
  }
});

test('frames in clear, made and cut', () => {
  for (const f of frames.frames) {
    assert.equal(toHex(encodeFrame(f.id, hex(f.payload))), f.frame, f.name);
  }
  // All of them back to back, fed a byte at a time, come out whole.
  const stream = concat(...frames.frames.map((f) => hex(f.frame)));
  const fr = new Framer(1 << 20);
  const got = [];
  for (let i = 0; i < stream.length; i++) {
    fr.feed(stream.subarray(i, i + 1));
    for (let b = fr.next(); b; b = fr.next()) got.push(splitBody(b));
  }
  assert.equal(fr.buffered(), 0);
  assert.deepEqual(
    got.map(([id, p]) => [id, toHex(p)]),
    frames.frames.map((f) => [f.id, f.payload]),
  );
});

test('knet hellos and close hellos', () => {
  for (const h of frames.hellos) {
    assert.equal(toHex(encodeFrame(2, helloPayload(h.kind, hex(h.content)))), h.frame, h.name);
    const [id, p] = splitBody(hex(h.frame).subarray(1));
    assert.equal(id, 2);
    const got = parseHello(p);
    assert.equal(got.kind, h.kind);
    assert.equal(toHex(got.content), h.content);
  }
  const enc = new TextEncoder();
  for (const c of frames.closes) {
    let content = enc.encode(c.reason);
    let kind = 4;
    if (c.code !== 0) {
      kind = 7;
      const code = new Uint8Array(4);
      new DataView(code.buffer).setUint32(0, c.code, true);
      content = concat(code, content);
    }
    assert.equal(toHex(encodeFrame(2, helloPayload(kind, content))), c.frame, `close ${c.code} ${c.reason}`);
  }
  assert.equal(parseHello(hex('016b4e540101')), null, 'pingID 1 is a ping reply');
  assert.equal(parseHello(hex('006b4e540108')), null, 'kind 8 is none');
});

test('a framer refuses a size of 0 and one over its limit at once', () => {
  const fr = new Framer(100);
  fr.feed(hex('00'));
  assert.throws(() => fr.next(), /size 0/);
  const big = new Framer(100);
  big.feed(hex('a1')); // incomplete
  assert.equal(big.next(), null);
  big.feed(hex('8d0600')); // 100001: refused before its bytes come
  assert.throws(() => big.next(), /over the limit/);
});

test('the secure handshake and sealed frames under fixed keys', () => {
  const { msg1, state } = writeMessage1(hex(secure.serverPublic), hex(secure.clientEphemeral), synPayload(hex(secure.token), hex(secure.payload)));
  const hello = encodeFrame(2, helloPayload(5, concat(Uint8Array.of(0), msg1)));
  assert.equal(toHex(hello), secure.clientHello);

  const fr = new Framer(1 << 20);
  fr.feed(hex(secure.serverHello));
  const [id, p] = splitBody(fr.next());
  assert.equal(id, 2);
  const h = parseHello(p);
  assert.equal(h.kind, 6);
  const { payload, send, recv } = readMessage2(state, h.content);
  assert.equal(toHex(payload.subarray(0, 4)), '00000000', 'connection ID 0');
  assert.equal(toHex(payload.subarray(4)), secure.reply);

  for (const v of secure.sealed) {
    if (v.dir === 'toServer') {
      const z = new StreamSeal(send, recv);
      z.sendN = v.n;
      assert.equal(toHex(withSize(z.seal(frameBody(v.id, hex(v.payload))))), v.frame, `toServer #${v.n}`);
    } else {
      const z = new StreamSeal(send, recv);
      z.recvN = v.n;
      const f = new Framer(1 << 20);
      f.sealed = true;
      f.feed(hex(v.frame));
      const body = f.next();
      const pt = z.open(body);
      assert.ok(pt, `toClient #${v.n} opens`);
      const [gid, gp] = splitBody(pt);
      assert.equal(gid, v.id);
      assert.equal(toHex(gp), v.payload);
      assert.equal(z.recvN, v.n + 1);
      // Another number, or a byte changed, and it does not.
      const other = new StreamSeal(send, recv);
      other.recvN = v.n + 1;
      assert.equal(other.open(body), null);
      const bad = body.slice();
      bad[0] ^= 0x80;
      const z2 = new StreamSeal(send, recv);
      z2.recvN = v.n;
      assert.equal(z2.open(bad), null);
    }
  }
});

test("a server's answer under another key does not authenticate", () => {
  const { state } = writeMessage1(hex(secure.serverPublic), hex(secure.clientEphemeral), synPayload(hex(secure.token), hex(secure.payload)));
  const msg2 = hex(secure.serverHello).subarray(1 + 1 + 6); // size, ID, hello magic and kind
  const bad = msg2.slice();
  bad[40] ^= 1;
  assert.throws(() => readMessage2(state, bad), /did not prove/);
});

test("a token's clear head", () => {
  const h = tokenServers(hex(token.token));
  assert.deepEqual(h.servers, token.servers);
  assert.equal(h.expires.getTime(), token.expires * 1000);
  assert.throws(() => tokenServers(hex('01')), /not a connect token/);
});

test('errors keep their names when minified', async () => {
  const errs = await import('../dist/errors.js');
  for (const [name, E] of Object.entries(errs)) assert.equal(new E('x').name, name);
});
