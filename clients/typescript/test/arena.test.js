// examples/arena with its page in a real browser: the arena (no bots)
// serves the page, headless Chromium plays it, and the test asserts what
// the server saw. The page sends inputs only once a snapshot has shown
// it its own player, so inputs arriving over WebSocket prove the whole
// path: the token, the secure session, the snapshots parsed, the inputs
// sent. Then a SIGTERM: the drain must tell the page and see it leave.
// Chromium is launched as in browser.test.js, with no driver.

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, execFileSync } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { createInterface } from 'node:readline';
import { repoDir } from './helpers.js';

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

const wantInputs = 20; // a second of the page's moves, at 20 a second

let dir, arena, browser, arenaExit;
const out = []; // the arena's output, line by line
before(() => {
  if (!chromium) return;
  dir = mkdtempSync(join(tmpdir(), 'knet-arena-'));
  execFileSync('go', ['build', '-o', join(dir, 'arena'), './examples/arena'], { cwd: repoDir, stdio: 'inherit' });
});
after(async () => {
  for (const p of [browser, arena]) {
    if (p && p.exitCode === null && p.signalCode === null) {
      const gone = new Promise((r) => p.once('exit', r));
      p.kill('SIGKILL');
      await gone;
    }
  }
  if (dir) rmSync(dir, { recursive: true, force: true, maxRetries: 5 });
});

/** Rejects when p exits: raced against every wait, so that a crash fails at once. */
function dies(p, name) {
  return new Promise((_, reject) => p.once('exit', (code, sig) => reject(new Error(`${name} exited: ${code ?? sig}\n${out.join('\n')}`))));
}

test("the arena's page in headless Chromium", { skip: chromium ? false : missing, timeout: 120000 }, async () => {
  arena = spawn(join(dir, 'arena'), ['-bots', '0', '-addr', '127.0.0.1:0'], { stdio: ['ignore', 'pipe', 'inherit'] });
  arenaExit = new Promise((r) => arena.once('exit', (code, sig) => r(code ?? sig)));
  const arenaDied = dies(arena, 'the arena');
  arenaDied.catch(() => {}); // awaited below through the races
  const lines = createInterface({ input: arena.stdout });
  const first = new Promise((r) => lines.once('line', r));
  lines.on('line', (l) => out.push(l));
  const head = await Promise.race([first, arenaDied]);
  const m = head.match(/http:\/\/([0-9.:]+)\//);
  assert.ok(m, `the arena's first line names its HTTP address: ${head}`);
  const base = `http://${m[1]}`;

  browser = spawn(
    chromium,
    ['--headless=new', '--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage', '--no-first-run', `--user-data-dir=${join(dir, 'profile')}`, `${base}/`],
    { stdio: 'ignore' },
  );
  const browserDied = dies(browser, 'chromium');
  browserDied.catch(() => {});

  // Poll /metrics (bounded) until the page's inputs have arrived.
  let metrics = {};
  const deadline = Date.now() + 60000; // a failure detector: it takes about two seconds
  for (;;) {
    metrics = await Promise.race([fetch(`${base}/metrics`).then((r) => r.json()), arenaDied, browserDied]);
    if ((metrics.websocket?.Received ?? 0) >= wantInputs) break;
    assert.ok(Date.now() < deadline, `no ${wantInputs} inputs from the page in 60 s: /metrics ${JSON.stringify(metrics)}`);
    await Promise.race([new Promise((r) => setTimeout(r, 100)), arenaDied, browserDied]);
  }
  assert.deepEqual(Object.keys(metrics), ['websocket'], 'the page alone, over WebSocket');
  const ws = metrics.websocket;
  assert.equal(ws.Players, 1);
  assert.ok(ws.Sent > 0, 'snapshots sent to the page');
  assert.ok(ws.Received >= wantInputs, 'inputs from the page, sent once it saw itself in a snapshot');
  assert.ok(ws.RTT > 0, "the server's RTT to the page");

  // SIGTERM: the drain tells the page (close code 1), waits for it to
  // leave and the arena exits cleanly.
  arena.kill('SIGTERM');
  const code = await Promise.race([arenaExit, new Promise((_, rej) => setTimeout(() => rej(new Error('the arena did not exit 30 s after SIGTERM')), 30000))]);
  assert.equal(code, 0, out.join('\n'));
  assert.ok(out.some((l) => /^websocket +1 players/.test(l)), out.join('\n'));
  assert.ok(out.includes('drained: 0 players left (err <nil>)'), out.join('\n'));
});
