// Package runbench measures `cagectl run -- true` from start to exit
// against `systemd-run --wait --pipe true` (a unit with no cage) and
// against `srt true` (Anthropic's sandbox-runtime, bubblewrap), in one
// booted machine in the same run, interleaved round by round so that noise
// hits every command alike. Run it through bench/run/run.sh.
package runbench

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/nixcage/nixcage/internal/systest"
)

// The floor agents are declared cages running /bin/true: started warm
// (namespace, prepare step and sockets already up) with `systemctl start
// --wait`, they are a unit carrying only the cage's walls, which no
// `cagectl run` can beat.
const config = `egress_policy "bench" {
  allow = []
}
agent "floor-nsp" {
  backend   = "nspawn"
  egress    = "bench"
  command   = ["/bin/true"]
  autostart = false
}
agent "floor-svc" {
  backend   = "service"
  egress    = "bench"
  command   = ["/bin/true"]
  autostart = false
}
`

// Where srt and the Debian packages it needs are cached on the host.
const cacheDir = "/var/cache/nixcage-bench"

// srtVersion is the sandbox-runtime release measured.
const srtVersion = "0.0.83"

// srtDebs are what srt needs on Debian 12 and the machine tree lacks.
var srtDebs = []string{"bubblewrap", "socat", "ripgrep", "libwrap0", "libnsl2"}

type subject struct {
	name, cmd string
	samples   []time.Duration
	err       error
}

// Run boots the machine, measures and prints the table.
func Run(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("run-latency", flag.ContinueOnError)
	fs.SetOutput(out)
	n := fs.Int("n", 20, "rounds (each runs every command once)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	tree, err := systest.EnsureRootfs(ctx, out)
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "nixcage-runbench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	m, err := systest.BootInstalled(ctx, tree, dir, systest.Binaries{},
		map[string]string{"cagectl": "./cmd/cagectl", "caged": "./cmd/caged", "cage-egress": "./cmd/cage-egress"}, config, out)
	if err != nil {
		return err
	}
	defer m.Close()
	if _, err := m.Shell(ctx, "systemctl reload dbus && systemctl start nixcage-caged.service"); err != nil {
		return err
	}
	floor := func(agent string) string {
		return "systemctl start --wait " + systest.AgentUnit(agent)
	}
	subjects := []*subject{
		{name: "systemd-run --wait --pipe true", cmd: "systemd-run --quiet --wait --pipe true"},
		{name: "cagectl run -- true (nspawn)", cmd: "cagectl run --no-workspace -- true"},
		{name: "cagectl run --backend service", cmd: "cagectl run --backend service --no-workspace -- true"},
		{name: "srt true", cmd: "srt true"},
		// A run with --name never takes the spare namespace: the same
		// runs without it, in the same run of the bench.
		{name: "  the same, no spare namespace", cmd: "cagectl run --name nospare-nsp --no-workspace -- true"},
		{name: "  the same, service, no spare", cmd: "cagectl run --name nospare-svc --backend service --no-workspace -- true"},
		{name: "floor: nspawn cage's unit, warm", cmd: floor("floor-nsp")},
		{name: "floor: service cage's unit, warm", cmd: floor("floor-svc")},
	}
	for _, agent := range []string{"floor-nsp", "floor-svc"} {
		if o, err := m.Run(ctx, "systemctl", "start", systest.ProxySocket(agent), systest.DNSSocket(agent)); err != nil {
			return fmt.Errorf("start the gateway side of %s: %v\n%s", agent, err, o)
		}
	}
	if err := installSrt(ctx, m, out); err != nil {
		subjects[3].err = err
	}
	// Warm every path once (page cache, first daemon-reload, srt's npm
	// modules); a failing command is reported, not fatal.
	for _, s := range subjects {
		if s.err != nil {
			continue
		}
		if o, err := m.Shell(ctx, s.cmd+" </dev/null"); err != nil {
			s.err = fmt.Errorf("%v\n%s", err, o)
		}
	}
	loadStart := loadavg()
	for i := 0; i < *n; i++ {
		for _, s := range subjects {
			if s.err != nil {
				continue
			}
			settle(ctx, m)
			d, err := timeIn(ctx, m, s.cmd)
			if err != nil {
				s.err = err
				continue
			}
			s.samples = append(s.samples, d)
		}
	}
	report(out, subjects, *n)
	fmt.Fprintf(out, "\nload average (host): %s at the start, %s at the end\n", loadStart, loadavg())
	if j, err := m.Run(ctx, "journalctl", "-u", "nixcage-caged.service", "-o", "cat", "--no-pager"); err == nil {
		phases(out, j)
	}
	return nil
}

