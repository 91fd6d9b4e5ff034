// The bundled client in a real browser: headless Chromium loads a page
// from the Go test server, which runs the client against that server and
// posts its report; the test checks the report and what the server saw.
// Chromium is launched as the repository's wasmbot tests launch it, with
// no driver: the page reports over HTTP.

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, execFileSync } from 'node:child_process';
import { mkdtempSync, copyFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { build } from 'esbuild';
import { startServer, pkgDir } from './helpers.js';

function findChromium() {
  for (const name of ['chromium', 'chromium-browser']) {
    try {
      return execFileSync('sh', ['-c', `command -v ${name}`], { encoding: 'utf8' }).trim();
    } catch {
      // not this one
    }
  }
  return null;
}

const chromium = findChromium();
const missing = 'headless Chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)';
if (!chromium && process.env.KNET_REQUIRE_TOOLS === '1') throw new Error(missing);

let srv, dir, browser;
before(async () => {
  if (!chromium) return;
  dir = mkdtempSync(join(tmpdir(), 'knet-browser-'));
  await build({
    entryPoints: [join(pkgDir, 'dist', 'index.js')],
    bundle: true,
    minify: true,
    format: 'esm',
    platform: 'browser',
    outfile: join(dir, 'knet.js'),
    logLevel: 'silent',
  });
  for (const f of ['index.html', 'page.js']) copyFileSync(join(pkgDir, 'test', 'browser', f), join(dir, f));
  srv = await startServer(['-static', dir]);
});
after(async () => {
  if (browser && browser.exitCode === null) {
    const gone = new Promise((r) => browser.once('exit', r));
    browser.kill();
    await gone;
  }
  await srv?.stop();
  if (dir) rmSync(dir, { recursive: true, force: true, maxRetries: 5 });
});

test('the bundled client in headless Chromium', { skip: chromium ? false : missing, timeout: 120000 }, async () => {
  const profile = join(dir, 'profile');
  const page = `${srv.http}/index.html?key=${srv.serverKey}`;
  browser = spawn(
    chromium,
    ['--headless=new', '--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage', '--no-first-run', `--user-data-dir=${profile}`, page],
    { stdio: 'ignore' },
  );
  const died = new Promise((_, reject) => browser.on('exit', (code) => reject(new Error(`chromium exited: ${code}`))));
  const { report: r } = await Promise.race([srv.event((e) => e.event === 'report'), died]);
  assert.equal(r.ok, true, r.error);
  assert.match(r.userAgent, /Chrome/);
  assert.equal(r.globalWebSocket, true, "the browser's own WebSocket");
  assert.equal(r.plainReply, 'welcome browser-plain');
  assert.deepEqual(r.echoed, r.sent);
  assert.equal(r.bigOK, true);
  assert.ok(r.rtt > 0);
  assert.deepEqual(r.plainEnd, { type: 'DisconnectError', code: 5, reason: 'browser bye', isDisconnect: true });
  assert.equal(r.secure, true);
  assert.equal(r.secureReply, 'welcome browser-secure client 77 data "browser"');
  assert.equal(r.secureEcho, 'sealed hello');
  assert.deepEqual(r.secureEnd, { type: 'ClosedError', isClosed: true });

  // What the server saw.
  const acc = await srv.accepted('browser-secure');
  assert.equal(acc.secure, true);
  assert.equal(acc.transport, 'websocket');
  const plainEnd = await srv.ended('browser-plain');
  assert.equal(plainEnd.kind, 'closed', 'the server closed it');
  const secEnd = await srv.ended('browser-secure');
  assert.equal(secEnd.kind, 'disconnect');
  assert.equal(secEnd.code, 3);
  assert.equal(secEnd.reason, 'page done');
});
