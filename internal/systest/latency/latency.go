// Package latency measures how long starting a cage takes, per backend,
// against the same command started by systemd with no cage, in the same
// booted machine and the same run (round by round interleaved, so the load
// of a shared machine falls on all alike), and reports the ratios.
//
// The figure: from a clock reading right before `systemctl start` to the
// journal stamp of PID 1's "Deactivated successfully" for the unit, for a
// command that does nothing (/bin/true), against a plain unit with the same
// command started the same way. That is the cost of setting up and tearing
// down the cage itself (namespaces, mounts, user mapping, nspawn or podman),
// without polling noise. The gateway, namespace and prepare units are warm
// (started once before measuring), as they are for an agent that restarts.
//
// The breakdown: after each start, systemd's own stamps of every unit of
// the chain (left inactive, forked its main process, active, main process
// exited, inactive again), placed on the same clock, as median offsets from
// the start; and once per backend a cold start (namespace, prepare step,
// sockets from nothing) with the same stamps.
//
// More rows explain stages in the same run: the service cage's unit with
// nothing of nixcage around it (its walls alone: the floor a service cage
// cannot go below with these walls), the same unit with the two hardening
// options the service cage no longer sets (what replacing them saved), and
// the nspawn and podman cages as they were before cage-seal's filter
// replaced the managers' own (nspawn's filter and stub init, podman's
// profile: what the change saves; measurements, never settings).
package latency

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/coreos/go-systemd/v22/unit"

	"github.com/nixcage/nixcage/internal/paths"
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
	sandbox := fs.Bool("nspawn-sandbox", false, "also run the nspawn unit without its mount-namespace options, one group at a time")
	withGroups := fs.Bool("groups", false, "also profile the service cage's sandbox option by option (groups.go)")
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
	m, err := systest.BootInstalled(ctx, tree, dir, bins, pkgs, config, out)
	if err != nil {
		return err
	}
	defer m.Close()

	// The baseline is a plain unit started the same way as the agents.
	if err := m.WriteFile("/etc/systemd/system/bench-base.service", []byte(baseUnit), 0o644); err != nil {
		return err
	}
	// The service cage's own unit without the units around it, and with
	// the options it dropped (render.serviceCageHardening).
	if err := writeServiceVariants(m); err != nil {
		return err
	}
	// What the managers' own seccomp filters cost per start: the nspawn
	// and podman agents' units as they were before cage-seal's replaced them.
	vs := variants
	if *sandbox {
		vs = append(vs, sandboxVariants...)
	}
	for _, v := range vs {
		if err := v.write(m); err != nil {
			return err
		}
	}
	hold := []string{"bench-base.service", wallsAlone, wallsBefore}
	for _, v := range vs {
		hold = append(hold, v.unit)
	}
	for _, b := range backends {
		hold = append(hold, coldChain(b.backend, b.agent)...)
	}
	if err := holdLoaded(ctx, m, "bench-hold.target", hold); err != nil {
		return err
	}
	rows := []*row{{name: "no cage (plain unit)", unit: "bench-base.service", chain: []string{"bench-base.service"}}}
	for _, b := range backends {
		r := &row{name: b.backend, agent: b.agent, unit: systest.AgentUnit(b.agent), chain: perStart(b.agent)}
		// The cold start, once: namespace, prepare step, sockets, mount and
		// every per-start step, from nothing. A failing backend is
		// reported, not fatal.
		r.cold, r.err = coldStart(ctx, m, b.backend, b.agent)
		rows = append(rows, r)
	}
	rows = append(rows,
		&row{name: "service walls alone", unit: wallsAlone, chain: []string{wallsAlone}},
		&row{name: "service, old hardening", unit: wallsBefore, chain: []string{wallsBefore}})
	for _, v := range vs {
		rows = append(rows, &row{name: v.row, unit: v.unit, chain: []string{v.unit}})
	}
	loadStart, _ := m.ReadFile("/proc/loadavg")
	// Warm starts, interleaved round by round so that the load on this
	// shared machine falls on every backend and the baseline alike.
	for i := 0; i < *n; i++ {
		// In a new order each round (see runGroups).
		for _, j := range rand.New(rand.NewPCG(2, uint64(i))).Perm(len(rows)) {
			r := rows[j]
			if r.err != nil {
				continue
			}
			var s sample
			s, r.err = measure(ctx, m, r.unit, r.chain)
			r.samples = append(r.samples, s)
		}
	}
	// What the nspawn and podman wrappers run before their manager: the
	// store bind resolution, timed alone in the machine.
	bindsAlone := map[string]time.Duration{}
	for _, b := range []string{"nspawn", "podman"} {
		var ds []time.Duration
		for i := 0; i < *n; i++ {
			d, err := timeInMachine(ctx, m, "/usr/local/bin/cagectl store binds --store /var/lib/nixcage/store --for "+b+" >/dev/null")
			if err != nil {
				return err
			}
			ds = append(ds, d)
		}
		bindsAlone[b] = median(ds)
	}
	load, _ := m.ReadFile("/proc/loadavg")
	report(out, *n, rows, bindsAlone, strings.TrimSpace(string(loadStart)), strings.TrimSpace(string(load)))
	if *withGroups {
		if err := runGroups(ctx, m, *n, out); err != nil {
			return err
		}
		load, _ = m.ReadFile("/proc/loadavg")
		fmt.Fprintf(out, "load average at the end: %s\n", strings.TrimSpace(string(load)))
	}
	return nil
}

