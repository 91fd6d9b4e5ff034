// Package knetprom exports knet's counters to Prometheus: a collector for
// a server's Listener and its connections, and one for a single dialed
// connection. Both read Listener.Stats and Conn.Stats on each scrape and
// keep no goroutine of their own.
//
//	l, err := knet.Listen("udp", ":7000", cfg)
//	...
//	prometheus.MustRegister(knetprom.NewListenerCollector(l, nil))
//	http.Handle("/metrics", promhttp.Handler())
//
// It is a module of its own, so that knet itself does not depend on the
// Prometheus client.
package knetprom

import (
	"maps"
	"net"
	"sync"

	"github.com/knet-go/knet"
	"github.com/prometheus/client_golang/prometheus"
)

// Options configure a collector. Nil or the zero value is fine.
type Options struct {
	// ConstLabels are added to every metric of the collector. Two
	// collectors of the same kind in one registry need them to differ
	// (say listener="game" and listener="chat").
	ConstLabels prometheus.Labels
	// RTTBuckets are the upper bounds, in seconds, of the round-trip
	// histogram's buckets (knet_rtt_seconds). Nil: DefaultRTTBuckets.
	RTTBuckets []float64
	// LossBuckets are the upper bounds of the loss histogram's buckets
	// (knet_loss_ratio), as fractions. Nil: DefaultLossBuckets.
	LossBuckets []float64
	// PerConnection adds the knet_connection_* metrics of every current
	// connection, labelled with its remote address. That is a series per
	// metric per player: off by default.
	PerConnection bool
}

// DefaultRTTBuckets are the round-trip histogram's buckets, in seconds:
// from a LAN's millisecond to a second.
var DefaultRTTBuckets = []float64{.001, .0025, .005, .01, .025, .05, .1, .15, .25, .5, 1}

// DefaultLossBuckets are the loss histogram's buckets: the first holds the
// connections that lost nothing.
var DefaultLossBuckets = []float64{0, .001, .005, .01, .02, .05, .1, .25, .5}

// A connCounter is one of a connection's counters (knet.Stats), exported
// summed over a listener's connections and per connection.
type connCounter struct {
	name, help string
	label      string // the value of the reason label, if the metric has one
	get        func(*knet.Stats) uint64
}

// connCounters are the counters exported, in the order of a sums array.
// The ones that share a name differ by their reason label.
var connCounters = [...]connCounter{
	{"datagrams_sent_total", "Datagrams sent, retransmissions included.", "", func(s *knet.Stats) uint64 { return s.DatagramsSent }},
	{"datagrams_received_total", "Valid datagrams received, duplicates included.", "", func(s *knet.Stats) uint64 { return s.DatagramsReceived }},
	{"bytes_sent_total", "UDP payload bytes sent.", "", func(s *knet.Stats) uint64 { return s.BytesSent }},
	{"bytes_received_total", "UDP payload bytes received.", "", func(s *knet.Stats) uint64 { return s.BytesReceived }},
	{"messages_sent_total", "Application messages sent.", "", func(s *knet.Stats) uint64 { return s.MessagesSent }},
	{"messages_received_total", "Application messages delivered.", "", func(s *knet.Stats) uint64 { return s.MessagesReceived }},
	{"retransmits_total", "Reliable datagrams sent again.", "", func(s *knet.Stats) uint64 { return s.Retransmits }},
	{"fast_retransmits_total", "Datagrams taken for lost on ack gaps, before any timeout.", "", func(s *knet.Stats) uint64 { return s.FastRetransmits }},
	{"spurious_losses_total", "Datagrams taken for lost, or resent on a timeout, that were only late.", "", func(s *knet.Stats) uint64 { return s.SpuriousLosses }},
	{"datagrams_dropped_total", datagramsDroppedHelp, "invalid", func(s *knet.Stats) uint64 { return s.InvalidDatagrams }},
	{"datagrams_dropped_total", datagramsDroppedHelp, "duplicate", func(s *knet.Stats) uint64 { return s.DuplicateDatagrams }},
	{"datagrams_dropped_total", datagramsDroppedHelp, "no_room", func(s *knet.Stats) uint64 { return s.DroppedDatagrams }},
	{"messages_dropped_total", "Unreliable messages dropped: send queue full, receive buffer full, or too late to be in order.", "", func(s *knet.Stats) uint64 { return s.DroppedMessages }},
	{"send_errors_total", "Datagrams the system refused to send.", "", func(s *knet.Stats) uint64 { return s.SendErrors }},
	{"protocol_errors_total", "Well-formed datagrams that broke the protocol (each ended its connection).", "", func(s *knet.Stats) uint64 { return s.ProtocolErrors }},
	{"migrations_total", "Moves of secure connections to a new address of their client.", "", func(s *knet.Stats) uint64 { return s.Migrations }},
}

