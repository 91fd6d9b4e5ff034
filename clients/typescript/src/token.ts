// The clear head of a connect token (Go's TokenServers, token.go): where
// a client with it may connect, and until when. Nothing here is
// authenticated: the server checks the whole token under its key.

export interface TokenHead {
  /** When the server stops taking it. */
  expires: Date;
  /** The servers it names, as Go's netip.AddrPort prints them ("127.0.0.1:7000", "[2001:db8::1]:7000"). */
  servers: string[];
}

const VERSION = 2;
const HEAD = 1 + 8 + 24; // version, expiry, nonce
const ADDR = 16 + 2;
const MAX_SERVERS = 8;
const MIN_BODY = 8 + 2 + 16; // client ID, user data length, tag

/** Reads a connect token's clear head; it throws for bytes that are no token of this version. */
export function tokenServers(token: Uint8Array): TokenHead {
  const bad = () => new TypeError('knet: not a connect token (of this version)');
  if (token.length < HEAD + 1 || token.length > 460 || token[0] !== VERSION) throw bad();
  const k = token[HEAD];
  const n = HEAD + 1 + k * ADDR;
  if (k === 0 || k > MAX_SERVERS || token.length < n + MIN_BODY) throw bad();
  const v = new DataView(token.buffer, token.byteOffset, token.length);
  const expires = new Date(Number(v.getBigUint64(1, true)) * 1000);
  const servers: string[] = [];
  for (let o = HEAD + 1; o < n; o += ADDR) {
    servers.push(addrPort(token.subarray(o, o + 16), v.getUint16(o + 16, true)));
  }
  return { expires, servers };
}

function addrPort(ip: Uint8Array, port: number): string {
  let mapped = true;
  for (let i = 0; i < 12; i++) if (ip[i] !== (i < 10 ? 0 : 0xff)) mapped = false;
  if (mapped) return `${ip[12]}.${ip[13]}.${ip[14]}.${ip[15]}:${port}`;
  const g: number[] = [];
  for (let i = 0; i < 16; i += 2) g.push((ip[i] << 8) | ip[i + 1]);
  // RFC 5952: the longest run of two or more zero groups becomes "::".
  let best = -1, bestLen = 1;
  for (let i = 0; i < 8; ) {
    if (g[i] !== 0) { i++; continue; }
    let j = i;
    while (j < 8 && g[j] === 0) j++;
    if (j - i > bestLen) { best = i; bestLen = j - i; }
    i = j;
  }
  const hex = (a: number[]) => a.map((x) => x.toString(16)).join(':');
  const s = best < 0 ? hex(g) : `${hex(g.slice(0, best))}::${hex(g.slice(best + bestLen))}`;
  return `[${s}]:${port}`;
}
