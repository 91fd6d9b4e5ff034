// Package nattest builds real NATs on one machine, for tests: per test, a
// "public" network where servers live and two private networks, each
// behind a NAT router of a given type (full cone, restricted cone,
// port-restricted cone, symmetric), made of Linux network namespaces,
// veth pairs and nftables rules, and removed when the test ends. It needs
// Linux, root, iproute2 ("ip") and nftables ("nft"); elsewhere, or
// without them, New skips the test naming what is missing (or fails it
// with KNET_REQUIRE_TOOLS=1: internal/testtool).
//
// The layout (addresses are fixed: each test has namespaces of its own):
//
//	public  203.0.113.1, 203.0.113.2, 203.0.113.3 (servers), on a bridge
//	  ├── router A  wan 203.0.113.11 ── lan 10.0.1.1 ── host A 10.0.1.2
//	  └── router B  wan 203.0.113.12 ── lan 10.0.2.1 ── host B 10.0.2.2
//
// The private hosts route everything through their router; the public
// network has no route to the private ones. See nattest_linux.go for how
// each type is made, and Node.Run for how code runs inside a namespace.
// Net.Flush makes a router forget every mapping at once, as one that
// restarts or whose mappings expired mid-game.
package nattest
