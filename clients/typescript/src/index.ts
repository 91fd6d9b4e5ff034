export { connect, Conn, MIN_MESSAGE_ID, MAX_MESSAGE_ID, MAX_REASON_LENGTH } from './conn.js';
export type { ConnectOptions, SendOptions, Message, Receipt, Stats, WebSocketLike, WebSocketConstructor } from './conn.js';
export {
  KnetError,
  RefusedError,
  DisconnectError,
  ClosedError,
  ProtocolError,
  TimeoutError,
  HandshakeError,
  WebSocketError,
} from './errors.js';
export { tokenServers } from './token.js';