// loadavg is the host's 1, 5 and 15 minute load averages.
func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

// phases prints where caged spent a run's time, from its own log lines
// (prepared_in: request checked, config validated, files written, the cage
// prepared; queued: systemd loading the run's units and queueing their
// jobs; start_job: from the start call until the cage's command runs — the
// namespace, the sockets, the store bind check (service) and the cage's
// own setup; ran: the command until caged saw it end; reported: exit
// status, gateway stopped, summary sent; teardown: everything stopped and
// removed, after the summary).
func phases(out io.Writer, journal string) {
	backend := map[string]string{}
	got := map[string]map[string][]time.Duration{}
	for _, line := range strings.Split(journal, "\n") {
		kv := map[string]string{}
		for _, f := range strings.Fields(line) {
			if k, v, ok := strings.Cut(f, "="); ok {
				kv[k] = strings.Trim(v, `"`)
			}
		}
		name := kv["name"]
		if kv["backend"] != "" {
			backend[name] = kv["backend"]
		}
		b := backend[name]
		if b == "" {
			continue
		}
		if strings.HasPrefix(name, "nospare") {
			b += ", no spare"
		}
		for _, k := range stages {
			if d, err := time.ParseDuration(kv[k]); err == nil {
				if got[b] == nil {
					got[b] = map[string][]time.Duration{}
				}
				got[b][k] = append(got[b][k], d)
			}
		}
	}
	fmt.Fprintf(out, "\nwhere caged spends a run (medians from its log, warm-up included)\n")
	fmt.Fprintf(out, "%-17s", "backend")
	for _, k := range stages {
		fmt.Fprintf(out, " %11s", k)
	}
	fmt.Fprintln(out)
	for _, b := range []string{"nspawn", "nspawn, no spare", "service", "service, no spare"} {
		g := got[b]
		if g == nil {
			continue
		}
		fmt.Fprintf(out, "%-17s", b)
		for _, k := range stages {
			v := "-"
			if len(g[k]) > 0 {
				v = ms(median(g[k]))
			}
			fmt.Fprintf(out, " %11s", v)
		}
		fmt.Fprintln(out)
	}
}

// stages are the durations caged logs per run, in order.
var stages = []string{"prepared_in", "queued", "start_job", "ran", "reported", "teardown"}

// settle waits, untimed and up to 5 s, until the machine has finished
// what the command before left running — systemd jobs, and caged's
// teardown of a run and its start of the next spare namespace, both after
// that run's cagectl exited — so that each command is measured alone.
func settle(ctx context.Context, m *systest.Machine) {
	m.Shell(ctx, `for i in $(seq 50); do
  busy=$(systemctl list-jobs --no-legend | wc -l)
  for d in /run/nixcage/runs/*/; do [ -d "$d" ] && [ ! -e "$d/spare" ] && busy=1; done
  [ "$busy" = 0 ] && break
  sleep 0.1
done`)
}

// timeIn times one command inside the machine, with the machine's own
// clock around it (nsenter's cost is outside the measurement).
func timeIn(ctx context.Context, m *systest.Machine, cmd string) (time.Duration, error) {
	// (The script runs under sh -e: the status is taken in an && list.)
	o, err := m.Shell(ctx, `s=$(date +%s%N); `+cmd+` </dev/null >/tmp/runbench.out 2>&1 && rc=0 || rc=$?; e=$(date +%s%N); echo "$rc $((e-s))"; [ $rc = 0 ] || cat /tmp/runbench.out`)
	if err != nil {
		return 0, fmt.Errorf("%s: %w", cmd, err)
	}
	line, rest, _ := strings.Cut(o, "\n")
	f := strings.Fields(line)
	if len(f) != 2 || f[0] != "0" {
		return 0, fmt.Errorf("%s: exit status %s:\n%s", cmd, line, rest)
	}
	ns, err := strconv.ParseInt(f[1], 10, 64)
	return time.Duration(ns), err
}

