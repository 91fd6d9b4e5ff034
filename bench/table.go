package main

import (
	"cmp"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
)

// Column names, in table order. knet (reliable, in order on one channel)
// is compared with every other column.
const (
	colKnet  = "knet"
	colKnetU = "knet (unordered)"
	colKnetS = "knet (secure)"
	colKCP   = "kcp-go"
	colQUIC  = "quic-go"
	colUDP   = "raw UDP"
	// colUDPB is the game scenario's raw UDP server batching its
	// system calls (recvmmsg/sendmmsg): the machine's limit.
	colUDPB = "raw UDP batched"
)

var columns = []string{colKnet, colKnetU, colKnetS, colKCP, colQUIC, colUDP, colUDPB}

// optionalCols are printed (with their ratio columns) only when some
// row has a cell in them: raw UDP batched exists in the game scenario
// alone, and only with -libs=...,udp-batch.
var optionalCols = map[string]bool{colUDPB: true}

// heads are the column headings where they say more than the name.
var heads = map[string]string{colQUIC: "quic-go (TLS 1.3)"}

// ratioCols are the ratio columns: num's median divided by den's.
type ratioCol struct{ num, den, head string }

var ratioCols = []ratioCol{
	{colKnet, colKCP, "knet/kcp-go"},
	{colKnet, colQUIC, "knet/quic-go"},
	{colKnet, colUDP, "knet/raw UDP"},
	{colKnet, colUDPB, "knet/raw UDP batched"},
	{colKnet, colKnetU, "ordered/unordered"},
	{colKnetS, colKnet, "secure/plain"},
	{colKnetS, colQUIC, "secure/quic-go"},
}

// sample is one run's measurement.
type sample struct {
	v    float64
	text string // display instead of the formatted value (e.g. "> 15s")
}

// cell is one library's measurements of one row, one sample per run
// that produced a value; the others left their reasons.
type cell struct {
	samples []sample
	failed  []string // why runs gave no value
	marks   []string // caveats on values that were measured
}

// median is the middle sample (the mean of the two middle ones for an
// even count; a text survives only if both carry one).
func (c *cell) median() (sample, bool) {
	n := len(c.samples)
	if n == 0 {
		return sample{}, false
	}
	s := slices.Clone(c.samples)
	slices.SortStableFunc(s, func(a, b sample) int { return cmp.Compare(a.v, b.v) })
	if n%2 == 1 {
		return s[n/2], true
	}
	a, b := s[n/2-1], s[n/2]
	m := sample{v: (a.v + b.v) / 2}
	if a.text != "" && b.text != "" {
		m.text = b.text
	}
	return m, true
}

// spread is the lowest and highest sample.
func (c *cell) spread() (lo, hi sample) {
	lo, hi = c.samples[0], c.samples[0]
	for _, s := range c.samples[1:] {
		if s.v < lo.v {
			lo = s
		}
		if s.v > hi.v {
			hi = s
		}
	}
	return lo, hi
}

// row is one line of the table.
type row struct {
	scenario string
	label    string
	unit     string // "us", "ms", "msg/s", "MB/s", "rt/s", "%"
	lower    bool   // lower is better
	cells    map[string]*cell
	ratios   bool // print knet/peer ratios
	skip     map[string]bool
}

type table struct {
	rows  []*row
	index map[string]*row
	notes []string
}

func newTable() *table { return &table{index: make(map[string]*row)} }

// add declares a row; id is unique, scenario groups rows for -only.
func (t *table) add(scenario, id, label, unit string, lower bool, skip ...string) *row {
	r := &row{scenario: scenario, label: label, unit: unit, lower: lower, cells: make(map[string]*cell), ratios: true, skip: make(map[string]bool)}
	for _, s := range skip {
		r.skip[s] = true
	}
	t.rows = append(t.rows, r)
	t.index[id] = r
	return r
}

func (t *table) cell(id, col string) *cell {
	r := t.index[id]
	if r == nil {
		panic("bench: unknown row " + id)
	}
	c := r.cells[col]
	if c == nil {
		c = &cell{}
		r.cells[col] = c
	}
	return c
}

func (t *table) set(id, col string, v float64) {
	c := t.cell(id, col)
	c.samples = append(c.samples, sample{v: v})
}

func (t *table) setText(id, col string, v float64, text string) {
	c := t.cell(id, col)
	c.samples = append(c.samples, sample{v: v, text: text})
}

func (t *table) setNA(id, col, reason string) {
	c := t.cell(id, col)
	c.failed = append(c.failed, reason)
}

// mark attaches a caveat to a measured value; it prints as a footnote.
func (t *table) mark(id, col, reason string) {
	c := t.cell(id, col)
	if !slices.Contains(c.marks, reason) {
		c.marks = append(c.marks, reason)
	}
}

func (t *table) note(format string, args ...any) {
	t.notes = append(t.notes, fmt.Sprintf(format, args...))
}

func formatValue(v float64, unit string) string {
	switch unit {
	case "us":
		if v >= 10000 {
			return fmt.Sprintf("%.1f ms", v/1000)
		}
		return fmt.Sprintf("%.0f µs", v)
	case "ms":
		if v >= 10000 {
			return fmt.Sprintf("%.1f s", v/1000)
		}
		if v >= 100 {
			return fmt.Sprintf("%.0f ms", v)
		}
		return fmt.Sprintf("%.1f ms", v)
	case "MB/s":
		if v >= 100 {
			return fmt.Sprintf("%.0f MB/s", v)
		}
		if v >= 10 {
			return fmt.Sprintf("%.1f MB/s", v)
		}
		return fmt.Sprintf("%.2f MB/s", v)
	case "%":
		return fmt.Sprintf("%.1f %%", v)
	default: // rates
		s := ""
		switch {
		case v >= 1e6:
			s = fmt.Sprintf("%.2fM", v/1e6)
		case v >= 1e4:
			s = fmt.Sprintf("%.0fk", v/1e3)
		case v >= 1e3:
			s = fmt.Sprintf("%.1fk", v/1e3)
		case v >= 10:
			s = fmt.Sprintf("%.0f", v)
		default:
			s = fmt.Sprintf("%.2f", v)
		}
		return s + " " + unit
	}
}

