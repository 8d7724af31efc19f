package latency

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/nixcage/nixcage/internal/systest"
)

// A group is a set of the service cage's unit lines left out of one
// variant of it (leave one out: what each costs, with all the others in
// place), or lines added to it.
type group struct {
	name string
	drop string // regexp of the [Service] lines left out
	add  string // lines added
}

// groups are the service cage's sandbox options, as the profile of a start
// groups them (docs/performance.md, "Cage start latency").
var groups = []group{
	{name: "as rendered"},
	{name: "+ ProtectKernelTunables=, ProtectHome= (before the cut)", drop: `^ReadOnlyPaths=/sys$`, add: "ProtectKernelTunables=yes\nProtectHome=yes\n"},
	{name: "- ProtectKernelModules=", drop: `^ProtectKernelModules=`},
	{name: "- ProtectKernelLogs=", drop: `^ProtectKernelLogs=`},
	{name: "- ProtectControlGroups=", drop: `^ProtectControlGroups=`},
	{name: "- ProtectSystem=", drop: `^ProtectSystem=`},
	{name: "- PrivateTmp=", drop: `^PrivateTmp=`},
	{name: "- PrivateDevices= (and its /dev tmpfs)", drop: `^PrivateDevices=|^TemporaryFileSystem=/dev/`},
	{name: "- ProtectProc=, ProcSubset=", drop: `^ProtectProc=|^ProcSubset=`},
	{name: "- ReadOnlyPaths=/sys", drop: `^ReadOnlyPaths=/sys$`},
	{name: "- /sys and /var/lib view (tmpfs, cpu, cgroup)", drop: `^TemporaryFileSystem=/var/lib|^BindReadOnlyPaths=/sys`},
	{name: "- the 3 file binds (resolv.conf, CA, bundle)", drop: `^BindReadOnlyPaths=/(run|var/lib/nixcage/egress)/`},
	{name: "- PrivateUsers=", drop: `^PrivateUsers=`},
	{name: "- seccomp and friends", drop: `^SystemCall|^RestrictAddressFamilies=|^LockPersonality=|^RestrictRealtime=|^RestrictSUIDSGID=|^MemoryDenyWriteExecute=|^RestrictNamespaces=`},
	{name: "- PrivateIPC=, ProtectHostname=, ProtectClock=", drop: `^PrivateIPC=|^ProtectHostname=|^ProtectClock=`},
	{name: "- RootDirectory= and every bind (host root)", drop: `^RootDirectory=|^BindReadOnlyPaths=|^BindPaths=|^TemporaryFileSystem=|^WorkingDirectory=`},
}

// runGroups measures each group's variant of the service cage's unit
// (wallsAlone's: no units of nixcage around it), interleaved round by
// round in a shuffled order: PID 1's fork of the main process to its exec (the sandbox being
// set up), and, once per variant under strace of the machine's PID 1, how
// often the forked child parsed the mount table and how many mounts it
// made. The counts do not move with the load; the times do.
func runGroups(ctx context.Context, m *systest.Machine, n int, out io.Writer) error {
	b, err := m.ReadFile("/etc/systemd/system/" + wallsAlone)
	if err != nil {
		return err
	}
	var units []string
	for i, g := range groups {
		u := fmt.Sprintf("bench-group-%02d.service", i)
		lines := strings.Split(string(b), "\n")
		var keep []string
		re := regexp.MustCompile(g.drop)
		for _, l := range lines {
			if g.drop == "" || !re.MatchString(l) {
				keep = append(keep, l)
			}
		}
		text := strings.Replace(strings.Join(keep, "\n"), "[Service]\n", "[Service]\n"+g.add, 1)
		text = strings.Replace(text, "/sys/fs/cgroup/system.slice/"+wallsAlone+":", "/sys/fs/cgroup/system.slice/"+u+":", 1)
		if err := m.WriteFile("/etc/systemd/system/"+u, []byte(text), 0o644); err != nil {
			return err
		}
		units = append(units, u)
	}
	if err := holdLoaded(ctx, m, "bench-groups.target", units); err != nil {
		return err
	}
	counts := make([]string, len(units))
	for i, u := range units {
		counts[i] = countMounts(ctx, m, u)
	}
	sandbox := make([][]time.Duration, len(units))
	for r := 0; r < n; r++ {
		// A new order each round: with one fixed order the first unit of
		// a round came out 20-40 ms faster than the others at load 13.
		for _, i := range rand.New(rand.NewPCG(1, uint64(r))).Perm(len(units)) {
			u := units[i]
			s, err := measure(ctx, m, u, []string{u})
			if err != nil {
				return fmt.Errorf("%s (%s): %w", u, groups[i].name, err)
			}
			var forked, active time.Duration
			for _, e := range s.events {
				switch {
				case strings.HasSuffix(e.name, " forked"):
					forked = e.at
				case strings.HasSuffix(e.name, " active"):
					active = e.at
				}
			}
			sandbox[i] = append(sandbox[i], active-forked)
		}
	}
	base := median(sandbox[0])
	fmt.Fprintf(out, "\nservice cage's sandbox by option group: fork -> exec of /bin/true, n=%d interleaved, median; mount-table parses and mounts of one start (strace of PID 1)\n", n)
	fmt.Fprintf(out, "%-56s %10s %9s  %s\n", "variant of the unit as rendered", "sandbox", "vs first", "parses / mount() / umount2()")
	for i, g := range groups {
		med := median(sandbox[i])
		fmt.Fprintf(out, "%-56s %10s %+8.1f  %s\n", g.name, ms(med), float64(med-base)/float64(time.Millisecond), counts[i])
	}
	return nil
}

// countMounts starts unit once with strace following the machine's PID 1
// and counts, in the child that execs /bin/true, the opens and rewinds of
// /proc/self/mountinfo (each one a parse of the whole mount table) and the
// mount calls. "-" without strace on the host.
func countMounts(ctx context.Context, m *systest.Machine, unit string) string {
	strace, err := exec.LookPath("strace")
	if err != nil {
		return "- (no strace on the host)"
	}
	dir, err := os.MkdirTemp("", "nixcage-bench-strace-")
	if err != nil {
		return "- (" + err.Error() + ")"
	}
	defer os.RemoveAll(dir)
	cmd := exec.CommandContext(ctx, strace, "-f", "-ff", "-qq", "-e", "trace=openat,lseek,mount,umount2,execve",
		"-o", filepath.Join(dir, "t"), "-p", strconv.Itoa(m.Leader))
	if err := cmd.Start(); err != nil {
		return "- (" + err.Error() + ")"
	}
	time.Sleep(time.Second) // attached to PID 1 before the start
	m.Run(ctx, "systemctl", "reset-failed", unit)
	_, startErr := m.Run(ctx, "systemctl", "start", unit)
	time.Sleep(300 * time.Millisecond)
	cmd.Process.Signal(os.Interrupt)
	cmd.Wait()
	if startErr != nil {
		return "- (start failed: " + oneLine(startErr.Error()) + ")"
	}
	files, _ := filepath.Glob(filepath.Join(dir, "t.*"))
	sort.Strings(files)
	rewind := regexp.MustCompile(`lseek\(\d+, 0, SEEK_SET\)`)
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil || !strings.Contains(string(b), `execve("/bin/true"`) {
			continue
		}
		t := string(b)
		parses := strings.Count(t, "/proc/self/mountinfo") + len(rewind.FindAllString(t, -1))
		return fmt.Sprintf("%d / %d / %d", parses, strings.Count(t, "mount("), strings.Count(t, "umount2("))
	}
	return "- (no exec seen)"
}
