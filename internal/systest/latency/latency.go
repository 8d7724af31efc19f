// Package latency measures how long starting a cage takes, per backend,
// against the same command started by systemd with no cage, in the same
// booted machine and the same run, and reports the ratios.
//
// The figure: from a clock reading right before `systemctl start` to the
// journal stamp of PID 1's "Deactivated successfully" for the unit, for a
// command that does nothing (/bin/true), against a plain unit with the same
// command started the same way. That is the cost of setting up and tearing down the cage
// itself (namespaces, mounts, user mapping, nspawn or podman), without
// polling noise. The gateway, namespace and prepare units are warm (started
// once before measuring), as they are for an agent that restarts.
package latency

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/nixcage/nixcage/internal/systest"
)

const config = `egress_policy "bench" {
  allow = ["api.example.com"]
}
agent "svc" {
  backend = "service"
  egress  = "bench"
  command = ["/bin/true"]
}
agent "nsp" {
  backend = "nspawn"
  egress  = "bench"
  command = ["/bin/true"]
}
agent "pod" {
  backend = "podman"
  egress  = "bench"
  command = ["/bin/true"]
}
`

// Run runs the benchmark and prints a table.
func Run(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("start-latency", flag.ContinueOnError)
	fs.SetOutput(out)
	n := fs.Int("n", 20, "starts per backend")
	egressBin := fs.String("cage-egress", "", "cage-egress binary (default: build ./cmd/cage-egress)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	tree, err := systest.EnsureRootfs(ctx, out)
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "nixcage-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	bins := systest.Binaries{}
	pkgs := map[string]string{"cagectl": "./cmd/cagectl"}
	if *egressBin == "" {
		pkgs["cage-egress"] = "./cmd/cage-egress"
	} else {
		bins["cage-egress"] = *egressBin
	}
	for name, pkg := range pkgs {
		p, err := systest.Build(ctx, pkg, dir)
		if err != nil {
			return err
		}
		bins[name] = p
	}
	cfg := filepath.Join(dir, "bench.hcl")
	if err := os.WriteFile(cfg, []byte(config), 0o644); err != nil {
		return err
	}
	m, err := systest.Boot(ctx, systest.Options{Root: tree, Console: filepath.Join(dir, "console.log"), Log: out})
	if err != nil {
		return err
	}
	defer m.Close()
	if err := systest.InstallNixcage(ctx, m, bins, cfg, nil); err != nil {
		return err
	}

	type row struct {
		name    string
		samples []time.Duration
		err     error
	}
	var rows []row
	// The baseline is a plain unit started the same way as the agents.
	if err := m.WriteFile("/etc/systemd/system/bench-base.service", []byte(baseUnit), 0o644); err != nil {
		return err
	}
	if _, err := m.Run(ctx, "systemctl", "daemon-reload"); err != nil {
		return err
	}
	base := row{name: "no cage (plain unit)"}
	base.samples, base.err = measure(ctx, m, *n, "bench-base.service")
	rows = append(rows, base)
	for _, b := range []struct{ backend, agent string }{{"service", "svc"}, {"nspawn", "nsp"}, {"podman", "pod"}} {
		r := row{name: b.backend}
		// Warm the gateway side once; a failing backend is reported, not fatal.
		if _, err := m.Run(ctx, "systemctl", "start", "nixcage-prep@"+b.agent+".service", systest.ProxySocket(b.agent), systest.DNSSocket(b.agent)); err != nil {
			j, _ := m.Run(ctx, "journalctl", "--no-pager", "-n", "15", "-u", "nixcage-prep@"+b.agent+".service", "-u", "nixcage-netns@"+b.agent+".service")
			r.err = fmt.Errorf("%w\n%s", err, j)
			rows = append(rows, r)
			continue
		}
		r.samples, r.err = measure(ctx, m, *n, systest.AgentUnit(b.agent))
		rows = append(rows, r)
	}

	baseMed := median(base.samples)
	fmt.Fprintf(out, "\ncage start latency: systemctl start -> Deactivated, /bin/true, n=%d, median (p90)\n", *n)
	fmt.Fprintf(out, "%-24s %10s %10s %8s  %s\n", "backend", "median", "p90", "ratio", "target")
	targets := map[string]string{"service": "<= 1.5x", "nspawn": "<= 300 ms", "podman": "reported"}
	for _, r := range rows {
		if r.err != nil {
			fmt.Fprintf(out, "%-24s %10s %10s %8s  %s\n", r.name, "-", "-", "-", "FAILED: "+oneLine(r.err.Error()))
			continue
		}
		med, p90 := median(r.samples), pct(r.samples, 0.9)
		ratio := "1.00x"
		if r.name != base.name && baseMed > 0 {
			ratio = fmt.Sprintf("%.2fx", float64(med)/float64(baseMed))
		}
		fmt.Fprintf(out, "%-24s %10s %10s %8s  %s\n", r.name, ms(med), ms(p90), ratio, targets[r.name])
	}
	for _, r := range rows {
		if r.err != nil {
			fmt.Fprintf(out, "\n%s failed:\n%v\n", r.name, r.err)
		}
	}
	return nil
}

// baseUnit runs the same command with no cage; Type=exec as the agents.
const baseUnit = `[Unit]
Description=start-latency baseline (no cage)

[Service]
Type=exec
ExecStart=/bin/true
`

// measure starts a unit n times. Each span runs from a clock reading taken
// in the machine right before `systemctl start --no-block` to the realtime
// stamp of PID 1's "Deactivated successfully" message for that start, so
// polling for the result adds nothing to the figure.
func measure(ctx context.Context, m *systest.Machine, n int, unit string) ([]time.Duration, error) {
	var ds []time.Duration
	for i := 0; i < n; i++ {
		cur, err := cursor(ctx, m)
		if err != nil {
			return nil, err
		}
		out, err := m.Shell(ctx, "date +%s%N; systemctl start --no-block "+unit)
		if err != nil {
			return nil, err
		}
		t0, err := strconv.ParseInt(strings.TrimSpace(out), 10, 64)
		if err != nil {
			return nil, fmt.Errorf("clock reading %q: %w", out, err)
		}
		t1, err := finished(ctx, m, unit, cur)
		if err != nil {
			return nil, err
		}
		ds = append(ds, time.Duration(t1*1000-t0))
	}
	return ds, nil
}

func cursor(ctx context.Context, m *systest.Machine) (string, error) {
	out, err := m.Run(ctx, "journalctl", "-n", "0", "--show-cursor", "-q")
	if err != nil {
		return "", err
	}
	c, ok := strings.CutPrefix(strings.TrimSpace(out), "-- cursor: ")
	if !ok {
		return "", fmt.Errorf("journal cursor: %q", out)
	}
	return c, nil
}

// systemd's catalog id for "unit succeeded" (Deactivated successfully).
const msgUnitSuccess = "7ad2d189f7e94e70a38c781354912448"

// finished waits for the unit's success message after the cursor and
// returns its realtime stamp (µs). A failed start is an error naming why.
func finished(ctx context.Context, m *systest.Machine, unit, after string) (int64, error) {
	deadline := time.Now().Add(time.Minute)
	for {
		out, err := m.Run(ctx, "journalctl", "--after-cursor="+after, "-o", "json", "-u", unit)
		if err != nil {
			return 0, err
		}
		for _, line := range strings.Split(out, "\n") {
			var e struct {
				ID   string `json:"MESSAGE_ID"`
				Real string `json:"__REALTIME_TIMESTAMP"`
			}
			if json.Unmarshal([]byte(line), &e) == nil && e.ID == msgUnitSuccess {
				return strconv.ParseInt(e.Real, 10, 64)
			}
		}
		st, err := m.UnitState(ctx, unit)
		if err == nil && (st.Active == "failed" || st.Sub == "auto-restart") {
			j, _ := m.Journal(ctx, unit)
			m.Run(ctx, "systemctl", "stop", unit)
			return 0, fmt.Errorf("%s ended with %s: %s", unit, st.Result, lastLines(j, 3))
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("%s did not finish within a minute", unit)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func median(ds []time.Duration) time.Duration { return pct(ds, 0.5) }

func pct(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[int(p*float64(len(s)-1)+0.5)]
}

func ms(d time.Duration) string { return fmt.Sprintf("%.1f ms", float64(d)/float64(time.Millisecond)) }

func lastLines(s string, n int) string {
	l := strings.Split(strings.TrimSpace(s), "\n")
	if len(l) > n {
		l = l[len(l)-n:]
	}
	return strings.Join(l, " | ")
}

func oneLine(s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > 200 {
		s = s[:160] + "..."
	}
	return s
}