// formatSample prints a sample's value, or its text.
func formatSample(s sample, unit string) string {
	if s.text != "" {
		return s.text
	}
	return formatValue(s.v, unit)
}

// formatRange prints "lo–hi" after a median printed with unit; the ends
// drop the unit when they share it.
func formatRange(lo, hi sample, unit string) string {
	a, b := formatSample(lo, unit), formatSample(hi, unit)
	an, au, okA := strings.Cut(a, " ")
	bn, bu, okB := strings.Cut(b, " ")
	if okA && okB && au == bu && lo.text == "" && hi.text == "" {
		a, b = an, bn
	}
	return a + "–" + b
}

// write prints the table as Markdown, followed by the n/a reasons and
// notes as footnotes.
func (t *table) write(w io.Writer, only map[string]bool) {
	var reasons []string
	reasonIndex := map[string]int{}
	foot := func(reason string) string {
		i, ok := reasonIndex[reason]
		if !ok {
			reasons = append(reasons, reason)
			i = len(reasons)
			reasonIndex[reason] = i
		}
		return fmt.Sprintf("[%d]", i)
	}
	shown := map[string]bool{}
	for _, c := range columns {
		shown[c] = !optionalCols[c]
	}
	for _, r := range t.rows {
		if only != nil && !only[r.scenario] {
			continue
		}
		for c := range r.cells {
			shown[c] = true
		}
	}
	cols := slices.DeleteFunc(slices.Clone(columns), func(c string) bool { return !shown[c] })
	ratios := slices.DeleteFunc(slices.Clone(ratioCols), func(rc ratioCol) bool { return !shown[rc.num] || !shown[rc.den] })
	head := []string{"Scenario"}
	for _, c := range cols {
		head = append(head, cmp.Or(heads[c], c))
	}
	for _, rc := range ratios {
		head = append(head, rc.head)
	}
	head = append(head, "better")
	fmt.Fprintln(w, "| "+strings.Join(head, " | ")+" |")
	seps := make([]string, len(head))
	for i := range seps {
		if i == 0 {
			seps[i] = "---"
		} else {
			seps[i] = "---:"
		}
	}
	fmt.Fprintln(w, "|"+strings.Join(seps, "|")+"|")
	for _, r := range t.rows {
		if only != nil && !only[r.scenario] {
			continue
		}
		line := []string{r.label}
		for _, col := range cols {
			c := r.cells[col]
			if r.skip[col] || c == nil {
				line = append(line, "–")
				continue
			}
			m, ok := c.median()
			var parts []string
			if ok {
				parts = append(parts, formatSample(m, r.unit))
				if lo, hi := c.spread(); len(c.samples) > 1 && formatSample(lo, r.unit) != formatSample(hi, r.unit) {
					parts = append(parts, "("+formatRange(lo, hi, r.unit)+")")
				}
			} else if len(c.failed) > 0 {
				parts = append(parts, "n/a")
			} else {
				parts = append(parts, "–")
			}
			if len(c.failed) > 0 {
				reason := col + ": " + c.failed[0]
				if ok || len(c.failed) > 1 {
					reason = fmt.Sprintf("%s: failed in %d of %d runs; first: %s", col, len(c.failed), len(c.failed)+len(c.samples), c.failed[0])
				}
				parts = append(parts, foot(reason))
			}
			for _, mk := range c.marks {
				parts = append(parts, foot(col+": "+mk))
			}
			line = append(line, strings.Join(parts, " "))
		}
		for _, rc := range ratios {
			line = append(line, ratioText(r, rc.num, rc.den))
		}
		if r.lower {
			line = append(line, "lower")
		} else {
			line = append(line, "higher")
		}
		fmt.Fprintln(w, "| "+strings.Join(line, " | ")+" |")
	}
	if len(reasons) > 0 {
		fmt.Fprintln(w)
		for i, r := range reasons {
			fmt.Fprintf(w, "[%d] %s  \n", i+1, r)
		}
	}
}

// ratioText is num's median over den's, or "" when either is missing.
func ratioText(r *row, num, den string) string {
	if !r.ratios || r.skip[num] || r.skip[den] || r.cells[num] == nil || r.cells[den] == nil {
		return ""
	}
	k, okK := r.cells[num].median()
	c, okC := r.cells[den].median()
	if !okK || !okC || c.v == 0 || math.IsInf(k.v/c.v, 0) {
		return ""
	}
	prefix := ""
	switch {
	case k.text != "" && c.text != "":
		return ""
	case c.text != "": // den's value is a bound it did not reach
		prefix = map[bool]string{true: "< ", false: "> "}[r.lower]
	case k.text != "":
		prefix = map[bool]string{true: "> ", false: "< "}[r.lower]
	}
	return prefix + formatRatio(k.v/c.v)
}

func formatRatio(r float64) string {
	switch {
	case r < 0.01:
		return fmt.Sprintf("%.4f×", r)
	case r < 0.1:
		return fmt.Sprintf("%.3f×", r)
	case r >= 100:
		return fmt.Sprintf("%.0f×", r)
	}
	return fmt.Sprintf("%.2f×", r)
}
