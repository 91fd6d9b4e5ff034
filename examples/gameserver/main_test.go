package main

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/knet-go/knet"
)

// The example runs, every ordinary bot gets snapshots and has its inputs
// applied, the forged token is refused and the misbehaving bots are
// kicked, with their reasons; every world a bot rebuilt from a delta
// snapshot matches the server's: on a clean loopback (with the example's
// 32 bots, where deltas are at least 3x smaller than full snapshots), and
// at 5% and 20% loss.
func TestGameServerSmoke(t *testing.T) {
	for _, tc := range []struct {
		name     string
		bots     int
		sim      knet.Simulation
		minRate  float64 // of snapshots and inputs delivered
		minRatio float64 // full snapshot bytes over those sent
		plain    bool    // without the misbehaving bots
		tcp, ws  int     // bots over TCP, over WebSocket
	}{
		{"clean", 32, knet.Simulation{}, 0.8, 3, false, 4, 4}, // 32 bots in one process, -race and other packages' tests beside: 0.8
		{"loss5", 6, knet.Simulation{Loss: 0.05, Delay: 5 * time.Millisecond, Jitter: 5 * time.Millisecond, Seed: 3}, 0.7, 1.5, false, 1, 1},
		{"loss20", 6, knet.Simulation{Loss: 0.2, Delay: 5 * time.Millisecond, Jitter: 5 * time.Millisecond, Seed: 4}, 0.5, 1.5, true, 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			res, err := run(ctx, options{bots: tc.bots, duration: 2500 * time.Millisecond, rate: 30, sim: tc.sim, worst: 6, plain: tc.plain, tcp: tc.tcp, ws: tc.ws}, &out)
			t.Log("\n" + out.String())
			if err != nil {
				t.Fatal(err)
			}
			if want := "name=knet example;map=torus 1000;players=0"; res.queryInfo != want {
				t.Errorf("server query answered %q, want %q", res.queryInfo, want)
			}
			late := 0
			for _, b := range res.bots {
				if b.kickCode == closeRoundOver {
					late++ // its handshake outlasted the round (the report says so)
					continue
				}
				if b.snaps == 0 || len(b.ages) == 0 || b.inputsSent == 0 {
					t.Errorf("%s: %d snapshots, %d inputs sent", b.name, b.snaps, b.inputsSent)
				}
				if b.used != b.transport {
					t.Errorf("%s: over %v, meant to be over %v", b.name, b.used, b.transport)
				}
				if b.transport != knet.TransportUDP && (b.checked == 0 || b.wrong != 0) {
					t.Errorf("%s over %v: %d worlds checked, %d wrong", b.name, b.transport, b.checked, b.wrong)
				}
			}
			if late > len(res.bots)/3 {
				t.Errorf("%d of %d bots joined after the round", late, len(res.bots))
			}
			if res.refused.refused != "bad join token" && !tc.plain {
				t.Errorf("refusal reason %q", res.refused.refused)
			}
			if (res.spammer.kickCode != closeChatSpam || res.idler.kickCode != closeIdle) && !tc.plain {
				t.Errorf("kicks: spammer %d %q, idler %d %q", res.spammer.kickCode, res.spammer.kickReason, res.idler.kickCode, res.idler.kickReason)
			}
			if r := float64(res.snapsRecv) / float64(res.snapsSent); r < tc.minRate || r > 1 {
				t.Errorf("snapshots delivered: %d of %d", res.snapsRecv, res.snapsSent)
			}
			if r := float64(res.inputsApplied) / float64(res.inputsSent); r < tc.minRate || r > 1 {
				t.Errorf("inputs applied: %d of %d", res.inputsApplied, res.inputsSent)
			}
			if res.checked == 0 || res.wrong != 0 || res.bad != 0 {
				t.Errorf("worlds rebuilt: %d checked, %d wrong, %d unreadable", res.checked, res.wrong, res.bad)
			}
			if res.deltas == 0 {
				t.Error("no snapshot went as a delta")
			}
			// The encoding's gain, on the snapshots sent as deltas: the
			// target (3x at 0% loss). Overall, snapshots before a first
			// receipt go in full, and how many depends on how fast the
			// machine runs the bots: under -race beside other packages'
			// tests it fell to 2.0x once, so overall 1.8x is asked.
			if r := float64(res.deltaFull) / float64(res.deltaBytes); r < tc.minRatio {
				t.Errorf("delta snapshots %.2fx smaller than in full, want %.1fx", r, tc.minRatio)
			}
			if r := float64(res.fullBytes) / float64(res.sentBytes); r < min(tc.minRatio, 1.8) {
				t.Errorf("snapshots %.2fx smaller than in full overall, want %.1fx", r, min(tc.minRatio, 1.8))
			}
			if res.ageP50 <= 0 || res.ageP99 < res.ageP50 || res.ageP99 > time.Second {
				t.Errorf("snapshot age p50 %v p99 %v", res.ageP50, res.ageP99)
			}
		})
	}
}