// holdLoaded loads the unit files written and starts target, an active
// target ordered after units (After= pulls nothing in): systemd unloads an
// inactive unit nothing refers to, and with it its stamps.
func holdLoaded(ctx context.Context, m *systest.Machine, target string, units []string) error {
	if err := m.WriteFile("/etc/systemd/system/"+target, []byte("[Unit]\nDescription=keeps the measured units loaded\nAfter="+strings.Join(units, " ")+"\n"), 0o644); err != nil {
		return err
	}
	if _, err := m.Run(ctx, "systemctl", "daemon-reload"); err != nil {
		return err
	}
	_, err := m.Run(ctx, "systemctl", "start", target)
	return err
}

var backends = []struct{ backend, agent string }{{"service", "svc"}, {"nspawn", "nsp"}, {"podman", "pod"}}

type row struct {
	name, agent, unit string
	chain             []string // units that run again at every start, in order
	samples           []sample
	cold              sample
	err               error
}

// A sample is one start: the total span and the stamps of every unit state
// change in the chain, as offsets from the clock reading before the start.
type sample struct {
	total  time.Duration
	events []event
}

type event struct {
	name string // unit:stamp
	at   time.Duration
}

// perStart names the units a warm start runs (the gateway side, namespace
// and mount stay active between starts), in the order systemd runs them:
// the agent's alone, for every backend.
func perStart(agent string) []string {
	return []string{systest.AgentUnit(agent)}
}

// coldChain is every unit of an agent's start from nothing.
func coldChain(backend, agent string) []string {
	u := []string{paths.Instance(paths.NetnsTemplate, agent), paths.Instance(paths.PrepTemplate, agent),
		systest.ProxySocket(agent), systest.DNSSocket(agent)}
	if backend != "service" {
		u = append(u, mountUnit(agent))
	}
	return append(u, perStart(agent)...)
}

func mountUnit(agent string) string {
	return unit.UnitNamePathEscape(paths.DefaultWorkspace(agent)) + ".mount"
}

// coldStart stops the agent's namespace (which takes every unit bound to it
// along) and its mount, times one start from nothing, then leaves the
// gateway side warm for the warm starts.
func coldStart(ctx context.Context, m *systest.Machine, backend, agent string) (sample, error) {
	stop := []string{"systemctl", "stop", paths.Instance(paths.NetnsTemplate, agent), paths.Instance(paths.PrepTemplate, agent)}
	if backend != "service" {
		stop = append(stop, mountUnit(agent))
	}
	if _, err := m.Run(ctx, stop...); err != nil {
		return sample{}, err
	}
	s, err := measure(ctx, m, systest.AgentUnit(agent), coldChain(backend, agent))
	if err != nil {
		j, _ := m.Run(ctx, "journalctl", "--no-pager", "-n", "15", "-u", "nixcage-*@"+agent+".service")
		return s, fmt.Errorf("%w\n%s", err, j)
	}
	// Keep the gateway side up between warm starts, as for an agent that
	// restarts (the sockets hold the namespace and prepare step).
	if _, err := m.Run(ctx, "systemctl", "start", systest.ProxySocket(agent), systest.DNSSocket(agent)); err != nil {
		return s, err
	}
	return s, nil
}

// stamps are the unit properties read after each start: when the unit left
// inactive, forked its main process, became active, its main process
// exited, and it was inactive again.
var stamps = []string{"InactiveExitTimestampMonotonic", "ExecMainStartTimestampMonotonic",
	"ActiveEnterTimestampMonotonic", "ExecMainExitTimestampMonotonic", "InactiveEnterTimestampMonotonic"}

