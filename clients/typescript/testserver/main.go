//go:build !js

// Command testserver is the Go side of the TypeScript client's tests: two
// knet Listeners served over WebSocket on loopback, one plaintext
// (/plain) and one secure (/secure: fixed test keys, connect tokens from
// /token), whose connections answer a tiny protocol. It prints one JSON
// line with its URLs, then one line for each thing the tests wait for: a
// connection accepted, a connection ended and how.
//
// The protocol, by message ID:
//
//	10  echo: the message comes back, same ID and payload, reliable
//	11  close: the server closes, with the code (u32 little-endian) and the reason after it
//	12  burst: u32 count, u32 size: the server sends count messages of ID 12, each size bytes, the first four the index
//	13  info: the server answers with JSON of what it knows of the connection
//
// Any other message is counted in an event ("message"). POST /report
// takes the browser test's page's JSON report and prints it as an event.
//
// A ConnectPayload "refuse:why" is refused with the reason why; any
// other is admitted with the reply "welcome " + payload (and the token's
// client ID, secure). The payload names the connection in the events.
package main

import (
	"context"
	"crypto/ecdh"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/knet-go/knet"
)

// The secure listener's fixed keys: tests only.
var (
	serverPrivate, _ = hex.DecodeString("a8abababababababababababababababababababababababababababababab6b")
	tokenKey, _      = hex.DecodeString("7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b")
	publicAddr       = netip.MustParseAddrPort("127.0.0.1:7000")
)

var out struct {
	sync.Mutex
	enc *json.Encoder
}

func emit(v map[string]any) {
	out.Lock()
	defer out.Unlock()
	out.enc.Encode(v)
}

func main() {
	static := flag.String("static", "", "a directory served at / (the browser test's page and bundle)")
	flag.Parse()
	out.enc = json.NewEncoder(os.Stdout)

	plain, err := listen(false)
	if err != nil {
		log.Fatal(err)
	}
	secure, err := listen(true)
	if err != nil {
		log.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/plain", plain.WebSocketHandler("*"))
	mux.Handle("/secure", secure.WebSocketHandler("*"))
	mux.HandleFunc("/token", func(w http.ResponseWriter, r *http.Request) {
		id, _ := strconv.ParseUint(r.URL.Query().Get("client"), 10, 64)
		tok, err := knet.IssueToken(tokenKey, knet.Token{ClientID: id, UserData: []byte(r.URL.Query().Get("data")),
			Expires: time.Now().Add(time.Minute), Servers: []netip.AddrPort{publicAddr}})
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Write(tok)
	})
	mux.HandleFunc("/report", func(w http.ResponseWriter, r *http.Request) {
		// The browser test's page says how it went.
		var rep any
		if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<20)).Decode(&rep); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		emit(map[string]any{"event": "report", "report": rep})
	})
	if *static != "" {
		mux.Handle("/", http.FileServer(http.Dir(*static)))
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	base := "http://" + ln.Addr().String()
	pub, err := publicKey()
	if err != nil {
		log.Fatal(err)
	}
	emit(map[string]any{
		"event":     "ready",
		"http":      base,
		"plain":     "ws://" + ln.Addr().String() + "/plain",
		"secure":    "ws://" + ln.Addr().String() + "/secure",
		"serverKey": hex.EncodeToString(pub),
	})
	go func() {
		// The tests end the server by closing its standard input.
		buf := make([]byte, 1)
		for {
			if _, err := os.Stdin.Read(buf); err != nil {
				os.Exit(0)
			}
		}
	}()
	log.Fatal(http.Serve(ln, mux))
}

// publicKey is the secure listener's public key: its clients' ServerKey.
func publicKey() ([]byte, error) {
	k, err := ecdh.X25519().NewPrivateKey(serverPrivate)
	if err != nil {
		return nil, err
	}
	return k.PublicKey().Bytes(), nil
}

// names maps each connection to its ConnectPayload.
var names sync.Map

func listen(secure bool) (*knet.Listener, error) {
	cfg := &knet.Config{
		AdmitConn: func(c *knet.Conn, payload []byte) ([]byte, error) {
			p := string(payload)
			if why, ok := strings.CutPrefix(p, "refuse:"); ok {
				return nil, errors.New(why)
			}
			names.Store(c, p)
			reply := "welcome " + p
			if t := c.Token(); t != nil {
				reply += fmt.Sprintf(" client %d data %q", t.ClientID, t.UserData)
			}
			return []byte(reply), nil
		},
	}
	if secure {
		cfg.PrivateKey, cfg.TokenKey = serverPrivate, tokenKey
		cfg.PublicAddrs = []netip.AddrPort{publicAddr}
	}
	l, err := knet.Listen("udp", "127.0.0.1:0", cfg)
	if err != nil {
		return nil, err
	}
	go func() {
		for {
			c, err := l.AcceptConn(context.Background())
			if err != nil {
				return
			}
			go serve(c, secure)
		}
	}()
	return l, nil
}

func name(c *knet.Conn) string {
	v, _ := names.Load(c)
	s, _ := v.(string)
	return s
}

func serve(c *knet.Conn, secure bool) {
	emit(map[string]any{"event": "accepted", "name": name(c), "secure": c.Secure(), "transport": c.Transport().String()})
	for {
		m, err := c.Receive(context.Background())
		if err != nil {
			break
		}
		switch m.ID {
		case 10:
			c.Send(knet.Message{ID: 10, Payload: m.Payload, Reliable: true})
		case 11:
			if len(m.Payload) >= 4 {
				c.CloseWithError(binary.LittleEndian.Uint32(m.Payload), string(m.Payload[4:]))
			}
		case 12:
			if len(m.Payload) >= 8 {
				n, size := binary.LittleEndian.Uint32(m.Payload), binary.LittleEndian.Uint32(m.Payload[4:])
				for i := range n {
					p := make([]byte, max(size, 4))
					binary.LittleEndian.PutUint32(p, i)
					for j := 4; j < len(p); j++ {
						p[j] = byte(j)
					}
					c.Send(knet.Message{ID: 12, Payload: p[:max(size, 4)], Reliable: true})
				}
			}
		case 13:
			st := c.Stats()
			syn, _ := c.Handshake()
			info, _ := json.Marshal(map[string]any{
				"name": name(c), "secure": c.Secure(), "payload": string(syn),
				"messagesReceived": st.MessagesReceived, "invalid": st.InvalidDatagrams,
				"rttMs": float64(st.RTT) / float64(time.Millisecond),
			})
			c.Send(knet.Message{ID: 13, Payload: info, Reliable: true})
		default:
			emit(map[string]any{"event": "message", "name": name(c), "id": m.ID, "size": len(m.Payload)})
		}
	}
	<-c.Done()
	ended(c)
}

// ended reports how c ended, as the client's tests check it.
func ended(c *knet.Conn) {
	err := c.Err()
	ev := map[string]any{"event": "ended", "name": name(c), "err": fmt.Sprint(err), "invalid": c.Stats().InvalidDatagrams}
	var de *knet.DisconnectError
	var pe *knet.ProtocolError
	var te *knet.TimeoutError
	switch {
	case errors.As(err, &de):
		ev["kind"], ev["code"], ev["reason"] = "disconnect", de.Code, de.Reason
	case errors.Is(err, knet.ErrPeerClosed):
		ev["kind"] = "peerclosed"
	case errors.As(err, &pe):
		ev["kind"] = "protocol"
	case errors.As(err, &te):
		ev["kind"] = "timeout"
	case errors.Is(err, net.ErrClosed):
		ev["kind"] = "closed"
	default:
		ev["kind"] = "other"
	}
	emit(ev)
}
