// Command arena is a whole knet game server in one file, to copy and grow:
// secure sessions over UDP, TCP and WebSocket, tokens from an HTTP
// endpoint, a 20 Hz tick of snapshots and reliable inputs, metrics, a
// drain on SIGTERM. Bots (bots.go) play over every transport.
//
//	go run ./examples/arena                 # with bots, until SIGTERM or Ctrl-C
//	go run ./examples/arena -duration 5s    # five seconds, then drain and exit
//	go run ./examples/arena -bots 0         # the server alone
package main

import (
	"context"
	"crypto/rand"
	"embed"
	"encoding/binary"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"log"
	"net/http"
	"net/netip"
	"os"
	"os/signal"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/knet-go/knet"
)

const (
	msgInput    = 100 // client to server, reliable and in order: a move, dx and dy
	msgSnapshot = 101 // server to client, latest state (ContentID 1): the tick's time, then every player
	closeDrain  = 1   // the close code of a server shutting down: the client asks for a new server
	tickRate    = 20  // ticks a second
)

//go:embed web
var web embed.FS // the browser client's pages, served at "/"

type options struct {
	addr string        // the game's address: UDP, kNet over TCP and HTTP on one port number
	bots int           // bots per transport (bots.go)
	fed  chan struct{} // closed once every bot has had snapshots (the test)
}

func main() {
	var o options
	flag.StringVar(&o.addr, "addr", "127.0.0.1:7000", "the game: UDP and TCP on this port number; HTTP on TCP: tokens (POST /token), WebSocket (/knet), metrics, pages (/)")
	flag.IntVar(&o.bots, "bots", 3, "bots over each of UDP, TCP and WebSocket (0: none)")
	duration := flag.Duration("duration", 0, "drain and exit after this long (0: at SIGTERM or Ctrl-C)")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if *duration > 0 {
		time.AfterFunc(*duration, stop) // as a SIGTERM would
	}
	if _, err := run(ctx, o, os.Stdout); err != nil {
		log.Fatal("arena: ", err)
	}
}

type server struct {
	l        *knet.Listener
	pub      []byte        // the server's public key, which clients check it by
	tokenKey []byte        // shared with whoever issues tokens: here, POST /token
	lastID   atomic.Uint64 // the players' ClientIDs
}

type player struct{ id, x, y int32 }

// run serves until ctx ends, then drains; it returns what the bots saw.
func run(ctx context.Context, o options, out io.Writer) ([]transportReport, error) {
	priv, pub, err := knet.GenerateKey() // a real server loads its key; clients ship pub
	if err != nil {
		return nil, err
	}
	g := knet.NewGroup() // every connection's events, for the tick
	s := &server{pub: pub, tokenKey: make([]byte, knet.TokenKeySize)}
	rand.Read(s.tokenKey)
	mux := http.NewServeMux() // HTTP on the game's TCP port too (Config.HTTP)
	s.l, err = knet.Listen("udp", o.addr, &knet.Config{
		PrivateKey: priv, TokenKey: s.tokenKey, // secure; only players with a token get in
		TCP: true, HTTP: mux, // kNet over TCP, and HTTP, on the same port number: for players without UDP
		Group: g,
		AdmitConn: func(c *knet.Conn, _ []byte) ([]byte, error) {
			c.SetUserData(&player{id: int32(c.Token().ClientID)}) // checked already: who the token names
			return nil, nil
		},
	})
	if err != nil {
		return nil, err
	}
	defer s.l.Close()
	mux.HandleFunc("POST /token", s.token)
	mux.Handle("/knet", s.l.WebSocketHandler("*")) // browsers: knet over WebSocket, from any page (tokens admit, not cookies)
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, _ *http.Request) { json.NewEncoder(w).Encode(s.stats()) })
	pages, _ := fs.Sub(web, "web")
	mux.Handle("/", http.FileServerFS(pages))
	fmt.Fprintf(out, "game on %v (UDP and TCP); http://%v/ (tokens, WebSocket, metrics, pages)\n", s.l.Addr(), s.l.Addr())
	ticking, stopTick := context.WithCancel(context.Background())
	ticked := make(chan struct{})
	go func() { defer close(ticked); s.tick(ticking, g) }()
	bots := startBots("http://"+s.l.Addr().String(), o.bots, o.fed)
	<-ctx.Done()                    // SIGTERM, Ctrl-C or -duration
	for tr, st := range s.stats() { // in no order
		fmt.Fprintf(out, "%-9s %d players, mean RTT %v, messages sent %d, received %d\n", tr, st.Players, st.RTT, st.Sent, st.Received)
	}
	dctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err = s.l.DrainWithError(dctx, closeDrain, "server shutting down: rejoin") // every player told, and waited for
	fmt.Fprintf(out, "drained: %d players left (err %v)\n", s.l.Stats().Connections, err)
	stopTick()
	<-ticked
	return bots.report(out, err)
}