var stampName = map[string]string{
	"InactiveExitTimestampMonotonic":  "starting",
	"ExecMainStartTimestampMonotonic": "forked",
	"ActiveEnterTimestampMonotonic":   "active",
	"ExecMainExitTimestampMonotonic":  "exited",
	"InactiveEnterTimestampMonotonic": "inactive",
}

// wallsAlone is the service agent's unit as rendered with its [Unit]
// section dropped: the same sandbox (its namespace joined, its binds, its
// user, its filters), nothing of nixcage started around it. wallsBefore is
// that unit with the hardening the service cage had before
// render.serviceCageHardening.
const (
	wallsAlone  = "bench-svc-walls.service"
	wallsBefore = "bench-svc-oldhardening.service"
)

func writeServiceVariants(m *systest.Machine) error {
	name := systest.AgentUnit("svc")
	b, err := m.ReadFile("/etc/systemd/system/" + name)
	if err != nil {
		return err
	}
	u := string(b)
	i := strings.Index(u, "\n[Service]\n")
	if i < 0 {
		return fmt.Errorf("%s has no [Service] section", name)
	}
	// Its own cgroup is bound at /sys/fs/cgroup by the unit's name.
	own := `/sys/fs/cgroup/system.slice/system-nixcage\\x2dagent.slice/` + name + ":" // as the unit file escapes it
	if !strings.Contains(u, own) {
		return fmt.Errorf("%s does not bind its cgroup as %s", name, own)
	}
	svc := u[i+1:]
	for unit, extra := range map[string]string{wallsAlone: "", wallsBefore: "ProtectKernelTunables=yes\nProtectHome=yes\n"} {
		s := strings.Replace(svc, own, "/sys/fs/cgroup/system.slice/"+unit+":", 1)
		s = strings.Replace(s, "\nRestart=on-failure\n", "\n", 1)
		if extra != "" {
			// As it was: these two instead of ReadOnlyPaths=/sys.
			s = strings.Replace(s, "\nReadOnlyPaths=/sys\n", "\n", 1)
			s = strings.Replace(s, "[Service]\n", "[Service]\n"+extra, 1)
		}
		if err := m.WriteFile("/etc/systemd/system/"+unit, []byte(s), 0o644); err != nil {
			return err
		}
	}
	return nil
}

// A variant is an agent's unit as rendered with some lines changed, run
// as a row of its own in the same run: what a stage costs.
type variant struct {
	row, unit, agent string
	edits            [][2]string // each old string must occur once
}

// variants are the managers' own seccomp filters as they were before
// cage-seal's replaced them (issue 16): nspawn's filter (with its deny of
// io_uring), its stub init as PID 1 and cage-seal exec'ing the command;
// podman's default profile.
var variants = []variant{
	{"nspawn, as before", "bench-nspawn-before.service", "nsp", [][2]string{
		{"\nEnvironment=SYSTEMD_SECCOMP=0\n", "\n"},
		{"\nTemporaryFileSystem=/tmp /var/tmp\nPrivateMounts=yes\n", "\nPrivateTmp=yes\n"},
		{" --kill-signal=SIGTERM ", ` "--system-call-filter=~io_uring_setup io_uring_enter io_uring_register" --as-pid2 `},
		{" /etc/nixcage/cage-seal --init -- ", " /etc/nixcage/cage-seal -- "},
	}},
	{"podman, as before", "bench-podman-before.service", "pod", [][2]string{{" --security-opt=seccomp=unconfined ", " "}}},
}

// sandboxVariants (-nspawn-sandbox) take the nspawn unit's own sandbox
// apart: what its mount-namespace options cost, and PrivateTmp= (as
// before) against the tmpfs that replaced it.
var sandboxVariants = []variant{
	{"nspawn, PrivateTmp=", "bench-nspawn-privtmp.service", "nsp", [][2]string{{"\nTemporaryFileSystem=/tmp /var/tmp\nPrivateMounts=yes\n", "\nPrivateTmp=yes\n"}}},
	{"nspawn, no private /tmp", "bench-nspawn-notmp.service", "nsp", [][2]string{{"\nTemporaryFileSystem=/tmp /var/tmp\n", "\n"}}},
	{"nspawn, no ProtectHome=", "bench-nspawn-nohome.service", "nsp", [][2]string{{"\nProtectHome=yes\n", "\n"}}},
	{"nspawn, no mount options", "bench-nspawn-nomnt.service", "nsp", [][2]string{{"\nTemporaryFileSystem=/tmp /var/tmp\n", "\n"}, {"\nProtectHome=yes\n", "\n"},
		{"\nProtectKernelModules=yes\n", "\n"}, {"\nProtectKernelLogs=yes\n", "\n"}}},
}

