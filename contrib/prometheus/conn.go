package knetprom

import (
	"maps"

	"github.com/knet-go/knet"
	"github.com/prometheus/client_golang/prometheus"
)

// ConnCollector is a prometheus.Collector of one connection's counters,
// a client's as Dial returned it: the knet_connection_* metrics, read
// from Conn.Stats on each scrape, with the server's address as the
// constant label remote. After the connection ends it reports the final
// counters; unregister it then.
type ConnCollector struct {
	c     *knet.Conn
	descs *connDescs
}

// NewConnCollector returns a collector of c's counters; opts may be nil
// (of its fields, only ConstLabels applies). A label remote in
// ConstLabels replaces the remote address.
func NewConnCollector(c *knet.Conn, opts *Options) *ConnCollector {
	labels := prometheus.Labels{"remote": addrString(c.RemoteAddr())}
	if opts != nil {
		maps.Copy(labels, opts.ConstLabels)
	}
	return &ConnCollector{c: c, descs: newConnDescs(nil, labels)}
}

// Describe implements prometheus.Collector.
func (c *ConnCollector) Describe(ch chan<- *prometheus.Desc) { c.descs.describe(ch) }

// Collect implements prometheus.Collector.
func (c *ConnCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.c.Stats()
	c.descs.collect(ch, &st)
}