// installSrt puts node (the host's), srt and the Debian packages srt needs
// into the machine. The npm tarball and the .debs are fetched once, by npm
// and apt's own clients, and cached.
func installSrt(ctx context.Context, m *systest.Machine, out io.Writer) error {
	node, err := exec.LookPath("node")
	if err != nil {
		return fmt.Errorf("not measured: no node on the host (srt is a Node program)")
	}
	srtDir := filepath.Join(cacheDir, "srt-"+srtVersion)
	cli := filepath.Join(srtDir, "node_modules/@anthropic-ai/sandbox-runtime/dist/cli.js")
	if _, err := os.Stat(cli); err != nil {
		fmt.Fprintf(out, "runbench: npm install @anthropic-ai/sandbox-runtime@%s into %s\n", srtVersion, srtDir)
		c := exec.CommandContext(ctx, "npm", "install", "--no-audit", "--no-fund", "--prefix", srtDir, "@anthropic-ai/sandbox-runtime@"+srtVersion)
		if b, err := c.CombinedOutput(); err != nil {
			return fmt.Errorf("not measured: npm install: %v\n%s", err, b)
		}
	}
	debDir := filepath.Join(cacheDir, "debs")
	os.MkdirAll(debDir, 0o755)
	var debs []string
	for _, p := range srtDebs {
		matches, _ := filepath.Glob(filepath.Join(debDir, p+"_*.deb"))
		if len(matches) == 0 {
			c := exec.CommandContext(ctx, "apt-get", "download", p)
			c.Dir = debDir
			if b, err := c.CombinedOutput(); err != nil {
				return fmt.Errorf("not measured: apt-get download %s: %v\n%s", p, err, b)
			}
			matches, _ = filepath.Glob(filepath.Join(debDir, p+"_*.deb"))
		}
		if len(matches) == 0 {
			return fmt.Errorf("not measured: no .deb for %s", p)
		}
		dst := "/tmp/debs/" + filepath.Base(matches[0])
		if err := m.CopyIn(matches[0], dst, 0o644); err != nil {
			return err
		}
		debs = append(debs, dst)
	}
	if o, err := m.Run(ctx, append([]string{"dpkg", "-i"}, debs...)...); err != nil {
		return fmt.Errorf("not measured: dpkg -i: %v\n%s", err, o)
	}
	if err := m.CopyIn(node, "/usr/local/bin/node", 0o755); err != nil {
		return err
	}
	if b, err := exec.CommandContext(ctx, "cp", "-a", srtDir, m.Path("/opt/srt")).CombinedOutput(); err != nil {
		return fmt.Errorf("copy srt: %v\n%s", err, b)
	}
	wrapper := "#!/bin/sh\nexec /usr/local/bin/node /opt/srt/node_modules/@anthropic-ai/sandbox-runtime/dist/cli.js \"$@\"\n"
	return m.WriteFile("/usr/local/bin/srt", []byte(wrapper), 0o755)
}

func report(out io.Writer, subjects []*subject, n int) {
	fmt.Fprintf(out, "\nstart to exit of `true`, n=%d rounds interleaved, median (p90)\n", n)
	fmt.Fprintf(out, "%-34s %10s %10s %8s\n", "command", "median", "p90", "ratio")
	base := median(subjects[0].samples)
	for _, s := range subjects {
		if s.err != nil {
			fmt.Fprintf(out, "%-34s %10s %10s %8s  (%v)\n", s.name, "-", "-", "-", firstLine(s.err))
			continue
		}
		ratio := "-"
		if base > 0 {
			ratio = fmt.Sprintf("%.2fx", float64(median(s.samples))/float64(base))
		}
		fmt.Fprintf(out, "%-34s %10s %10s %8s\n", s.name, ms(median(s.samples)), ms(pct(s.samples, 0.9)), ratio)
	}
	for _, s := range subjects {
		if s.err != nil {
			fmt.Fprintf(out, "\n%s: %v\n", s.name, s.err)
		}
	}
}

func firstLine(err error) string {
	s, _, _ := strings.Cut(err.Error(), "\n")
	return s
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
