module github.com/knet-go/knet/bench

go 1.26.8

require (
	github.com/knet-go/knet v0.0.0
	github.com/quic-go/quic-go v0.65.0
	github.com/xtaci/kcp-go/v5 v5.6.24
	golang.org/x/exp v0.0.0-20261113113407-e3970619a1a4
	golang.org/x/net v0.62.0
)

require (
	github.com/coder/websocket v1.8.15 // indirect
	github.com/flynn/noise v1.1.0 // indirect
	github.com/klauspost/cpuid/v2 v2.2.6 // indirect
	github.com/klauspost/reedsolomon v1.12.0 // indirect
	github.com/pkg/errors v0.9.1 // indirect
	github.com/tjfoc/gmsm v1.4.1 // indirect
	golang.org/x/crypto v0.58.0 // indirect
	golang.org/x/sys v0.49.0 // indirect
)

replace github.com/knet-go/knet => ../
