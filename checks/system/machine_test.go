// Package system holds nixcage's system tests: each boots a disposable Debian
// 12 machine with a real systemd 252 (internal/systest) and checks the
// appliance end to end. They run only with NIXCAGE_TEST_SYSTEM=1 as root.
package system

import (
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/nixcage/nixcage/internal/systest"
	"github.com/nixcage/nixcage/internal/systest/demo"
	"github.com/nixcage/nixcage/internal/systest/probe"
)

func TestMain(m *testing.M) {
	code := m.Run()
	systest.CleanupBuilds()
	os.Exit(code)
}

const probePkg = "./checks/system/probe"

// installProbe puts the probe at /usr/local/bin/cage-probe in the machine.
func installProbe(t *testing.T, m *systest.Machine) {
	t.Helper()
	bin := systest.BuildT(t, probePkg)
	if err := m.CopyIn(bin, "/usr/local/bin/cage-probe", 0o755); err != nil {
		t.Fatal(err)
	}
}

// TestMachineLifecycle checks the harness itself: a machine boots to a
// finished systemd, takes files, runs commands, leaves the cached tree
// untouched and leaves nothing running after Close.
func TestMachineLifecycle(t *testing.T) {
	m := systest.BootT(t)
	if got := strings.TrimSpace(m.MustRun(t, "systemctl", "is-system-running")); got != "running" && got != "degraded" {
		t.Fatalf("is-system-running = %q", got)
	}
	if got := strings.TrimSpace(m.MustRun(t, "readlink", "/proc/1/exe")); !strings.Contains(got, "systemd") {
		t.Fatalf("machine PID 1 is %q, want systemd", got)
	}
	m.MustWriteFile(t, "/etc/systest-marker", []byte("marker\n"), 0o644)
	if got := m.MustRun(t, "cat", "/etc/systest-marker"); got != "marker\n" {
		t.Fatalf("file written into machine reads back %q", got)
	}
	root := systest.RootfsT(t)
	if _, err := os.Stat(filepath.Join(root, "etc/systest-marker")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("write in machine reached the cached tree: stat = %v", err)
	}
	// The machine has its own network: only lo.
	links := m.MustRun(t, "ip", "-o", "link")
	if n := strings.Count(strings.TrimSpace(links), "\n") + 1; n != 1 || !strings.Contains(links, "lo:") {
		t.Fatalf("machine links = %q, want only lo", links)
	}
	leader := m.Leader
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(leader, 0); !errors.Is(err, syscall.ESRCH) {
		t.Fatalf("machine PID 1 (%d) still exists after Close: kill(0) = %v", leader, err)
	}
	if _, err := os.Stat(filepath.Join("/run/systemd/nspawn/propagate", m.Name)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("nspawn left its propagate dir behind: %v", err)
	}
}

