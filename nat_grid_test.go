package knet

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The NAT grid (issue 35): a table of the route and the time to connect
// of every pair of NAT types, measured by TestNATMatrix and
// TestNATMatrixLoss (nat_matrix_linux_test.go) and written, with
// -knet.nat.grid, between two marker comments of each file of
// natGridFiles. This file holds what needs no NAT: the table's form, its
// parser, and TestNATGridDocs, which checks that the committed files hold
// a table of that form (not its numbers).

var natGridFlag = flag.Bool("knet.nat.grid", false, "TestNATMatrix and TestNATMatrixLoss: rewrite the NAT grid in README.md and docs/nat.md with what they measured (as root: sudo go test -run 'TestNATMatrix' -knet.nat.grid .)")

// natGridFiles are the files that hold the grid, between natGridBegin and
// natGridEnd.
var natGridFiles = []string{"README.md", "docs/nat.md"}

const (
	natGridBegin = "<!-- nat-grid: begin (go test -run TestNATMatrix -knet.nat.grid . rewrites what follows, as root) -->"
	natGridEnd   = "<!-- nat-grid: end -->"
)

// natTypeNames are the four NAT types as the grid names them, from the
// most open.
var natTypeNames = []string{"full cone", "restricted cone", "port-restricted cone", "symmetric"}

// The routes a pair may take.
const (
	natRouteDirect  = "direct"
	natRouteRelayed = "relayed"
	natRouteNone    = "none"
)

// natGridRow is one ordered pair's line: which NAT the host is behind and
// which the joiner, the route expected, and what the runs measured.
type natGridRow struct {
	Host, Joiner string
	Expect       string        // a route, "direct ≤ 1s" for one with a time bound
	Route        string        // the route of the runs that connected, or none
	Connected    int           // runs that connected
	Runs         int           // runs
	P50, P95     time.Duration // of the connected runs: from the joiner's ask to its reliable message echoed
	Max          time.Duration
	LossOK       int // runs that connected at 10 % loss
	LossRuns     int // runs at 10 % loss; 0: not measured
}

var natGridHeader = []string{"host behind", "joiner behind", "expected", "route", "connected", "p50", "p95", "max", "at 10 % loss"}

// formatNATGrid is the grid's text: a Markdown table, one line per
// ordered pair, and a line saying how and when it was measured.
func formatNATGrid(rows []natGridRow, how string) string {
	var b strings.Builder
	b.WriteString("| " + strings.Join(natGridHeader, " | ") + " |\n")
	b.WriteString("|" + strings.Repeat(" --- |", len(natGridHeader)) + "\n")
	ms := func(d time.Duration, ok bool) string {
		if !ok {
			return "–"
		}
		return fmt.Sprintf("%d ms", d.Milliseconds())
	}
	for _, r := range rows {
		loss := "–"
		if r.LossRuns > 0 {
			loss = fmt.Sprintf("%d/%d", r.LossOK, r.LossRuns)
		}
		ok := r.Connected > 0
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %d/%d | %s | %s | %s | %s |\n",
			r.Host, r.Joiner, r.Expect, r.Route, r.Connected, r.Runs,
			ms(r.P50, ok), ms(r.P95, ok), ms(r.Max, ok), loss)
	}
	b.WriteString("\n" + how + "\n")
	return b.String()
}

var (
	natGridCount = regexp.MustCompile(`^(\d+)/(\d+)$`)
	natGridMs    = regexp.MustCompile(`^(\d+) ms$|^–$`)
)

// parseNATGrid reads a grid's table (formatNATGrid's form) from text: its
// rows' host, joiner and route, checking every cell's form.
func parseNATGrid(text string) ([]natGridRow, error) {
	var rows []natGridRow
	lines := strings.Split(text, "\n")
	i := 0
	for i < len(lines) && !strings.HasPrefix(lines[i], "|") {
		i++
	}
	if i+1 >= len(lines) {
		return nil, errors.New("no table")
	}
	cells := func(line string) []string {
		line = strings.TrimSpace(line)
		if !strings.HasPrefix(line, "|") || !strings.HasSuffix(line, "|") {
			return nil
		}
		parts := strings.Split(line[1:len(line)-1], "|")
		for k := range parts {
			parts[k] = strings.TrimSpace(parts[k])
		}
		return parts
	}
	if h := cells(lines[i]); strings.Join(h, "|") != strings.Join(natGridHeader, "|") {
		return nil, fmt.Errorf("header %q, want %q", h, natGridHeader)
	}
	i += 2 // the header and the delimiter row
	known := func(name string) bool {
		for _, n := range natTypeNames {
			if n == name {
				return true
			}
		}
		return false
	}
	for ; i < len(lines) && strings.HasPrefix(lines[i], "|"); i++ {
		c := cells(lines[i])
		if len(c) != len(natGridHeader) {
			return nil, fmt.Errorf("line %q: %d cells, want %d", lines[i], len(c), len(natGridHeader))
		}
		r := natGridRow{Host: c[0], Joiner: c[1], Expect: c[2], Route: c[3]}
		if !known(r.Host) || !known(r.Joiner) {
			return nil, fmt.Errorf("line %q: not a NAT type", lines[i])
		}
		switch r.Route {
		case natRouteDirect, natRouteRelayed, natRouteNone:
		default:
			return nil, fmt.Errorf("line %q: route %q", lines[i], r.Route)
		}
		if !strings.HasPrefix(r.Expect, natRouteDirect) && !strings.HasPrefix(r.Expect, natRouteRelayed) && r.Expect != natRouteNone {
			return nil, fmt.Errorf("line %q: expected %q", lines[i], r.Expect)
		}
		m := natGridCount.FindStringSubmatch(c[4])
		if m == nil {
			return nil, fmt.Errorf("line %q: connected %q", lines[i], c[4])
		}
		fmt.Sscan(m[1], &r.Connected)
		fmt.Sscan(m[2], &r.Runs)
		if r.Connected > r.Runs || r.Runs == 0 {
			return nil, fmt.Errorf("line %q: %d of %d runs", lines[i], r.Connected, r.Runs)
		}
		for _, ms := range c[5:8] {
			if !natGridMs.MatchString(ms) {
				return nil, fmt.Errorf("line %q: time %q", lines[i], ms)
			}
		}
		if c[8] != "–" && !natGridCount.MatchString(c[8]) {
			return nil, fmt.Errorf("line %q: at loss %q", lines[i], c[8])
		}
		rows = append(rows, r)
	}
	return rows, nil
}