const datagramsDroppedHelp = "Datagrams dropped, by reason: invalid (malformed or failing authentication), duplicate, no_room (inbox or buffers full), stray (from an unknown address, not a connection attempt)."

// Indexes in connCounters of the counters the listener adds its own to.
const (
	iInvalid    = 9
	iSendErrors = 13
)

type sums [len(connCounters)]uint64

func (s *sums) add(st *knet.Stats) {
	for i := range connCounters {
		s[i] += connCounters[i].get(st)
	}
}

// counterDescs makes the descriptors of connCounters, prefix before their
// names, with the variable labels vars (and reason where it applies).
func counterDescs(prefix string, vars []string, constLabels prometheus.Labels) [len(connCounters)]*prometheus.Desc {
	var ds [len(connCounters)]*prometheus.Desc
	made := map[string]*prometheus.Desc{}
	for i, cc := range connCounters {
		d := made[cc.name]
		if d == nil {
			v := vars
			if cc.label != "" {
				v = append(v[:len(v):len(v)], "reason")
			}
			d = prometheus.NewDesc(prefix+cc.name, cc.help, v, constLabels)
			made[cc.name] = d
		}
		ds[i] = d
	}
	return ds
}

// labelValues are vals, and connCounters[i]'s reason if it has one.
func labelValues(i int, vals ...string) []string {
	if l := connCounters[i].label; l != "" {
		return append(vals, l)
	}
	return vals
}

// connDescs are the knet_connection_* metrics of one connection.
type connDescs struct {
	counters                 [len(connCounters)]*prometheus.Desc
	rtt, loss, quality, held *prometheus.Desc
}

// newConnDescs makes them with vars as variable labels (remote, for a
// listener's connections) or none (a dialed connection, whose remote
// address is among constLabels).
func newConnDescs(vars []string, constLabels prometheus.Labels) *connDescs {
	const p = "knet_connection_"
	return &connDescs{
		counters: counterDescs(p, vars, constLabels),
		rtt:      prometheus.NewDesc(p+"rtt_seconds", "The connection's smoothed round-trip time.", vars, constLabels),
		loss:     prometheus.NewDesc(p+"loss_ratio", "The fraction of the peer's datagrams lost over the last two seconds or so.", vars, constLabels),
		quality:  prometheus.NewDesc(p+"quality", "The path summed up from 1 (clean, round trip under 80ms) to 0 (25% loss, or a 500ms round trip).", vars, constLabels),
		held:     prometheus.NewDesc(p+"queued_bytes", "Payload bytes sent but not yet acked, or still queued.", vars, constLabels),
	}
}

func (d *connDescs) describe(ch chan<- *prometheus.Desc) {
	for i, c := range d.counters {
		if i == 0 || c != d.counters[i-1] {
			ch <- c
		}
	}
	ch <- d.rtt
	ch <- d.loss
	ch <- d.quality
	ch <- d.held
}

