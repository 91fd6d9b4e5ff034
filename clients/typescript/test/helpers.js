// The tests' Go server (../testserver): built once per test file, run
// for it, and read line by line: its URLs first, then the events the
// tests wait for.

import { spawn, execFileSync } from 'node:child_process';
import { mkdtempSync, existsSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, dirname } from 'node:path';
import { fileURLToPath } from 'node:url';
import { createInterface } from 'node:readline';

export const pkgDir = join(dirname(fileURLToPath(import.meta.url)), '..');
export const repoDir = join(pkgDir, '..', '..');

// Node 22 has a WebSocket of its own; Node 20 gets the ws package's.
export const WebSocket = globalThis.WebSocket ?? (await import('ws')).WebSocket;

/** Builds the test server (the go tool caches the build) into a fresh directory. */
export function buildServer() {
  const dir = mkdtempSync(join(tmpdir(), 'knet-ts-'));
  const bin = join(dir, 'testserver');
  execFileSync('go', ['build', '-o', bin, './clients/typescript/testserver'], { cwd: repoDir, stdio: 'inherit' });
  return { bin, dir };
}

/** Starts the test server; resolves once it printed its URLs. */
export async function startServer(args = []) {
  const { bin, dir } = buildServer();
  const child = spawn(bin, args, { stdio: ['pipe', 'pipe', 'inherit'] });
  const events = [];
  const waiters = [];
  const rl = createInterface({ input: child.stdout });
  let ready;
  const readyP = new Promise((r) => (ready = r));
  rl.on('line', (line) => {
    const ev = JSON.parse(line);
    if (ev.event === 'ready') {
      ready(ev);
      return;
    }
    events.push(ev);
    for (const w of waiters.slice()) {
      if (w.pred(ev)) {
        waiters.splice(waiters.indexOf(w), 1);
        w.resolve(ev);
      }
    }
  });
  const exited = new Promise((r) => child.on('exit', r));
  const info = await Promise.race([readyP, exited.then((c) => Promise.reject(new Error(`test server exited: ${c}`)))]);
  return {
    ...info,
    events,
    /** Resolves with the first event, past or to come, that pred takes. */
    event(pred) {
      const ev = events.find(pred);
      if (ev) return Promise.resolve(ev);
      return new Promise((resolve) => waiters.push({ pred, resolve }));
    },
    ended(name) {
      return this.event((e) => e.event === 'ended' && e.name === name);
    },
    accepted(name) {
      return this.event((e) => e.event === 'accepted' && e.name === name);
    },
    async token(client, data = '') {
      const r = await fetch(`${info.http}/token?client=${client}&data=${encodeURIComponent(data)}`);
      if (!r.ok) throw new Error(await r.text());
      return new Uint8Array(await r.arrayBuffer());
    },
    async stop() {
      child.stdin.end();
      await exited;
      rmSync(dir, { recursive: true, force: true });
    },
  };
}

export function u32le(...vs) {
  const b = new Uint8Array(4 * vs.length);
  const v = new DataView(b.buffer);
  vs.forEach((x, i) => v.setUint32(4 * i, x, true));
  return b;
}

export function concat(...parts) {
  const b = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let o = 0;
  for (const p of parts) {
    b.set(p, o);
    o += p.length;
  }
  return b;
}

export const text = (b) => new TextDecoder().decode(b);
export const hex = (s) => Uint8Array.from(s.match(/../g) ?? [], (x) => parseInt(x, 16));
export const toHex = (b) => Array.from(b, (x) => x.toString(16).padStart(2, '0')).join('');

/** Takes n messages from conn's iterator. */
export async function take(conn, n) {
  const got = [];
  for await (const m of conn) {
    got.push(m);
    if (got.length === n) break;
  }
  return got;
}

export { existsSync };
