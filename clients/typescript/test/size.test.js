// The client with its crypto, as a game's bundler would ship it: at most
// 25 KB minified and gzipped.

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { gzipSync } from 'node:zlib';
import { join } from 'node:path';
import { build } from 'esbuild';
import { pkgDir } from './helpers.js';

export const LIMIT = 25000; // 25 KB, counted in thousands: the stricter reading

test('the bundle is at most 25 KB minified and gzipped', async (t) => {
  const out = await build({
    entryPoints: [join(pkgDir, 'dist', 'index.js')],
    bundle: true,
    minify: true,
    format: 'esm',
    platform: 'browser',
    write: false,
    logLevel: 'silent',
  });
  const js = out.outputFiles[0].contents;
  const gz = gzipSync(js, { level: 9 }).length;
  t.diagnostic(`bundle: ${js.length} bytes minified, ${gz} bytes gzipped (limit ${LIMIT})`);
  assert.ok(gz <= LIMIT, `${gz} bytes gzipped, over ${LIMIT}`);
  // It holds the crypto: the bundle is no stub.
  assert.ok(gz > 10 * 1024, `${gz} bytes: the crypto is missing?`);
});