// collect sends st's metrics, with the variable label values vals.
func (d *connDescs) collect(ch chan<- prometheus.Metric, st *knet.Stats, vals ...string) {
	for i, cc := range connCounters {
		ch <- prometheus.MustNewConstMetric(d.counters[i], prometheus.CounterValue, float64(cc.get(st)), labelValues(i, vals...)...)
	}
	ch <- prometheus.MustNewConstMetric(d.rtt, prometheus.GaugeValue, st.RTT.Seconds(), vals...)
	ch <- prometheus.MustNewConstMetric(d.loss, prometheus.GaugeValue, st.LossRate, vals...)
	ch <- prometheus.MustNewConstMetric(d.quality, prometheus.GaugeValue, st.Quality, vals...)
	ch <- prometheus.MustNewConstMetric(d.held, prometheus.GaugeValue, float64(st.QueuedBytes), vals...)
}

// ListenerCollector is a prometheus.Collector of a Listener's counters
// and of its connections', read on each scrape (Listener.Stats,
// Listener.Conns, Conn.Stats). See the package's README for the metrics.
//
// The connections' counters (knet_bytes_sent_total...) are sums over the
// connections the collector has seen, those that ended included: a
// connection that ended counts with its final Stats, so the sums never go
// down. A connection that began and ended between two scrapes is not in
// them. The histograms and gauges are over the current connections.
//
// Calling Conn.Stats makes a connection publish its counters on each of
// its rounds from then on, a small cost per round; the first scrape waits
// for every connection's next round.
type ListenerCollector struct {
	l    *knet.Listener
	opts Options

	conns, pending, queued, recvQueued *prometheus.Desc
	rtt, loss                          *prometheus.Desc
	completed, refused, ignored        *prometheus.Desc
	writes, written                    *prometheus.Desc
	keyExchanges, cookies, replayed    *prometheus.Desc
	hsDropped, queries, reflections    *prometheus.Desc
	punch                              *prometheus.Desc
	relayAllocs, relayDatagrams        *prometheus.Desc
	relayBytes, relayRefused           *prometheus.Desc
	counters                           [len(connCounters)]*prometheus.Desc
	perConn                            *connDescs // with PerConnection

	mu sync.Mutex
	// The connections seen that had not ended.
	seen map[*knet.Conn]bool
	// The final counters of the connections seen that ended.
	ended sums
	// The highest count of refusals for other reasons than a token or an
	// oversized reply reported: it is a difference of counters read one
	// after another, which may fall short for a moment.
	refusedOther uint64
}

