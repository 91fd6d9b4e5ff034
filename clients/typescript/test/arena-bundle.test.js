// examples/arena/web/knet.js is committed (the arena's Go binary embeds
// its web/ directory), so it must not drift from src/: rebuilt here from
// dist/ (which `npm test` has just compiled) by the same script, it must
// be byte for byte the committed file. esbuild's output is deterministic
// for the same inputs and the same esbuild, which the lock file pins; a
// failure means src/ (or a dependency) changed without
// `npm run bundle:arena`.

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { bundleArena, arenaBundle } from '../scripts/bundle-arena.mjs';

test("the arena's committed bundle is the current client's", async (t) => {
  const dir = mkdtempSync(join(tmpdir(), 'knet-arena-bundle-'));
  t.after(() => rmSync(dir, { recursive: true, force: true }));
  const fresh = readFileSync(await bundleArena(join(dir, 'knet.js')));
  const committed = readFileSync(arenaBundle);
  t.diagnostic(`examples/arena/web/knet.js: ${committed.length} bytes`);
  assert.ok(
    fresh.equals(committed),
    `examples/arena/web/knet.js (${committed.length} bytes) is not the bundle of the current sources ` +
      `(${fresh.length} bytes): run \`npm run bundle:arena\` in clients/typescript and commit it`,
  );
});