func (v variant) write(m *systest.Machine) error {
	b, err := m.ReadFile("/etc/systemd/system/" + systest.AgentUnit(v.agent))
	if err != nil {
		return err
	}
	u := string(b) // every other line as rendered
	for _, r := range v.edits {
		if strings.Count(u, r[0]) != 1 {
			return fmt.Errorf("%s: expected %q once", systest.AgentUnit(v.agent), r[0])
		}
		u = strings.Replace(u, r[0], r[1], 1)
	}
	return m.WriteFile("/etc/systemd/system/"+v.unit, []byte(u), 0o644)
}

// baseUnit runs the same command with no cage; Type=exec as the agents.
const baseUnit = `[Unit]
Description=start-latency baseline (no cage)

[Service]
Type=exec
ExecStart=/bin/true
`

// measure starts a unit once. The span runs from a clock reading taken in
// the machine right before `systemctl start --no-block` to the stamp of
// PID 1's "Deactivated successfully" message for that start, so polling
// for the result adds nothing to the figure. Then it reads the chain's
// own stamps from systemd (monotonic, placed on the same clock through the
// journal entry, which carries both).
func measure(ctx context.Context, m *systest.Machine, unit string, chain []string) (sample, error) {
	// Units kept loaded keep their start-rate counters (the agent's 5 in
	// 60 s, a oneshot's systemd default 5 in 10 s); reset them.
	if _, err := m.Run(ctx, append([]string{"systemctl", "reset-failed"}, chain...)...); err != nil {
		return sample{}, err
	}
	cur, err := cursor(ctx, m)
	if err != nil {
		return sample{}, err
	}
	out, err := m.Shell(ctx, "date +%s%N; systemctl start --no-block "+unit)
	if err != nil {
		return sample{}, err
	}
	t0, err := strconv.ParseInt(strings.TrimSpace(out), 10, 64)
	if err != nil {
		return sample{}, fmt.Errorf("clock reading %q: %w", out, err)
	}
	real, mono, err := finished(ctx, m, unit, cur)
	if err != nil {
		return sample{}, err
	}
	s := sample{total: time.Duration(real*1000 - t0)}
	args := []string{"systemctl", "show", "-p", strings.Join(stamps, ",")}
	out, err = m.Run(ctx, append(args, chain...)...)
	if err != nil {
		return s, err
	}
	// One block per unit, in the order asked, separated by blank lines.
	for i, block := range strings.Split(strings.TrimSpace(out), "\n\n") {
		if i >= len(chain) {
			break
		}
		for _, line := range strings.Split(block, "\n") {
			k, v, _ := strings.Cut(line, "=")
			us, err := strconv.ParseInt(v, 10, 64)
			if err != nil || us == 0 {
				continue
			}
			at := time.Duration((real-(mono-us))*1000 - t0)
			if at < 0 {
				continue // a stamp from an earlier start or stop
			}
			s.events = append(s.events, event{short(chain[i]) + " " + stampName[k], at})
		}
	}
	return s, nil
}

// short drops what every unit name of the chain repeats.
func short(u string) string {
	if i := strings.IndexByte(u, '@'); i > 0 {
		return u[:i] + u[strings.LastIndexByte(u, '.'):]
	}
	if strings.HasSuffix(u, ".mount") {
		return "workspace.mount"
	}
	return u
}