// NewListenerCollector returns a collector of l's counters; opts may be
// nil.
func NewListenerCollector(l *knet.Listener, opts *Options) *ListenerCollector {
	c := &ListenerCollector{l: l, seen: map[*knet.Conn]bool{}}
	if opts != nil {
		c.opts = *opts
		c.opts.ConstLabels = maps.Clone(opts.ConstLabels)
	}
	if c.opts.RTTBuckets == nil {
		c.opts.RTTBuckets = DefaultRTTBuckets
	}
	if c.opts.LossBuckets == nil {
		c.opts.LossBuckets = DefaultLossBuckets
	}
	cl := c.opts.ConstLabels
	desc := func(name, help string, vars ...string) *prometheus.Desc {
		return prometheus.NewDesc("knet_"+name, help, vars, cl)
	}
	c.conns = desc("connections", "Established connections that have not ended.")
	c.pending = desc("connections_pending", "Connections whose handshake is not complete.")
	c.queued = desc("queued_bytes", "Payload bytes the current connections sent but had not had acked, or still queued.")
	c.recvQueued = desc("receive_queued_bytes", "Payload bytes that arrived on the current connections and that the application has not taken yet.")
	c.rtt = desc("rtt_seconds", "The current connections' smoothed round-trip times.")
	c.loss = desc("loss_ratio", "The fractions of the peer's datagrams lost over the last two seconds or so, of the current connections.")
	c.completed = desc("handshakes_completed_total", "Connection attempts whose handshake completed and that were handed to the application.")
	c.refused = desc("handshakes_refused_total", "Connection attempts refused, by reason: token (missing, invalid, expired or used connect token), oversized_reply (an Admit reply too long to send), other (Admit's error, a full backlog, listening closed, a failed secure handshake).", "reason")
	c.ignored = desc("handshakes_ignored_total", "Connection attempts ignored: too many pending, or the listener closing.")
	c.writes = desc("socket_writes_total", "Writes to the listener's sockets (system calls, as a rule).")
	c.written = desc("socket_datagrams_written_total", "Datagrams those writes carried.")
	c.keyExchanges = desc("key_exchanges_total", "Secure attempts whose handshake message was read (an X25519 each).")
	c.cookies = desc("cookies_sent_total", "Secure attempts answered with a cookie to echo instead of a handshake.")
	c.replayed = desc("handshakes_replayed_total", "Secure attempts whose handshake message had cost a key exchange lately: dropped, or refused again.")
	c.hsDropped = desc("handshakes_dropped_total", "Secure attempts dropped before their key exchange, by reason: rate_limited (their source address), queue_full (too many waiting).", "reason")
	c.queries = desc("queries_total", "Server queries, by result: answered, dropped.", "result")
	c.reflections = desc("reflections_total", "Address reflections (the address an asker is seen at), by result: answered, dropped.", "result")
	c.punch = desc("punch_total", "Introduction asks and punch probes (hole punching), by result: answered, dropped.", "result")
	c.relayAllocs = desc("relay_allocations", "Relay allocations held (ServeRelay), each a socket.")
	c.relayDatagrams = desc("relay_datagrams_total", "Datagrams reaching a relay allocation, by result: forwarded, limited (over a bandwidth limit), dropped (from an address not proven, before the other side was, malformed).", "result")
	c.relayBytes = desc("relay_forwarded_bytes_total", "Bytes a relay forwarded.")
	c.relayRefused = desc("relay_refused_total", "Relay allocations refused (full) and binds refused.")
	c.counters = counterDescs("knet_", nil, cl)
	if c.opts.PerConnection {
		c.perConn = newConnDescs([]string{"remote"}, cl)
	}
	return c
}

// Describe implements prometheus.Collector.
func (c *ListenerCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.conns, c.pending, c.queued, c.recvQueued, c.rtt, c.loss,
		c.completed, c.refused, c.ignored, c.writes, c.written,
		c.keyExchanges, c.cookies, c.replayed, c.hsDropped, c.queries, c.reflections, c.punch,
		c.relayAllocs, c.relayDatagrams, c.relayBytes, c.relayRefused} {
		ch <- d
	}
	for i, d := range c.counters {
		if i == 0 || d != c.counters[i-1] {
			ch <- d
		}
	}
	if c.perConn != nil {
		c.perConn.describe(ch)
	}
}

