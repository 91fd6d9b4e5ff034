//go:build race

package knet

// raceEnabled: under the race detector sync.Pool drops what it is given at
// random, so allocation counts mean nothing.
const raceEnabled = true