// natGridSection returns what doc holds between the markers, and where.
func natGridSection(doc string) (inside string, start, end int, err error) {
	b := strings.Index(doc, natGridBegin)
	e := strings.Index(doc, natGridEnd)
	if b < 0 || e < 0 || e < b || strings.Count(doc, natGridBegin) != 1 || strings.Count(doc, natGridEnd) != 1 {
		return "", 0, 0, errors.New("no single pair of NAT grid markers, in order")
	}
	start = b + len(natGridBegin)
	return doc[start:e], start, e, nil
}

// writeNATGrid puts grid between the markers of each of natGridFiles.
func writeNATGrid(grid string) error {
	for _, f := range natGridFiles {
		b, err := os.ReadFile(f)
		if err != nil {
			return err
		}
		doc := string(b)
		_, start, end, err := natGridSection(doc)
		if err != nil {
			return fmt.Errorf("%s: %w", f, err)
		}
		doc = doc[:start] + "\n" + grid + doc[end:]
		if err := os.WriteFile(f, []byte(doc), 0o644); err != nil {
			return err
		}
	}
	return nil
}

// The committed grid is a table of the form TestNATMatrix writes: between
// the markers of README.md and docs/nat.md, every one of the 16 ordered
// pairs of NAT types once, each with a route and counts that parse.
func TestNATGridDocs(t *testing.T) {
	for _, f := range natGridFiles {
		t.Run(f, func(t *testing.T) {
			b, err := os.ReadFile(f)
			require.NoError(t, err)
			inside, _, _, err := natGridSection(string(b))
			require.NoError(t, err)
			rows, err := parseNATGrid(inside)
			require.NoError(t, err)
			seen := map[[2]string]int{}
			for _, r := range rows {
				seen[[2]string{r.Host, r.Joiner}]++
			}
			for _, h := range natTypeNames {
				for _, j := range natTypeNames {
					assert.Equal(t, 1, seen[[2]string{h, j}], "the pair %s hosts, %s joins, once", h, j)
				}
			}
			assert.Len(t, rows, 16)
		})
	}
}

// The parser refuses what is not the grid's form, so that TestNATGridDocs
// could fail.
func TestNATGridParse(t *testing.T) {
	row := natGridRow{Host: "symmetric", Joiner: "full cone", Expect: "direct ≤ 1s", Route: natRouteDirect, Connected: 19, Runs: 20, P50: 300 * time.Millisecond, P95: 410 * time.Millisecond, Max: 2 * time.Second}
	grid := formatNATGrid([]natGridRow{row, {Host: "symmetric", Joiner: "symmetric", Expect: natRouteNone, Route: natRouteNone, Runs: 5, LossRuns: 2}}, "measured")
	rows, err := parseNATGrid(grid)
	require.NoError(t, err)
	require.Len(t, rows, 2)
	assert.Equal(t, natGridRow{Host: "symmetric", Joiner: "full cone", Expect: "direct ≤ 1s", Route: natRouteDirect, Connected: 19, Runs: 20}, rows[0])
	assert.Contains(t, grid, "| 300 ms | 410 ms | 2000 ms | – |")
	assert.Contains(t, grid, "| 0/5 | – | – | – | 0/2 |")
	for _, bad := range []string{
		"",
		strings.Replace(grid, "full cone", "fullcone", 1),
		strings.Replace(grid, "| direct |", "| sideways |", 1),
		strings.Replace(grid, "19/20", "21/20", 1),
		strings.Replace(grid, "410 ms", "410", 1),
		strings.Replace(grid, "| p95 |", "| p99 |", 1),
	} {
		_, err := parseNATGrid(bad)
		assert.Error(t, err, "%s", bad)
	}
	_, _, _, err = natGridSection("a\n" + natGridEnd + "\n" + natGridBegin)
	assert.Error(t, err, "markers out of order")
	inside, _, _, err := natGridSection("a\n" + natGridBegin + "\nx\n" + natGridEnd)
	require.NoError(t, err)
	assert.Equal(t, "\nx\n", inside)
}
