// Command knetcat is a netcat for kNet over UDP (and TCP, with -tcp): it connects to a kNet
// peer, or listens for any number of them, sends what it reads as
// messages and prints the messages that arrive.
//
//	knetcat [flags] host:port      # connect
//	knetcat -l addr [flags]        # listen
//
// Each line of standard input goes as one message, without its newline
// (in listen mode, to every client connected at the time; reading starts
// once the first client has connected). Each message that arrives is
// printed as text followed by a newline (-hex: in hex; -v: prefixed with
// the peer, the message ID and its flags); in listen mode each line is
// prefixed with the peer it came from once more than one client has
// connected.
//
// Examples:
//
//	knetcat -l 127.0.0.1:7000                  # print what clients send; type lines to send them to every client
//	knetcat 127.0.0.1:7000                     # talk to it
//	echo hello | knetcat -n 1 127.0.0.1:7000   # send a line, print one reply (the echo example's server echoes)
//	knetcat -l :7000 -echo                     # an echo server: go run ./examples/echo -connect 127.0.0.1:7000
//	knetcat -f picture.png 127.0.0.1:7000      # a file as one message (knet fragments it)
//	knetcat -f big.iso -chunk 65536 host:7000  # a file as a stream of 64 KiB messages, in order
//	knetcat -id 200 -unreliable -inorder -channel 3 host:7000
//	knetcat -dialect reference host:2345       # talk to the C++ reference kNet
//	knetcat -tcp host:2345                     # over TCP (the reference's TCP transport, or a knet server's -tcp)
//	knetcat -l :7000 -tcp                      # take TCP clients too, on port 7000
//	knetcat -trace -stats host:7000            # print every datagram decoded, and the statistics at the end
//	knetcat -genkey server.key                 # a key pair for secure sessions: prints the public key
//	knetcat -l :7000 -key server.key           # a secure server (encrypted, authenticated sessions only)
//	knetcat -serverkey 3b6a...e1 host:7000     # connect securely: fails unless the server holds the key
//	knetcat -l :7000 -info "name=den;players=0" # answer server queries with this info
//	knetcat -query host:7000                   # ask a server for its info, without connecting
//	knetcat -discover 192.168.1.255:7000       # ask every server on the LAN at port 7000
//
// Flags:
//
//	-l addr          listen on addr instead of connecting
//	-f path          send the file as one message instead of reading lines; repeat for more files; - is standard input
//	-chunk n         with -f, send each file as messages of at most n bytes, in order (InOrder on -channel)
//	-id n            message ID to send (default 100; 6..0x3FFFFFFA)
//	-reliable        send reliably (the default); -unreliable sends unreliably
//	-inorder         deliver in order within -channel n (default 0)
//	-priority n      send priority (-128..127, higher first)
//	-dialect d       wire: auto (default: listen serves both, connect speaks spec), spec or reference
//	-hex             print payloads in hex
//	-v               prefix each message with peer, ID and flags; report connections on standard error
//	-echo            send every message received back to its sender (implies -keep)
//	-keep            at the end of the input, keep receiving until the peer closes (listen: until interrupted)
//	-n count         end after receiving count messages, whatever the input does
//	-stats           print each connection's statistics on standard error when it ends
//	-stats-every d   and every d while it runs
//	-trace           print every datagram, both ways, decoded (knet.DescribeDatagram), on standard error
//	-tcp             connect over TCP (kNet over TCP, the C++ reference's framing); with -l, take TCP connections too, on the same port number (not with -trace, -query, -discover)
//	-genkey path     write a new private key to path (hex, mode 0600), print its public key in hex, and exit
//	-key path        with -l: serve secure sessions only, with the private key in path
//	-serverkey hex   connect securely to the server with this public key
//	-query           ask the server for its info (a server query) instead of connecting: print "address rtt info"
//	-discover        send a server query to the address (a broadcast address finds every server on the LAN at its port) and print each answer, for -wait (default 1s)
//	-info text       with -l, answer server queries with this info (at most knet.MaxQueryInfo bytes)
//
// At the end of the input knetcat closes gracefully: knet delivers what is
// queued, then disconnects; a reply still on its way is not printed (use
// -n or -keep to wait for replies). It also ends when the peer closes
// (connect mode) or on an interrupt, gracefully. The exit status is 0 for
// a graceful end, 1 for an error (a failed connection, a connection lost,
// an unreadable file), 2 for bad usage.
//
// With -trace, knetcat puts a small UDP relay between the kNet connection
// and the network, since knet owns its socket: in connect mode knet talks
// to the relay on a loopback port and the relay to the peer; in listen
// mode the relay listens on the -l address and knet on a loopback port,
// one relay socket per client, so that knet still tells the clients
// apart. Each datagram is printed as it passes, in the dialect of its flow
// (with -dialect auto, the reference's when the flow opened with its 8
// zero bytes). A peer that is not there shows as a timeout rather than
// as a refused port through the relay.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	go func() {
		<-ctx.Done()
		stop() // a second interrupt ends knetcat at once
	}()
	os.Exit(run(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
}
