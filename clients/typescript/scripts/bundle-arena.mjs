// Bundles the client for examples/arena's page: the package's dist/ (run
// `npm run build` first; `npm run bundle:arena` does both) through esbuild
// into one minified ES module, examples/arena/web/knet.js, which is
// committed because the arena's Go binary embeds its web/ directory.
// test/arena-bundle.test.js rebuilds it and fails if the committed file
// differs: run `npm run bundle:arena` after changing src/.
//
//	node scripts/bundle-arena.mjs [outfile]

import { build } from 'esbuild';
import { join, dirname } from 'node:path';
import { fileURLToPath } from 'node:url';

export const pkgDir = join(dirname(fileURLToPath(import.meta.url)), '..');
export const arenaBundle = join(pkgDir, '..', '..', 'examples', 'arena', 'web', 'knet.js');

/** Writes the bundle to outfile; the same options as test/size.test.js measures. */
export async function bundleArena(outfile = arenaBundle) {
  await build({
    entryPoints: [join(pkgDir, 'dist', 'index.js')],
    bundle: true,
    minify: true,
    format: 'esm',
    platform: 'browser',
    outfile,
    logLevel: 'silent',
  });
  return outfile;
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  console.log(await bundleArena(process.argv[2]));
}
