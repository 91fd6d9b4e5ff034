//go:build !linux

package knet

import (
	"errors"
	"net"
)

// listenReusePort is Linux's: elsewhere SO_REUSEPORT does not spread
// datagrams over the sockets.
func listenReusePort(network string, laddr *net.UDPAddr) (*net.UDPConn, error) {
	return nil, errors.New("knet: Config.Sockets above 1 needs SO_REUSEPORT as Linux has it")
}
