package knetprom_test

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/knet-go/knet"
	knetprom "github.com/knet-go/knet/contrib/prometheus"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// echoServer listens on loopback and echoes every message on every
// connection; Admit refuses a ConnectPayload of "stranger". The test's end
// closes it and waits for its goroutines.
func echoServer(t *testing.T) *knet.Listener {
	t.Helper()
	l, err := knet.Listen("udp", "127.0.0.1:0", &knet.Config{
		Admit: func(_ net.Addr, payload []byte) ([]byte, error) {
			if string(payload) == "stranger" {
				return nil, errors.New("go away")
			}
			return nil, nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := l.AcceptConn(context.Background())
			if err != nil {
				return
			}
			wg.Go(func() {
				defer c.Close()
				for {
					m, err := c.Receive(context.Background())
					if err != nil || c.Send(m) != nil {
						return
					}
				}
			})
		}
	})
	t.Cleanup(func() {
		l.Close()
		wg.Wait()
	})
	return l
}

// dialEcho connects to l and has n reliable messages echoed.
func dialEcho(t *testing.T, l *knet.Listener, n int) *knet.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := knet.Dial(ctx, "udp", l.Addr().String(), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	for i := range n {
		if err := c.Send(knet.Message{ID: 100, Payload: []byte{byte(i), 1, 2, 3}, Reliable: true}); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Receive(ctx); err != nil {
			t.Fatal(err)
		}
	}
	return c
}

// scrape serves reg over HTTP as Prometheus would scrape it, and parses
// the text exposition.
func scrape(t *testing.T, reg *prometheus.Registry) map[string]*dto.MetricFamily {
	t.Helper()
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorHandling: promhttp.HTTPErrorOnError}))
	defer srv.Close()
	resp, err := http.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape: %s", resp.Status)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return fams
}

// find returns the metric of family name whose labels include labels
// (name, value pairs), failing the test if there is none.
func find(t *testing.T, fams map[string]*dto.MetricFamily, name string, labels ...string) *dto.Metric {
	t.Helper()
	f := fams[name]
	if f == nil {
		t.Fatalf("no metric %s", name)
	}
next:
	for _, m := range f.GetMetric() {
		for i := 0; i+1 < len(labels); i += 2 {
			found := false
			for _, lp := range m.GetLabel() {
				if lp.GetName() == labels[i] && lp.GetValue() == labels[i+1] {
					found = true
				}
			}
			if !found {
				continue next
			}
		}
		return m
	}
	t.Fatalf("no metric %s with labels %v", name, labels)
	return nil
}

// value is the value of a counter or gauge (find).
func value(t *testing.T, fams map[string]*dto.MetricFamily, name string, labels ...string) float64 {
	t.Helper()
	m := find(t, fams, name, labels...)
	switch {
	case m.Counter != nil:
		return m.Counter.GetValue()
	case m.Gauge != nil:
		return m.Gauge.GetValue()
	}
	t.Fatalf("%s is neither a counter nor a gauge", name)
	return 0
}

