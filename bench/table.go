package main

import (
	"fmt"
	"io"
	"math"
	"strings"
)

// Column names, in table order. knet is compared with every other column.
const (
	colKnet = "knet"
	colKCP  = "kcp-go"
	colQUIC = "quic-go"
	colUDP  = "raw UDP"
)

var columns = []string{colKnet, colKCP, colQUIC, colUDP}

// cell is one measurement: a value, or why there is none.
type cell struct {
	set  bool
	v    float64
	na   string // reason for n/a
	text string // display instead of the formatted value (e.g. ">15s")
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
	c.set, c.v, c.na = true, v, ""
}

func (t *table) setText(id, col string, v float64, text string) {
	c := t.cell(id, col)
	c.set, c.v, c.text, c.na = true, v, text, ""
}

func (t *table) setNA(id, col, reason string) {
	c := t.cell(id, col)
	if c.set {
		return
	}
	c.na = reason
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
		return fmt.Sprintf("n/a [%d]", i)
	}
	head := []string{"Scenario"}
	head = append(head, columns...)
	for _, c := range columns[1:] {
		head = append(head, "knet/"+c)
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
		for _, col := range columns {
			c := r.cells[col]
			switch {
			case r.skip[col]:
				line = append(line, "–")
			case c == nil:
				line = append(line, "–")
			case c.set && c.text != "":
				line = append(line, c.text)
			case c.set:
				line = append(line, formatValue(c.v, r.unit))
			case c.na != "":
				line = append(line, foot(col+": "+c.na))
			default:
				line = append(line, "–")
			}
		}
		k := r.cells[colKnet]
		for _, col := range columns[1:] {
			c := r.cells[col]
			if !r.ratios || r.skip[col] || k == nil || !k.set || c == nil || !c.set || c.v == 0 || math.IsInf(k.v/c.v, 0) {
				line = append(line, "")
				continue
			}
			ratio := k.v / c.v
			prefix := ""
			switch {
			case k.text != "" && c.text != "":
				line = append(line, "")
				continue
			case c.text != "": // the peer's value is a bound it did not reach
				prefix = map[bool]string{true: "< ", false: "> "}[r.lower]
			case k.text != "":
				prefix = map[bool]string{true: "> ", false: "< "}[r.lower]
			}
			line = append(line, prefix+formatRatio(ratio))
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