// TestNetnsSocketActivation is the design check of ARCHITECTURE.md §3 with
// hand-written units: a socket bound inside a lo-only namespace, served by a
// DynamicUser service in the host namespace, reached by a DynamicUser agent
// whose direct connections fail in the kernel.
func TestNetnsSocketActivation(t *testing.T) {
	m := systest.BootT(t)
	installProbe(t, m)
	units, err := filepath.Glob("testdata/netns-design/*")
	if err != nil || len(units) == 0 {
		t.Fatalf("no design units: %v", err)
	}
	for _, u := range units {
		if err := m.CopyIn(u, "/etc/systemd/system/"+filepath.Base(u), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	m.MustRun(t, "systemctl", "daemon-reload")
	m.MustRun(t, "systemctl", "start", "systest-agent@A.service")

	out, err := m.ReadFile("/run/systest-agent-A.json")
	if err != nil {
		t.Fatal(err)
	}
	rs, err := probe.Parse(string(out))
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]probe.Result{}
	for _, r := range rs {
		got[r.Check] = r
	}
	agentUID := uidOf(t, got["id"].Detail)
	if agentUID < 61184 || agentUID > 65519 {
		t.Errorf("agent uid %d is not a dynamic user (61184-65519): %s", agentUID, got["id"].Detail)
	}

	proxy := got["dial,tcp,127.0.0.1:3128"]
	if !proxy.OK {
		t.Fatalf("agent could not reach the socket in its namespace: %+v", proxy)
	}
	m2 := regexp.MustCompile(`^hello from uid (\d+)$`).FindStringSubmatch(proxy.Detail)
	if m2 == nil {
		t.Fatalf("socket-activated service did not greet: %q", proxy.Detail)
	}
	if uid, _ := strconv.Atoi(m2[1]); uid < 61184 || uid > 65519 || uid == agentUID {
		t.Errorf("proxy service uid %d: want a dynamic user distinct from the agent's %d", uid, agentUID)
	}
	// The service runs in the machine's namespace, not the agent's.
	if ns := strings.TrimSpace(m.MustShell(t, `readlink /proc/$(systemctl show -P MainPID systest-proxy@A.service)/ns/net`)); ns != strings.TrimSpace(m.MustRun(t, "readlink", "/proc/1/ns/net")) {
		t.Errorf("proxy service runs in netns %s, want the machine's", ns)
	}
	// TEST-NET addresses: nothing could answer even if a packet left.
	for _, c := range []string{"dial,tcp,192.0.2.1:443", "dial,udp,192.0.2.1:53", "dial,tcp,[2001:db8::1]:443"} {
		r := got[c]
		if r.OK || r.Errno != "ENETUNREACH" {
			t.Errorf("%s from the agent: got ok=%v errno=%q err=%q, want ENETUNREACH", c, r.OK, r.Errno, r.Error)
		}
	}
	// ICMP: either the socket is refused (ping_group_range) or the route is.
	if r := got["ping,192.0.2.1"]; r.OK || (r.Errno != "ENETUNREACH" && r.Errno != "EACCES" && r.Errno != "EPERM") {
		t.Errorf("ping from the agent: got ok=%v errno=%q err=%q, want a kernel refusal", r.OK, r.Errno, r.Error)
	}
}

func uidOf(t *testing.T, id string) int {
	t.Helper()
	m := regexp.MustCompile(`Uid: (\d+)`).FindStringSubmatch(id)
	if m == nil {
		t.Fatalf("no uid in probe identity %q", id)
	}
	n, _ := strconv.Atoi(m[1])
	return n
}

// TestFakeInternet checks the machine's fake internet the way the gateway
// will use it: the system resolver finds the zone, the system trust store
// accepts the upstream certificate, and the upstream logs what it got.
func TestFakeInternet(t *testing.T) {
	m := systest.BootT(t)
	in := systest.StartInternetT(t, m)
	if got := strings.Fields(m.MustRun(t, "getent", "ahostsv4", "evil.example.org")); len(got) == 0 || got[0] != "203.0.113.20" {
		t.Fatalf("evil.example.org resolves to %v, want 203.0.113.20", got)
	}
	body := m.MustRun(t, "curl", "-sS", "--fail", "-H", "X-Systest: 1", "https://api.example.com/hello?x=1")
	if !strings.Contains(body, `"host":"api.example.com"`) {
		t.Fatalf("echo body = %s", body)
	}
	if out, err := m.Run(t.Context(), "curl", "-sS", "--fail", "https://nonexistent.example.com/"); err == nil {
		t.Fatalf("a name outside the zone resolved: %s", out)
	}
	rs, err := in.Requests()
	if err != nil {
		t.Fatal(err)
	}
	var seen bool
	for _, r := range rs {
		if r.Kind == "https" && r.Path == "/hello?x=1" {
			seen = true
			if r.SNI != "api.example.com" || r.Headers["X-Systest"][0] != "1" || !strings.HasPrefix(r.Remote, systest.GatewaySideAddr+":") {
				t.Errorf("upstream record = %+v", r)
			}
		}
	}
	if !seen {
		t.Fatalf("upstream did not log the request: %+v", rs)
	}
}

// TestDemoQuickstart runs the README's quick start (checks/demo.sh without
// the host setup) in-process: examples/quickstart.hcl, agent "demo". The
// demo itself fails unless the cage behaved as documented.
func TestDemoQuickstart(t *testing.T) {
	systest.RootfsT(t)
	var out strings.Builder
	err := demo.Run(t.Context(), nil, &out)
	t.Log(out.String())
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"exfiltration refused", "real key received by: [api.example.com]", "blocked  CONNECT  evil.example.org:443"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("demo output lacks %q", want)
		}
	}
}