// waitFor polls cond every millisecond until it holds, failing the test
// after five seconds.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 5s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// Two clients have five messages each echoed and a third is refused: a
// scrape over HTTP shows two connections, two handshakes, the refusal
// under its reason, ten messages each way, bytes, and an RTT and a loss
// sample per connection. When a client leaves, the sums keep its counts.
func TestListenerCollector(t *testing.T) {
	l := echoServer(t)
	const n = 5
	c1 := dialEcho(t, l, n)
	c2 := dialEcho(t, l, n)
	_, err := knet.Dial(context.Background(), "udp", l.Addr().String(), &knet.Config{ConnectPayload: []byte("stranger")})
	if !errors.Is(err, knet.ErrRefused) {
		t.Fatalf("stranger: %v, want ErrRefused", err)
	}
	// Accept returns a connection before the listener counts it, and the
	// refused attempt's connection ends after the refusal went out.
	waitFor(t, "two handshakes counted, none pending", func() bool {
		st := l.Stats()
		return st.Established == 2 && st.Pending == 0
	})

	reg := prometheus.NewPedanticRegistry() // checks what is collected against Describe
	reg.MustRegister(knetprom.NewListenerCollector(l, &knetprom.Options{PerConnection: true}))
	fams := scrape(t, reg)

	eq := func(name string, want float64, labels ...string) {
		t.Helper()
		if got := value(t, fams, name, labels...); got != want {
			t.Errorf("%s%v = %v, want %v", name, labels, got, want)
		}
	}
	positive := func(name string, labels ...string) float64 {
		t.Helper()
		v := value(t, fams, name, labels...)
		if v <= 0 {
			t.Errorf("%s%v = %v, want > 0", name, labels, v)
		}
		return v
	}
	eq("knet_connections", 2)
	eq("knet_connections_pending", 0)
	eq("knet_handshakes_completed_total", 2)
	eq("knet_handshakes_refused_total", 1, "reason", "other")
	eq("knet_handshakes_refused_total", 0, "reason", "token")
	eq("knet_handshakes_refused_total", 0, "reason", "oversized_reply")
	eq("knet_messages_received_total", 2*n)
	eq("knet_messages_sent_total", 2*n)
	eq("knet_protocol_errors_total", 0)
	eq("knet_datagrams_dropped_total", 0, "reason", "invalid")
	bytesIn := positive("knet_bytes_received_total")
	positive("knet_bytes_sent_total")
	positive("knet_datagrams_received_total")
	positive("knet_datagrams_sent_total")
	positive("knet_socket_writes_total")

	rtt := find(t, fams, "knet_rtt_seconds").GetHistogram()
	if rtt.GetSampleCount() != 2 || rtt.GetSampleSum() <= 0 || rtt.GetSampleSum() > 2 {
		t.Errorf("knet_rtt_seconds: %d samples summing to %vs, want 2 of a loopback's", rtt.GetSampleCount(), rtt.GetSampleSum())
	}
	// The buckets, and the +Inf one the exposition adds.
	if b := rtt.GetBucket(); len(b) != len(knetprom.DefaultRTTBuckets)+1 || b[len(b)-2].GetCumulativeCount() != 2 {
		t.Errorf("knet_rtt_seconds buckets: %v", b)
	}
	if loss := find(t, fams, "knet_loss_ratio").GetHistogram(); loss.GetSampleCount() != 2 {
		t.Errorf("knet_loss_ratio: %d samples, want 2", loss.GetSampleCount())
	}

	// Per connection, by the client's address as the server sees it.
	if got := len(fams["knet_connection_rtt_seconds"].GetMetric()); got != 2 {
		t.Errorf("knet_connection_rtt_seconds: %d series, want 2", got)
	}
	for _, c := range []*knet.Conn{c1, c2} {
		remote := c.LocalAddr().String()
		eq("knet_connection_messages_received_total", n, "remote", remote)
		if v := value(t, fams, "knet_connection_rtt_seconds", "remote", remote); v <= 0 {
			t.Errorf("knet_connection_rtt_seconds{remote=%s} = %v", remote, v)
		}
	}

	// A client leaves: one connection left, and the sums keep its counts.
	if err := c1.Close(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the server's side of c1 to end", func() bool { return len(l.Conns()) == 1 })
	fams = scrape(t, reg)
	eq("knet_connections", 1)
	eq("knet_handshakes_completed_total", 2)
	eq("knet_messages_received_total", 2*n)
	eq("knet_messages_sent_total", 2*n)
	if got := value(t, fams, "knet_bytes_received_total"); got < bytesIn {
		t.Errorf("knet_bytes_received_total went down: %v, then %v", bytesIn, got)
	}
	if rtt := find(t, fams, "knet_rtt_seconds").GetHistogram(); rtt.GetSampleCount() != 1 {
		t.Errorf("knet_rtt_seconds: %d samples, want 1", rtt.GetSampleCount())
	}
	if got := len(fams["knet_connection_rtt_seconds"].GetMetric()); got != 1 {
		t.Errorf("knet_connection_rtt_seconds: %d series, want 1", got)
	}
}

// Two listeners' collectors go in one registry with ConstLabels telling
// them apart, and without the option there are no per-connection series.
func TestListenerCollectorsSideBySide(t *testing.T) {
	game, chat := echoServer(t), echoServer(t)
	dialEcho(t, game, 3)
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(knetprom.NewListenerCollector(game, &knetprom.Options{ConstLabels: prometheus.Labels{"listener": "game"}}))
	reg.MustRegister(knetprom.NewListenerCollector(chat, &knetprom.Options{ConstLabels: prometheus.Labels{"listener": "chat"}}))
	fams := scrape(t, reg)
	if got := value(t, fams, "knet_messages_received_total", "listener", "game"); got != 3 {
		t.Errorf("game: %v messages received, want 3", got)
	}
	if got := value(t, fams, "knet_messages_received_total", "listener", "chat"); got != 0 {
		t.Errorf("chat: %v messages received, want 0", got)
	}
	if f := fams["knet_connection_rtt_seconds"]; f != nil {
		t.Errorf("per-connection series without the option: %v", f)
	}
}

// A dialed connection's collector shows its counters, labelled with the
// server's address.
func TestConnCollector(t *testing.T) {
	l := echoServer(t)
	const n = 4
	c := dialEcho(t, l, n)
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(knetprom.NewConnCollector(c, nil))
	fams := scrape(t, reg)
	remote := l.Addr().String()
	for _, name := range []string{"knet_connection_messages_sent_total", "knet_connection_messages_received_total"} {
		if got := value(t, fams, name, "remote", remote); got != n {
			t.Errorf("%s = %v, want %d", name, got, n)
		}
	}
	if got := value(t, fams, "knet_connection_bytes_sent_total", "remote", remote); got <= 0 {
		t.Errorf("knet_connection_bytes_sent_total = %v", got)
	}
	if got := value(t, fams, "knet_connection_rtt_seconds", "remote", remote); got <= 0 || got > 1 {
		t.Errorf("knet_connection_rtt_seconds = %v", got)
	}
	if got := value(t, fams, "knet_connection_quality", "remote", remote); got <= 0 || got > 1 {
		t.Errorf("knet_connection_quality = %v", got)
	}
}

// A secure listener refuses a client without a connect token: the refusal
// counts under reason="token", and not again under "other", although
// ListenerStats.RefusedAttempts has it too.
func TestListenerCollectorTokenRefusal(t *testing.T) {
	private, public, err := knet.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	l, err := knet.Listen("udp", "127.0.0.1:0", &knet.Config{PrivateKey: private, TokenKey: make([]byte, knet.TokenKeySize)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = knet.Dial(ctx, "udp", l.Addr().String(), &knet.Config{ServerKey: public})
	if !errors.Is(err, knet.ErrTokenRejected) {
		t.Fatalf("dial without a token: %v, want ErrTokenRejected", err)
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(knetprom.NewListenerCollector(l, nil))
	fams := scrape(t, reg)
	for reason, want := range map[string]float64{"token": 1, "other": 0, "oversized_reply": 0} {
		if got := value(t, fams, "knet_handshakes_refused_total", "reason", reason); got != want {
			t.Errorf("knet_handshakes_refused_total{reason=%q} = %v, want %v", reason, got, want)
		}
	}
	if got := value(t, fams, "knet_key_exchanges_total"); got != 1 {
		t.Errorf("knet_key_exchanges_total = %v, want 1", got)
	}
	if got := value(t, fams, "knet_handshakes_completed_total"); got != 0 {
		t.Errorf("knet_handshakes_completed_total = %v, want 0", got)
	}
}

// A relay's allocations and what it refused: one allocation held, the
// next refused (MaxAllocations 1), nothing forwarded yet.
func TestListenerCollectorRelay(t *testing.T) {
	l, err := knet.Listen("udp4", "127.0.0.1:0", nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	l.ServeRelay(knet.RelayConfig{MaxAllocations: 1})
	at := netip.MustParseAddr("127.0.0.1")
	if _, _, err := l.AllocateRelay(at); err != nil {
		t.Fatal(err)
	}
	if _, _, err := l.AllocateRelay(at); !errors.Is(err, knet.ErrRelayRefused) {
		t.Fatalf("second allocation: %v, want ErrRelayRefused", err)
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(knetprom.NewListenerCollector(l, nil))
	fams := scrape(t, reg)
	for _, m := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{"knet_relay_allocations", nil, 1},
		{"knet_relay_refused_total", nil, 1},
		{"knet_relay_datagrams_total", []string{"result", "forwarded"}, 0},
		{"knet_relay_forwarded_bytes_total", nil, 0},
	} {
		if got := value(t, fams, m.name, m.labels...); got != m.want {
			t.Errorf("%s%v = %v, want %v", m.name, m.labels, got, m.want)
		}
	}
}