// timeInMachine times a shell command by the machine's own clock.
func timeInMachine(ctx context.Context, m *systest.Machine, script string) (time.Duration, error) {
	out, err := m.Shell(ctx, "a=$(date +%s%N); "+script+"; b=$(date +%s%N); echo $((b-a))")
	if err != nil {
		return 0, err
	}
	ns, err := strconv.ParseInt(strings.TrimSpace(out), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("clock reading %q: %w", out, err)
	}
	return time.Duration(ns), nil
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
// returns its realtime and monotonic stamps (µs). A failed start is an
// error naming why.
func finished(ctx context.Context, m *systest.Machine, unit, after string) (int64, int64, error) {
	deadline := time.Now().Add(time.Minute)
	for {
		out, err := m.Run(ctx, "journalctl", "--after-cursor="+after, "-o", "json", "-u", unit)
		if err != nil {
			return 0, 0, err
		}
		for _, line := range strings.Split(out, "\n") {
			var e struct {
				ID   string `json:"MESSAGE_ID"`
				Real string `json:"__REALTIME_TIMESTAMP"`
				Mono string `json:"__MONOTONIC_TIMESTAMP"`
			}
			if json.Unmarshal([]byte(line), &e) == nil && e.ID == msgUnitSuccess {
				r, err1 := strconv.ParseInt(e.Real, 10, 64)
				mo, err2 := strconv.ParseInt(e.Mono, 10, 64)
				if err1 != nil || err2 != nil {
					return 0, 0, fmt.Errorf("journal stamps %q %q", e.Real, e.Mono)
				}
				return r, mo, nil
			}
		}
		st, err := m.UnitState(ctx, unit)
		if err == nil && (st.Active == "failed" || st.Sub == "auto-restart") {
			j, _ := m.Journal(ctx, unit)
			m.Run(ctx, "systemctl", "stop", unit)
			return 0, 0, fmt.Errorf("%s ended with %s: %s", unit, st.Result, lastLines(j, 3))
		}
		if time.Now().After(deadline) {
			return 0, 0, fmt.Errorf("%s did not finish within a minute", unit)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// report prints the totals with their ratio to the plain unit, then each
// backend's stages: the median offset of every stamp from the start and
// the step from the one before.
func report(out io.Writer, n int, rows []*row, bindsAlone map[string]time.Duration, loadStart, load string) {
	totals := func(r *row) []time.Duration {
		var ds []time.Duration
		for _, s := range r.samples {
			ds = append(ds, s.total)
		}
		return ds
	}
	baseMed := median(totals(rows[0]))
	fmt.Fprintf(out, "\ncage start latency: systemctl start -> Deactivated, /bin/true, n=%d interleaved, median (p90)\n", n)
	fmt.Fprintf(out, "load average at the start: %s, at the end: %s\n", loadStart, load)
	fmt.Fprintf(out, "%-24s %10s %10s %8s  %s\n", "backend", "median", "p90", "ratio", "target")
	targets := map[string]string{"service": "<= 1.5x", "nspawn": "<= 150 ms", "podman": "reported"}
	for _, r := range rows {
		if r.err != nil {
			fmt.Fprintf(out, "%-24s %10s %10s %8s  %s\n", r.name, "-", "-", "-", "FAILED: "+oneLine(r.err.Error()))
			continue
		}
		t := totals(r)
		med := median(t)
		fmt.Fprintf(out, "%-24s %10s %10s %7.2fx  %s\n", r.name, ms(med), ms(pct(t, 0.9)), float64(med)/float64(baseMed), targets[r.name])
	}
	for _, r := range rows {
		if r.err != nil {
			continue
		}
		fmt.Fprintf(out, "\n%s, warm start (median offset from `systemctl start`, step from the stamp before)\n", r.name)
		stages(out, r.samples, baseMed)
		if b, ok := bindsAlone[r.name]; ok {
			fmt.Fprintf(out, "  of which the ExecStart wrapper's `cagectl store binds` alone: %s\n", ms(b))
		}
		if len(r.cold.events) > 0 {
			fmt.Fprintf(out, "%s, cold start (n=1: namespace, prepare step, sockets from nothing)\n", r.name)
			stages(out, []sample{r.cold}, baseMed)
		}
	}
	for _, r := range rows {
		if r.err != nil {
			fmt.Fprintf(out, "\n%s failed:\n%v\n", r.name, r.err)
		}
	}
}

func stages(out io.Writer, ss []sample, base time.Duration) {
	at := map[string][]time.Duration{}
	var total []time.Duration
	for _, s := range ss {
		for _, e := range s.events {
			at[e.name] = append(at[e.name], e.at)
		}
		total = append(total, s.total)
	}
	type st struct {
		name string
		at   time.Duration
	}
	var list []st
	for k, v := range at {
		list = append(list, st{k, median(v)})
	}
	sort.Slice(list, func(i, j int) bool { return list[i].at < list[j].at })
	prev := time.Duration(0)
	for _, e := range list {
		fmt.Fprintf(out, "  %10s  %10s  %s\n", ms(e.at), "+"+ms(e.at-prev), e.name)
		prev = e.at
	}
	t := median(total)
	fmt.Fprintf(out, "  %10s  %10s  Deactivated (journal); total %.2fx the plain unit\n", ms(t), "+"+ms(t-prev), float64(t)/float64(base))
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
