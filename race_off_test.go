//go:build !race

package knet

const raceEnabled = false
