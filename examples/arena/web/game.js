// The arena's browser player: the game loop of a page using knet's
// TypeScript client (clients/typescript, bundled in knet.js). It asks the
// server's token endpoint for a ticket, connects over WebSocket (a secure
// session: the server's key and the token), draws every snapshot and
// sends a move every tick, reliable and in order, as the Go bots do.

import { connect, DisconnectError } from './knet.js';

const msgInput = 100; // to the server, reliable and in order: dx, dy (int8 each)
const msgSnapshot = 101; // from the server, latest state: u64 tick time (ns), then per player u32 id, i16 x, i16 y
const closeDrain = 1; // the server is shutting down: rejoin (a real game asks its matchmaker for another server)
const tickMs = 1000 / 20; // the server's tick

const hud = document.getElementById('hud');
const canvas = document.getElementById('arena');
const draw = canvas.getContext('2d');

const keys = new Set();
addEventListener('keydown', (e) => keys.add(e.key.toLowerCase()));
addEventListener('keyup', (e) => keys.delete(e.key.toLowerCase()));
addEventListener('blur', () => keys.clear());

const b64 = (s) => Uint8Array.from(atob(s), (c) => c.charCodeAt(0));
const nowNs = () => BigInt(Math.round((performance.timeOrigin + performance.now()) * 1e6));

let snap = null; // the newest snapshot: { tick (ns), players: [{id, x, y}], at (ns, here) }
let snapshots = 0;

function parseSnapshot(p) {
  const v = new DataView(p.buffer, p.byteOffset, p.byteLength);
  const players = [];
  for (let o = 8; o + 8 <= p.byteLength; o += 8) {
    players.push({ id: v.getUint32(o, true), x: v.getInt16(o + 4, true), y: v.getInt16(o + 6, true) });
  }
  return { tick: v.getBigUint64(0, true), players, at: nowNs() };
}

// What to send this tick: the keys held, or else a wander that turns now
// and then and heads home when far out, so that an idle (or headless)
// page plays too.
let wander = { dx: 1, dy: 0, until: 0 };
function move(me) {
  const k = (...names) => names.some((n) => keys.has(n));
  const dx = (k('arrowright', 'd') ? 2 : 0) - (k('arrowleft', 'a') ? 2 : 0);
  const dy = (k('arrowdown', 's') ? 2 : 0) - (k('arrowup', 'w') ? 2 : 0);
  if (dx || dy) return [dx, dy];
  if (performance.now() > wander.until) {
    const home = me && Math.hypot(me.x, me.y) > 150;
    wander = {
      dx: home ? -Math.sign(me.x) : Math.round(Math.random() * 2 - 1),
      dy: home ? -Math.sign(me.y) : Math.round(Math.random() * 2 - 1),
      until: performance.now() + 500 + Math.random() * 1500,
    };
  }
  return [wander.dx, wander.dy];
}

// One session: a ticket, a connection, play until it ends; resolves with how it ended.
async function play() {
  const res = await fetch('/token', { method: 'POST' });
  if (!res.ok) throw new Error(`POST /token: ${res.status} ${await res.text()}`);
  const t = await res.json(); // {token, serverKey (base64), id, game, webSocket}
  const url = `${location.protocol === 'https:' ? 'wss' : 'ws'}://${location.host}${t.webSocket}`;
  const conn = await connect(url, { serverKey: b64(t.serverKey), token: b64(t.token) });
  hud.textContent = `connected as player ${t.id}, waiting for a snapshot`;
  conn.ping().catch(() => {}); // an RTT now rather than in 3.5 s
  let me = null; // our own entry in the newest snapshot
  const inputs = setInterval(() => {
    if (!me) return; // inputs start once a snapshot has shown us: the server sees that snapshots arrive
    const [dx, dy] = move(me);
    conn.send(msgInput, Uint8Array.of(dx & 0xff, dy & 0xff), { reliable: true, inOrder: true });
  }, tickMs);
  try {
    for await (const m of conn) {
      if (m.id !== msgSnapshot || m.payload.byteLength < 8) continue;
      snap = parseSnapshot(m.payload);
      snapshots++;
      me = snap.players.find((p) => p.id === t.id) ?? me;
      status(conn, t.id);
    }
  } catch {
    // a failure: conn.closed says which
  } finally {
    clearInterval(inputs);
  }
  return conn.closed;
}

function status(conn, id) {
  // The age is the server's tick time against this machine's clock: true
  // when both agree (one machine, or clocks kept by NTP to a millisecond).
  const age = Number(snap.at - snap.tick) / 1e6;
  hud.textContent = `player ${id} · ${snap.players.length} players · ${snapshots} snapshots · ` +
    `snapshot age ${age.toFixed(1)} ms · RTT ${conn.rtt.toFixed(1)} ms · ${conn.secure ? 'secure' : 'clear'}`;
  hud.dataset.id = id;
}

// Draws the newest snapshot; the world wraps at the canvas's edges, origin at the centre.
function frame() {
  const { width: w, height: h } = canvas;
  draw.clearRect(0, 0, w, h);
  if (snap) {
    const mine = Number(hud.dataset.id);
    for (const p of snap.players) {
      const x = (((p.x + w / 2) % w) + w) % w;
      const y = (((p.y + h / 2) % h) + h) % h;
      draw.fillStyle = draw.strokeStyle = `hsl(${(p.id * 137) % 360} 70% 45%)`;
      if (p.id === mine) draw.fillRect(x - 6, y - 6, 12, 12);
      else draw.strokeRect(x - 5, y - 5, 10, 10);
    }
  }
  requestAnimationFrame(frame);
}
requestAnimationFrame(frame);

// Play, and rejoin when a session ends: at once after a drain (closeDrain),
// after a pause for anything else.
for (;;) {
  let why;
  try {
    why = await play();
  } catch (e) {
    why = e;
  }
  const drained = why instanceof DisconnectError && why.code === closeDrain;
  hud.textContent = `${drained ? 'server draining' : 'disconnected'}: ${why?.name}: ${why?.message}; rejoining…`;
  snap = null;
  await new Promise((r) => setTimeout(r, drained ? 500 : 3000));
}