// token issues a connect token to whoever asks: a backend's job, here for
// brevity. A real one checks who asks (a login); tokenKey stays secret.
func (s *server) token(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Access-Control-Allow-Origin", "*") // a page served elsewhere (a dev server) may ask too
	game, id := netip.MustParseAddrPort(s.l.Addr().String()), s.lastID.Add(1)
	tok, err := knet.IssueToken(s.tokenKey, knet.Token{
		ClientID: id, // the player's id in snapshots
		Expires:  time.Now().Add(30 * time.Second),
		Servers:  []netip.AddrPort{game}, // the Listener's address, for TCP and WebSocket too
	})
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	json.NewEncoder(w).Encode(map[string]any{"token": tok, "serverKey": s.pub, "id": id, // bytes in base64
		"game": game.String(), "webSocket": "/knet"}) // UDP and TCP address; a path here
}

// tick is the game loop: take what the players did, move them, and send
// everyone the newest snapshot, 20 times a second.
func (s *server) tick(ctx context.Context, g *knet.Group) {
	players := map[*knet.Conn]*player{}
	events := make([]knet.Event, 256)
	t := time.NewTicker(time.Second / tickRate)
	for ctx.Err() == nil {
		now := <-t.C
		for n := len(events); n == len(events); { // a full buffer: there may be more
			n = g.Poll(events)
			for _, e := range events[:n] {
				p := e.Conn.UserData().(*player)
				switch e.Kind {
				case knet.EventConnected:
					players[e.Conn] = p
				case knet.EventMessage:
					if in := e.Message.Payload; e.Message.ID == msgInput && len(in) == 2 {
						p.x, p.y = p.x+int32(int8(in[0])), p.y+int32(int8(in[1]))
					}
				case knet.EventDisconnected: // e.Err says why
					delete(players, e.Conn)
				}
			}
		}
		snap := binary.LittleEndian.AppendUint64(nil, uint64(now.UnixNano()))
		conns := make([]*knet.Conn, 0, len(players))
		for c, p := range players {
			if len(snap) < 1000 { // one datagram: more players want interest management
				snap = append(binary.LittleEndian.AppendUint32(snap, uint32(p.id)), byte(p.x), byte(p.x>>8), byte(p.y), byte(p.y>>8))
			}
			conns = append(conns, c)
		}
		// Latest state: a newer snapshot replaces one still queued; never waits.
		knet.Broadcast(conns, knet.Message{ID: msgSnapshot, ContentID: 1, Payload: snap}, nil)
	}
}

// transportStats is what /metrics and the drain print say of each transport.
type transportStats struct {
	Players        int
	RTT            time.Duration // mean Stats.RTT (nanoseconds in JSON); docs/server.md says what it measures
	Sent, Received uint64        // messages: snapshots out, inputs in
}

func (s *server) stats() map[string]transportStats {
	m := map[string]transportStats{}
	for _, c := range s.l.Conns() {
		tr, cs := c.Transport().String(), c.Stats()
		st := m[tr]
		st.RTT = (st.RTT*time.Duration(st.Players) + cs.RTT) / time.Duration(st.Players+1)
		st.Players, st.Sent, st.Received = st.Players+1, st.Sent+cs.MessagesSent, st.Received+cs.MessagesReceived
		m[tr] = st
	}
	return m
}
