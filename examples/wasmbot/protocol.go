package main

import "github.com/knet-go/knet"

// What the bot and the server share: the messages of the exchange, one
// kind for each delivery mode, and the report the bot posts.

// A mode is a delivery mode of the exchange, and its message ID.
type mode struct {
	name string
	id   uint32
}

var modes = []mode{
	{"reliable", 10},
	{"ordered", 11},   // reliable, in order
	{"sequenced", 12}, // unreliable, in order: the latest wins
	{"unreliable", 13},
	{"latest", 14}, // reliable, one ContentID: the latest replaces what waits
}

// perMode is how many messages the bot sends in each mode; bigID is a
// last reliable message larger than any one write to the stream.
const (
	perMode = 50
	bigID   = 20
	bigSize = 100 << 10
	// payload is the ConnectPayload the bot sends, and reason its close's.
	payload = "wasmbot"
	reason  = "wasmbot done"
)

// message is the k-th message of mode m, as the bot sends it.
func (m mode) message(k int) knet.Message {
	msg := knet.Message{ID: m.id, Payload: []byte{byte(k)}}
	switch m.name {
	case "reliable":
		msg.Reliable = true
	case "ordered":
		msg.Reliable, msg.InOrder = true, true
	case "sequenced":
		msg.InOrder = true
	case "latest":
		msg.Reliable, msg.ContentID = true, 1
	}
	return msg
}

// report is what the bot posts to /result when it is done, as JSON.
type report struct {
	OK        bool           `json:"ok"`
	Error     string         `json:"error,omitempty"`
	Transport string         `json:"transport"`    // Conn.Transport
	Dialect   string         `json:"dialect"`      // Conn.Dialect
	Welcome   string         `json:"welcome"`      // the server's Admit reply
	Echoed    map[string]int `json:"echoed"`       // messages back, by mode
	InOrder   bool           `json:"inOrder"`      // reliable and ordered came back in order
	BigOK     bool           `json:"bigOK"`        // the large message came back whole
	DialUDP   string         `json:"dialUDPError"` // what Dial over UDP says in a browser
	CloseErr  string         `json:"closeError"`   // what the graceful close returned ("" for nil)
}

// The page's background once the bot is done.
const (
	successColor = "rgb(0, 160, 64)"
	failureColor = "rgb(200, 0, 0)"
)
