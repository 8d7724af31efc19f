// Package testreport turns the output of `go test -json` and the steps of
// checks/test.sh into the summary a person reads at the end of a run: per
// tier, tests passed, failed and skipped, the skip reasons deduplicated, the
// failures by name, and a closing "N passed, N failed, N skipped" line that
// CI parses.
//
// A test's tier is the marker its testenv gate logs ("nixcage-tier: system");
// a subtest inherits its parent's; a test without one is a unit test. So any
// test anyone adds is attributed correctly as long as it gates through
// internal/testenv, with no list to keep up to date here.
package testreport

import (
	"encoding/json"
	"fmt"
	"regexp"
	"sort"
	"strings"

	"github.com/nixcage/nixcage/internal/testenv"
)

// Tier names in the order the summary prints them. The Go tiers come from
// testenv; the other two are steps of checks/test.sh.
const (
	TierStatic = "static checks"
	TierFuzz   = "fuzz"
)

// Tiers is the order of the summary's rows.
var Tiers = []string{TierStatic, testenv.TierUnit, testenv.TierPrivileged, testenv.TierSystem, TierFuzz}

// Outcome of one counted item.
type Outcome string

const (
	Pass Outcome = "pass"
	Fail Outcome = "fail"
	Skip Outcome = "skip"
)

// Event is one line of `go test -json` (cmd/test2json), with the fields of
// build events (Go 1.24+) too.
type Event struct {
	Action      string
	Package     string
	Test        string
	Output      string
	Elapsed     float64
	ImportPath  string
	FailedBuild string
}

// Result is one counted item: a leaf test, a parent that failed on its own,
// a package that failed without a failing test, or a script step.
type Result struct {
	Tier    string
	Package string // empty for steps
	Name    string
	Outcome Outcome
	Reason  string // skip reason, or what failed for package-level failures
}

type test struct {
	pkg, name string
	tier      string // from its own marker; "" = inherit
	outcome   Outcome
	done      bool
	children  bool
	logs      []string // output lines, for the skip reason and failure log
}

type pkgState struct {
	failed      bool
	failedBuild bool
	tests       []*test // in start order
	byName      map[string]*test
	output      []string // package-level output (panics, FAIL lines)
}

// Collector accumulates events and steps.
type Collector struct {
	pkgs  map[string]*pkgState
	order []string
	steps []Result
	build map[string][]string // build output by import path
}

// NewCollector returns an empty collector.
func NewCollector() *Collector {
	return &Collector{pkgs: map[string]*pkgState{}, build: map[string][]string{}}
}

func (c *Collector) pkg(name string) *pkgState {
	p := c.pkgs[name]
	if p == nil {
		p = &pkgState{byName: map[string]*test{}}
		c.pkgs[name] = p
		c.order = append(c.order, name)
	}
	return p
}

// ParseEvent decodes one line; ok is false for lines that are not test2json
// events (go prints some diagnostics as plain text).
func ParseEvent(line []byte) (Event, bool) {
	var ev Event
	if len(line) == 0 || line[0] != '{' || json.Unmarshal(line, &ev) != nil || ev.Action == "" {
		return Event{}, false
	}
	return ev, true
}

// Add records one event.
func (c *Collector) Add(ev Event) {
	switch ev.Action {
	case "build-output":
		c.build[ev.ImportPath] = append(c.build[ev.ImportPath], ev.Output)
		return
	case "build-fail":
		return
	}
	if ev.Package == "" {
		return
	}
	p := c.pkg(ev.Package)
	if ev.Test == "" {
		switch ev.Action {
		case "output":
			p.output = append(p.output, ev.Output)
		case "fail":
			p.failed = true
			p.failedBuild = ev.FailedBuild != ""
		}
		return
	}
	t := p.byName[ev.Test]
	if t == nil {
		t = &test{pkg: ev.Package, name: ev.Test}
		p.byName[ev.Test] = t
		p.tests = append(p.tests, t)
		if i := strings.LastIndex(ev.Test, "/"); i > 0 {
			if parent := p.byName[ev.Test[:i]]; parent != nil {
				parent.children = true
			}
		}
	}
	switch ev.Action {
	case "output":
		if tier, ok := markerTier(ev.Output); ok {
			if t.tier == "" {
				t.tier = tier
			}
			return
		}
		t.logs = append(t.logs, ev.Output)
	case "pass", "fail", "skip":
		t.outcome, t.done = Outcome(ev.Action), true
	}
}

// AddStep records a step of checks/test.sh.
func (c *Collector) AddStep(r Result) { c.steps = append(c.steps, r) }

// logLine matches a t.Log line as test2json relays it: "    file.go:12: msg".
var logLine = regexp.MustCompile(`^\s*([\w.\-]+\.go):\d+: ?(.*)$`)

// markerTier reports the tier a testenv marker line names.
func markerTier(out string) (string, bool) {
	m := logLine.FindStringSubmatch(strings.TrimRight(out, "\n"))
	if m == nil || !strings.HasPrefix(m[2], testenv.Marker) {
		return "", false
	}
	return strings.TrimSpace(strings.TrimPrefix(m[2], testenv.Marker)), true
}

// tierOf is the test's own marker, else its nearest ancestor's, else unit.
func (p *pkgState) tierOf(t *test) string {
	for name := t.name; ; {
		if u := p.byName[name]; u != nil && u.tier != "" {
			return u.tier
		}
		i := strings.LastIndex(name, "/")
		if i < 0 {
			return testenv.TierUnit
		}
		name = name[:i]
	}
}