// Collect implements prometheus.Collector.
func (c *ListenerCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	defer c.mu.Unlock()

	ls := c.l.Stats()
	current := c.l.Conns()
	stats := make([]knet.Stats, len(current))
	seen := make(map[*knet.Conn]bool, len(current))
	total := c.ended
	for i, conn := range current {
		stats[i] = conn.Stats()
		total.add(&stats[i])
		seen[conn] = true
	}
	// A connection seen before and gone from Conns has ended, or is
	// ending: its Stats are final once Done is closed (asked first).
	for conn := range c.seen {
		if seen[conn] {
			continue
		}
		select {
		case <-conn.Done():
			st := conn.Stats()
			c.ended.add(&st)
			total.add(&st)
		default:
			st := conn.Stats()
			total.add(&st)
			seen[conn] = true // counted as current until it is done
		}
	}
	c.seen = seen
	total[iInvalid] += ls.InvalidDatagrams
	total[iSendErrors] += ls.SendErrors
	for i, v := range total {
		ch <- prometheus.MustNewConstMetric(c.counters[i], prometheus.CounterValue, float64(v), labelValues(i)...)
	}
	ch <- prometheus.MustNewConstMetric(c.counters[iInvalid], prometheus.CounterValue, float64(ls.StrayDatagrams), "stray")

	gauge := func(d *prometheus.Desc, v float64, vals ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, vals...)
	}
	counter := func(d *prometheus.Desc, v uint64, vals ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), vals...)
	}
	var queued, recvQueued int
	for i := range stats {
		queued += stats[i].QueuedBytes
		recvQueued += stats[i].ReceiveQueuedBytes
	}
	gauge(c.conns, float64(len(current)))
	gauge(c.pending, float64(ls.Pending))
	gauge(c.queued, float64(queued))
	gauge(c.recvQueued, float64(recvQueued))
	ch <- histogram(c.rtt, c.opts.RTTBuckets, stats, func(s *knet.Stats) float64 { return s.RTT.Seconds() })
	ch <- histogram(c.loss, c.opts.LossBuckets, stats, func(s *knet.Stats) float64 { return s.LossRate })

	if ls.RefusedAttempts >= ls.RejectedTokens+ls.OversizedReplies {
		c.refusedOther = max(c.refusedOther, ls.RefusedAttempts-ls.RejectedTokens-ls.OversizedReplies)
	}
	counter(c.completed, ls.Established)
	counter(c.refused, ls.RejectedTokens, "token")
	counter(c.refused, ls.OversizedReplies, "oversized_reply")
	counter(c.refused, c.refusedOther, "other")
	counter(c.ignored, ls.IgnoredAttempts)
	counter(c.writes, ls.Writes)
	counter(c.written, ls.DatagramsWritten)
	counter(c.keyExchanges, ls.KeyExchanges)
	counter(c.cookies, ls.CookiesSent)
	counter(c.replayed, ls.ReplayedHandshakes)
	counter(c.hsDropped, ls.RateLimitedHandshakes, "rate_limited")
	counter(c.hsDropped, ls.DroppedHandshakes, "queue_full")
	counter(c.queries, ls.QueriesAnswered, "answered")
	counter(c.queries, ls.QueriesDropped, "dropped")
	counter(c.reflections, ls.ReflectionsAnswered, "answered")
	counter(c.reflections, ls.ReflectionsDropped, "dropped")
	counter(c.punch, ls.PunchAnswered, "answered")
	counter(c.punch, ls.PunchDropped, "dropped")
	gauge(c.relayAllocs, float64(ls.RelayAllocations))
	counter(c.relayDatagrams, ls.RelayForwarded, "forwarded")
	counter(c.relayDatagrams, ls.RelayLimited, "limited")
	counter(c.relayDatagrams, ls.RelayDropped, "dropped")
	counter(c.relayBytes, ls.RelayForwardedBytes)
	counter(c.relayRefused, ls.RelayRefused)

	if c.perConn != nil {
		labelled := make(map[string]bool, len(current))
		for i, conn := range current {
			remote := addrString(conn.RemoteAddr())
			if labelled[remote] {
				continue // one series per label set: a registry refuses two
			}
			labelled[remote] = true
			c.perConn.collect(ch, &stats[i], remote)
		}
	}
}

// histogram is a constant histogram of f over stats, with the upper
// bounds buckets.
func histogram(d *prometheus.Desc, buckets []float64, stats []knet.Stats, f func(*knet.Stats) float64) prometheus.Metric {
	counts := make(map[float64]uint64, len(buckets))
	for _, b := range buckets {
		counts[b] = 0 // the empty buckets are shown too
	}
	var sum float64
	for i := range stats {
		v := f(&stats[i])
		sum += v
		for _, b := range buckets {
			if v <= b {
				counts[b]++ // cumulative: a value is in every bucket above it
			}
		}
	}
	return prometheus.MustNewConstHistogram(d, uint64(len(stats)), sum, counts)
}

func addrString(a net.Addr) string {
	if a == nil {
		return ""
	}
	return a.String()
}
