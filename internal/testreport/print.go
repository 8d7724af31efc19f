package testreport

import (
	"bufio"
	"fmt"
	"io"
	"strings"
)

// Stream copies `go test -json` from r to record unchanged and prints to w
// what plain `go test` would: a line per package, and the whole log of each
// failing test as it fails (tier markers left out).
func Stream(r io.Reader, w, record io.Writer) error {
	c := NewCollector()
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 1<<20), 64<<20)
	for sc.Scan() {
		line := sc.Bytes()
		if _, err := record.Write(append(line, '\n')); err != nil {
			return fmt.Errorf("record: %w", err)
		}
		ev, ok := ParseEvent(line)
		if !ok {
			fmt.Fprintf(w, "%s\n", line)
			continue
		}
		c.Add(ev)
		printEvent(w, c, ev)
	}
	return sc.Err()
}

func printEvent(w io.Writer, c *Collector, ev Event) {
	switch {
	case ev.Action == "build-output":
		io.WriteString(w, ev.Output)
	case ev.Test == "" && ev.Action == "output":
		// The package's own lines: "ok", "FAIL pkg", "?", panics. The bare
		// PASS/FAIL go test prints before them are noise here.
		if o := strings.TrimSpace(ev.Output); o != "PASS" && o != "FAIL" {
			io.WriteString(w, ev.Output)
		}
	case ev.Test == "" && ev.Action == "fail":
		// Tests still running when the binary died (timeout, crash) get no
		// event of their own: their log holds the panic.
		for _, t := range c.pkgs[ev.Package].tests {
			if !t.done {
				printFailure(w, t)
			}
		}
	case ev.Test != "" && ev.Action == "fail":
		printFailure(w, c.pkgs[ev.Package].byName[ev.Test])
	}
}

// printFailure prints a failed test's log as plain go test does: the
// "--- FAIL" line first, without the RUN lines.
func printFailure(w io.Writer, t *test) {
	var head string
	var body []string
	for _, l := range t.logs {
		switch {
		case strings.HasPrefix(l, "--- FAIL: "+t.name+" "):
			head = l
		case strings.HasPrefix(l, "=== "):
		default:
			body = append(body, l)
		}
	}
	if head == "" {
		head = fmt.Sprintf("--- FAIL: %s (did not finish)\n", t.name)
	}
	io.WriteString(w, head)
	for _, l := range body {
		io.WriteString(w, l)
	}
}

// ReadJSON adds every event of a recorded `go test -json` stream.
func (c *Collector) ReadJSON(r io.Reader) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 1<<20), 64<<20)
	for sc.Scan() {
		if ev, ok := ParseEvent(sc.Bytes()); ok {
			c.Add(ev)
		}
	}
	return sc.Err()
}

// ReadSteps adds the steps checks/test.sh recorded, one per line:
// tier TAB name TAB pass|fail|skip [TAB reason].
func (c *Collector) ReadSteps(r io.Reader) error {
	sc := bufio.NewScanner(r)
	for n := 1; sc.Scan(); n++ {
		if strings.TrimSpace(sc.Text()) == "" {
			continue
		}
		f := strings.SplitN(sc.Text(), "\t", 4)
		if len(f) < 3 {
			return fmt.Errorf("steps line %d: want tier, name and outcome separated by tabs, got %q", n, sc.Text())
		}
		o := Outcome(f[2])
		if o != Pass && o != Fail && o != Skip {
			return fmt.Errorf("steps line %d: outcome %q is not pass, fail or skip", n, f[2])
		}
		r := Result{Tier: f[0], Name: f[1], Outcome: o}
		if len(f) == 4 {
			r.Reason = f[3]
		}
		c.AddStep(r)
	}
	return sc.Err()
}

// maxNames is how many test names a skip reason lists before "+N more".
const maxNames = 4

// Write prints the summary: a row per tier, the skip reasons, the
// failures, and last the closing line.
func (s *Summary) Write(w io.Writer) {
	fmt.Fprintf(w, "%-14s %6s %7s %7s %8s\n", "tier", "run", "passed", "failed", "skipped")
	for _, tier := range append(append([]string{}, Tiers...), s.Unknown...) {
		t := s.ByTier[tier]
		fmt.Fprintf(w, "%-14s %6d %7d %7d %8d\n", tier, t.Passed+t.Failed, t.Passed, t.Failed, t.Skipped)
	}
	if len(s.Skips) > 0 {
		fmt.Fprintf(w, "\nskipped, by reason:\n")
		for _, g := range s.Skips {
			fmt.Fprintf(w, "  [%s] %d× %s\n", g.Tier, len(g.Tests), g.Reason)
			names := g.Tests
			more := ""
			if len(names) > maxNames {
				names, more = names[:maxNames], fmt.Sprintf(" (+%d more)", len(g.Tests)-maxNames)
			}
			fmt.Fprintf(w, "      %s%s\n", strings.Join(names, ", "), more)
		}
	}
	if len(s.Failed) > 0 {
		fmt.Fprintf(w, "\nfailed (logs above):\n")
		for _, r := range s.Failed {
			why := ""
			if r.Reason != "" {
				why = ": " + r.Reason
			}
			fmt.Fprintf(w, "  [%s] %s%s\n", r.Tier, shortName(r), why)
		}
	}
	fmt.Fprintf(w, "\n%s\n", s.ClosingLine())
}
