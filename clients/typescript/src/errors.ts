// How a connection fails or ends, as typed errors: the Go client's
// errors (knet.go, stream.go) under the same names where it has them.

/** Every error of this package. */
export class KnetError extends Error {
  constructor(message: string, name = 'KnetError') {
    super(message);
    // Named by hand: a minifier renames classes.
    this.name = name;
  }
}

/**
 * The server refused the connection (Go's RefusedError, ErrRefused):
 * its Admit hook's reason, a token refused, a plaintext client at a
 * secure server, a full server... reason is empty when it gave none.
 */
export class RefusedError extends KnetError {
  constructor(public readonly reason: string) {
    super(reason ? `knet: connection refused: ${reason}` : 'knet: connection refused', 'RefusedError');
  }
  /** The server refused the connect token (Go's ErrTokenRejected). */
  get tokenRejected(): boolean {
    return this.reason.startsWith('knet: connect token rejected');
  }
}

/**
 * The peer closed the connection (Go's DisconnectError, ErrPeerClosed):
 * the code of its CloseWithError (0 for a close without one) and its
 * reason ('' without one).
 */
export class DisconnectError extends KnetError {
  constructor(
    public readonly code: number,
    public readonly reason: string,
  ) {
    super(
      'knet: connection closed by peer' +
        (code !== 0 ? `: code ${code}` : '') +
        (code !== 0 || reason ? `: ${reason}` : ''),
      'DisconnectError',
    );
  }
}

/** This side closed the connection (Go's net.ErrClosed). */
export class ClosedError extends KnetError {
  constructor(message = 'knet: use of closed connection') {
    super(message, 'ClosedError');
  }
}

/**
 * The peer broke the wire (Go's ProtocolError): a frame that does not
 * parse, a sealed frame that does not open (tampered with, replayed,
 * reordered), a secure stream cut without its sealed close.
 */
export class ProtocolError extends KnetError {
  constructor(detail: string) {
    super(`knet: protocol error: ${detail}`, 'ProtocolError');
  }
}

/** Nothing came in time (Go's TimeoutError): op is 'connect', 'disconnect' or '' (the peer went silent). */
export class TimeoutError extends KnetError {
  constructor(
    public readonly op: string,
    public readonly silentMs: number,
  ) {
    super(`knet: ${op ? op + ' ' : ''}timeout: nothing for ${Math.round(silentMs)} ms`, 'TimeoutError');
  }
}

/**
 * The secure handshake failed (Go's ErrHandshakeFailed): the server's
 * answer did not prove it holds the private key of serverKey, or it
 * answered in clear.
 */
export class HandshakeError extends KnetError {
  constructor(detail: string) {
    super(`knet: secure handshake failed: ${detail}`, 'HandshakeError');
  }
}

/** The WebSocket failed or closed abnormally (a close code other than 1000 or 1001). */
export class WebSocketError extends KnetError {
  constructor(
    public readonly code: number,
    public readonly reason: string,
  ) {
    super(`knet: websocket closed (code ${code}${reason ? ': ' + reason : ''})`, 'WebSocketError');
  }
}