// reason is the t.Skip message of a skipped test: its last log entry from a
// _test.go file, with continuation lines. Cleanup functions run after the
// skip and may log too (internal/systest logs "machine ... stopped" from
// testing.go), so entries from non-test files are the fallback only; the
// testenv gates use t.Helper, so their skips carry the test file's name.
func reason(logs []string) string {
	type entry struct {
		file string
		text []string
	}
	var entries []entry
	for _, l := range logs {
		l = strings.TrimRight(l, "\n")
		if m := logLine.FindStringSubmatch(l); m != nil {
			entries = append(entries, entry{m[1], []string{m[2]}})
		} else if n := len(entries); n > 0 && strings.HasPrefix(l, "        ") {
			entries[n-1].text = append(entries[n-1].text, strings.TrimSpace(l))
		}
	}
	for i := len(entries) - 1; i >= 0; i-- {
		if strings.HasSuffix(entries[i].file, "_test.go") {
			return strings.Join(entries[i].text, " ")
		}
	}
	if n := len(entries); n > 0 {
		return strings.Join(entries[n-1].text, " ")
	}
	return "(no reason printed)"
}

// Results returns every counted item: steps first, then tests by package.
func (c *Collector) Results() []Result {
	out := append([]Result(nil), c.steps...)
	for _, name := range c.order {
		p := c.pkgs[name]
		testFailed := false
		for _, t := range p.tests {
			r := Result{Tier: p.tierOf(t), Package: name, Name: t.name, Outcome: t.outcome}
			switch {
			case !t.done:
				// Still running when the binary died: a timeout or crash.
				r.Outcome, r.Reason = Fail, "did not finish (test binary crashed or timed out, see the package output)"
			case t.children && !(t.outcome == Fail && !p.descendantFailed(t)):
				continue // counted through its subtests
			case t.outcome == Skip:
				r.Reason = reason(t.logs)
			}
			if r.Outcome == Fail {
				testFailed = true
			}
			out = append(out, r)
		}
		if p.failed && !testFailed {
			why := "package failed with no failing test (TestMain, init or a crash, see its output)"
			if p.failedBuild {
				why = "build failed"
			}
			out = append(out, Result{Tier: testenv.TierUnit, Package: name, Name: "(package)", Outcome: Fail, Reason: why})
		}
	}
	return out
}

func (p *pkgState) descendantFailed(t *test) bool {
	for _, u := range p.tests {
		if strings.HasPrefix(u.name, t.name+"/") && u.outcome == Fail {
			return true
		}
	}
	return false
}

// Totals counts outcomes.
type Totals struct{ Passed, Failed, Skipped int }

func (t *Totals) add(o Outcome) {
	switch o {
	case Pass:
		t.Passed++
	case Fail:
		t.Failed++
	case Skip:
		t.Skipped++
	}
}

// Summary is what Write prints.
type Summary struct {
	ByTier  map[string]*Totals
	Total   Totals
	Skips   []*SkipGroup
	Failed  []Result
	Unknown []string // tiers named by markers but not in Tiers
}

// SkipGroup is one distinct skip reason within a tier.
type SkipGroup struct {
	Tier, Reason string
	Tests        []string // "pkg-suffix TestName"
}

// Summarize groups results by tier and reason.
func Summarize(results []Result) *Summary {
	s := &Summary{ByTier: map[string]*Totals{}}
	for _, tier := range Tiers {
		s.ByTier[tier] = &Totals{}
	}
	groups := map[[2]string]*SkipGroup{}
	for _, r := range results {
		tt := s.ByTier[r.Tier]
		if tt == nil {
			tt = &Totals{}
			s.ByTier[r.Tier] = tt
			s.Unknown = append(s.Unknown, r.Tier)
		}
		tt.add(r.Outcome)
		s.Total.add(r.Outcome)
		switch r.Outcome {
		case Fail:
			s.Failed = append(s.Failed, r)
		case Skip:
			k := [2]string{r.Tier, r.Reason}
			g := groups[k]
			if g == nil {
				g = &SkipGroup{Tier: r.Tier, Reason: r.Reason}
				groups[k] = g
				s.Skips = append(s.Skips, g)
			}
			g.Tests = append(g.Tests, shortName(r))
		}
	}
	rank := map[string]int{}
	for i, tier := range append(append([]string{}, Tiers...), s.Unknown...) {
		rank[tier] = i
	}
	sort.SliceStable(s.Skips, func(i, j int) bool { return rank[s.Skips[i].Tier] < rank[s.Skips[j].Tier] })
	return s
}

// shortName is the package's path below the module plus the test name.
func shortName(r Result) string {
	if r.Package == "" {
		return r.Name
	}
	pkg := r.Package
	if i := strings.Index(pkg, "/nixcage/nixcage/"); i >= 0 {
		pkg = pkg[i+len("/nixcage/nixcage/"):]
	}
	return pkg + " " + r.Name
}

// ClosingLine is the line CI parses; nothing may follow it.
func (s *Summary) ClosingLine() string {
	return fmt.Sprintf("%d passed, %d failed, %d skipped", s.Total.Passed, s.Total.Failed, s.Total.Skipped)
}
