package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/bus/bustest"
	"github.com/nixcage/nixcage/internal/daemon/daemontest"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/release/releasetest"
	"github.com/nixcage/nixcage/internal/testenv"
)

const cliAgents = `
agent "alpha" {
  backend = "service"
  command = ["/bin/sleep", "infinity"]
}
agent "beta-2" {
  backend   = "nspawn"
  command   = ["/bin/sleep", "infinity"]
  autostart = false
}
account "viewers" {
  user = "nobody"
  role = "viewer"
}
`

func TestMain(m *testing.M) {
	// Re-executed as another uid by TestExitCodesAsOtherUsers: be cagectl.
	if os.Getenv("NIXCAGE_CLI_HELPER") == "1" {
		os.Exit(Main(context.Background(), os.Args[2:], OS()))
	}
	os.Exit(m.Run())
}

func TestStatusTableJSONAndNames(t *testing.T) {
	c := daemontest.Start(t, cliAgents)
	addr := c.Bus.Address
	out := mustRun(t, "status", "--bus", addr)
	for _, want := range []string{"caged dev, units render", "AGENT", "alpha", "service", "active/running", "beta-2", "nspawn", "inactive/dead", "manual start"} {
		if !strings.Contains(out, want) {
			t.Errorf("status table lacks %q:\n%s", want, out)
		}
	}
	out = mustRun(t, "status", "--json", "--bus", addr)
	var st bus.Status
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatalf("status --json: %v\n%s", err, out)
	}
	if len(st.Agents) != 2 || st.Agents[0].ActiveState != "active" || st.Agents[1].Backend != "nspawn" {
		t.Errorf("status --json = %+v", st)
	}
	if out := mustRun(t, "status", "--names", "--bus", addr); out != "alpha\nbeta-2\n" {
		t.Errorf("status --names = %q", out)
	}
	if out := mustRun(t, "status", "beta-2", "--json", "--bus", addr); !strings.Contains(out, `"name": "beta-2"`) || strings.Contains(out, `"name": "alpha"`) {
		t.Errorf("status beta-2 = %s", out)
	}
	t.Setenv(BusEnv, addr)
	if out := mustRun(t, "status", "--names"); out != "alpha\nbeta-2\n" {
		t.Errorf("status with $%s = %q", BusEnv, out)
	}
}

func TestControlCommandsAndExitCodes(t *testing.T) {
	c := daemontest.Start(t, cliAgents)
	addr := c.Bus.Address
	unit := paths.Instance(paths.AgentTemplate, "beta-2")
	mustRun(t, "start", "beta-2", "--bus", addr)
	if a, _ := c.SD.State(unit); a != "active" {
		t.Fatalf("beta-2 is %s after cagectl start", a)
	}
	if out := mustRun(t, "kill", "beta-2", "--bus", addr); !strings.Contains(out, "killed (SIGKILL)") {
		t.Errorf("kill: %q", out)
	}
	mustRun(t, "restart", "beta-2", "--bus", addr)
	mustRun(t, "stop", "beta-2", "--bus", addr)
	out := mustRun(t, "quarantine", "alpha", "--reason", "probing the metadata service", "--bus", addr)
	if !strings.Contains(out, "evidence in "+c.Path(paths.EvidenceRoot)) {
		t.Errorf("quarantine: %q", out)
	}
	if out := mustRun(t, "status", "--bus", addr); !strings.Contains(out, "QUARANTINED: probing the metadata service") {
		t.Errorf("status after quarantine:\n%s", out)
	}
	cases := []struct {
		name string
		args []string
		code int
		msg  string
	}{
		{"start while quarantined", []string{"start", "alpha"}, ExitFailure, "cagectl release alpha"},
		{"unknown agent", []string{"stop", "nope"}, ExitFailure, `no agent named "nope"`},
		{"bad agent name", []string{"kill", "../etc"}, ExitUsage, "not an agent name"},
		{"quarantine needs a reason", []string{"quarantine", "beta-2"}, ExitUsage, "--reason"},
		{"no agent given", []string{"start"}, ExitUsage, "usage"},
		{"apply without a store block", []string{"apply", "."}, ExitFailure, "declare store"},
		{"apply of a directory that is not there", []string{"apply", "/nonexistent/release"}, ExitFailure, "release directory: open /nonexistent/release: no such file"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, errOut, code := cagectl(t, append(tc.args, "--bus", addr)...)
			if code != tc.code || !strings.Contains(errOut, tc.msg) {
				t.Errorf("exit %d (want %d), stderr %q (want %q)", code, tc.code, errOut, tc.msg)
			}
		})
	}
	// A quarantine that cannot keep its evidence says so and exits 1; the
	// agent is down and marked all the same.
	ev := c.Path(paths.EvidenceRoot)
	mustRun(t, "start", "beta-2", "--bus", addr)
	if err := os.Rename(ev, ev+".saved"); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(ev, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, errOut, code := cagectl(t, "quarantine", "beta-2", "--reason", "x", "--bus", addr); code != ExitFailure || !strings.Contains(errOut, "evidence") || !strings.Contains(errOut, "not a directory") {
		t.Errorf("quarantine with an unwritable evidence root: exit %d, stderr %q", code, errOut)
	}
	if a, _ := c.SD.State(unit); a == "active" {
		t.Error("beta-2 still runs after a quarantine whose evidence failed")
	}
	os.Remove(ev)
	if err := os.Rename(ev+".saved", ev); err != nil {
		t.Fatal(err)
	}
	mustRun(t, "release", "beta-2", "--bus", addr)
	mustRun(t, "release", "alpha", "--bus", addr)
	mustRun(t, "start", "alpha", "--bus", addr)
	if out := mustRun(t, "reload", "--bus", addr); !strings.Contains(out, "reloaded") {
		t.Errorf("reload: %q", out)
	}

	// caged unreachable: exit 4, whatever the command.
	dead := "unix:path=" + filepath.Join(t.TempDir(), "nobus")
	for _, args := range [][]string{{"status"}, {"start", "alpha"}, {"rollback"}, {"events"}} {
		_, errOut, code := cagectl(t, append(args, "--bus", dead)...)
		if code != ExitNoConn {
			t.Errorf("%v on a dead bus: exit %d (want %d) %s", args, code, ExitNoConn, errOut)
		}
	}
}

func TestAuditThroughCaged(t *testing.T) {
	c := daemontest.Start(t, cliAgents)
	f := c.Path(filepath.Join(paths.AuditDir("alpha"), "audit.jsonl"))
	os.MkdirAll(filepath.Dir(f), 0o755)
	var recs strings.Builder
	for i := 0; i < 30; i++ {
		fmt.Fprintf(&recs, `{"schema":1,"ts":"2026-11-30T12:00:%02dZ","agent":"alpha","method":"CONNECT","host":"h%d.example","port":443,"decision":"blocked","reason":"host not allowed"}`+"\n", i, i)
	}
	os.WriteFile(f, []byte(recs.String()), 0o644)
	out := mustRun(t, "audit", "alpha", "-n", "3", "--bus", c.Bus.Address)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 3 || !strings.Contains(lines[2], "h29.example:443") || !strings.Contains(lines[2], "blocked") || !strings.Contains(lines[2], "host not allowed") {
		t.Errorf("audit -n 3:\n%s", out)
	}
	out = mustRun(t, "audit", "alpha", "-n", "1", "--json", "--bus", c.Bus.Address)
	var rec map[string]any
	if err := json.Unmarshal([]byte(out), &rec); err != nil || rec["host"] != "h29.example" {
		t.Errorf("audit --json: %q %v", out, err)
	}

	// --follow prints records appended later.
	ctx, cancel := context.WithCancel(context.Background())
	pr, pw := io.Pipe()
	done := make(chan int, 1)
	go func() {
		done <- Main(ctx, []string{"audit", "alpha", "-n", "0", "--follow", "--json", "--bus", c.Bus.Address}, Stdio{In: strings.NewReader(""), Out: pw, Err: io.Discard})
		pw.Close()
	}()
	// Append until the follower shows a record: it may start reading after
	// the first append, whose record then counts as history.
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		for {
			af, _ := os.OpenFile(f, os.O_APPEND|os.O_WRONLY, 0)
			af.WriteString(`{"schema":1,"agent":"alpha","host":"late.example","decision":"flagged"}` + "\n")
			af.Close()
			select {
			case <-stop:
				return
			case <-time.After(200 * time.Millisecond):
			}
		}
	}()
	buf := make([]byte, 4096)
	var got strings.Builder
	for !strings.Contains(got.String(), "late.example") {
		n, err := pr.Read(buf)
		if err != nil {
			t.Fatalf("follow ended: %v (%q)", err, got.String())
		}
		got.Write(buf[:n])
	}
	cancel()
	go io.Copy(io.Discard, pr)
	if code := <-done; code != 0 {
		t.Errorf("audit --follow exit %d", code)
	}
}

func TestEventsFollow(t *testing.T) {
	c := daemontest.Start(t, cliAgents)
	ctx, cancel := context.WithCancel(context.Background())
	pr, pw := io.Pipe()
	done := make(chan int, 1)
	go func() {
		done <- Main(ctx, []string{"events", "--follow", "--json", "--bus", c.Bus.Address}, Stdio{In: strings.NewReader(""), Out: pw, Err: io.Discard})
		pw.Close()
	}()
	// Retry the action until the stream shows it: the subscription may not
	// be in place for the first one.
	got := make(chan string, 1)
	go func() {
		var b strings.Builder
		buf := make([]byte, 4096)
		for {
			n, err := pr.Read(buf)
			b.Write(buf[:n])
			i := strings.Index(b.String(), "AgentKilled")
			if (i >= 0 && strings.Contains(b.String()[i:], "\n")) || err != nil {
				got <- b.String()
				io.Copy(io.Discard, pr)
				return
			}
		}
	}()
	var out string
	for out == "" {
		mustRun(t, "start", "beta-2", "--bus", c.Bus.Address)
		mustRun(t, "kill", "beta-2", "--bus", c.Bus.Address)
		select {
		case out = <-got:
		case <-time.After(200 * time.Millisecond):
		}
	}
	cancel()
	<-done
	found := false
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		var ev struct {
			TS, Kind, Agent string
			Data            map[string]string
		}
		if err := json.Unmarshal([]byte(line), &ev); err != nil {
			t.Fatalf("events --json line %q: %v", line, err)
		}
		if ev.Kind == "AgentKilled" && ev.Agent == "beta-2" && strings.Contains(ev.Data["by"], fmt.Sprintf("(uid %d)", daemontest.CallerUID())) && ev.TS != "" {
			found = true
		}
	}
	if !found {
		t.Errorf("no AgentKilled event for beta-2 in:\n%s", out)
	}
}

func TestLogsRunsJournalctl(t *testing.T) {
	dir := t.TempDir()
	script := "#!/bin/sh\necho journalctl \"$@\"\n"
	if err := os.WriteFile(filepath.Join(dir, "journalctl"), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", dir+":"+os.Getenv("PATH"))
	out := mustRun(t, "logs", "alpha", "-n", "5")
	for _, want := range []string{"-n 5", "-u nixcage-agent@alpha.service", "-u cage-egress@alpha.service", "-u nixcage-prep@alpha.service"} {
		if !strings.Contains(out, want) {
			t.Errorf("journalctl args lack %q: %s", want, out)
		}
	}
	if _, _, code := cagectl(t, "logs", "-x"); code != ExitUsage {
		t.Errorf("logs with a bad flag: exit %d", code)
	}
}

func TestCompletionBash(t *testing.T) {
	out := mustRun(t, "completion", "bash")
	for _, want := range []string{"complete -F _cagectl cagectl", "quarantine", "status --names", "generate"} {
		if !strings.Contains(out, want) {
			t.Errorf("completion lacks %q", want)
		}
	}
	bash := testenv.LookPath(t, "bash")
	cmd := exec.Command(bash, "-n")
	cmd.Stdin = strings.NewReader(out)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("bash -n: %v %s", err, b)
	}
}

// asOtherUID returns a runner of cagectl (this test binary, copied where
// other uids can run it) as a real other uid against caged c.
func asOtherUID(t *testing.T, c *daemontest.Caged) func(uid uint32, args ...string) (int, string) {
	self, _ := os.Executable()
	bin := filepath.Join(c.Bus.Dir, "cagectl-test")
	b, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, b, 0o755); err != nil {
		t.Fatal(err)
	}
	return func(uid uint32, args ...string) (int, string) {
		cmd := exec.Command(bin, append([]string{"-test.run=^$"}, append(args, "--bus", c.Bus.Address)...)...)
		cmd.Env = append(os.Environ(), "NIXCAGE_CLI_HELPER=1")
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}
		out, err := cmd.CombinedOutput()
		if ee, ok := err.(*exec.ExitError); ok {
			return ee.ExitCode(), string(out)
		}
		if err != nil {
			t.Fatal(err)
		}
		return 0, string(out)
	}
}

// Exit codes as other users, with credentials the bus itself reports.
func TestExitCodesAsOtherUsers(t *testing.T) {
	testenv.RequirePrivileged(t)
	c := daemontest.Start(t, cliAgents)
	run := asOtherUID(t, c)
	const nobody, backup = 65534, 34 // nobody is a declared viewer; backup has no account
	// apply opens the release directory itself and hands caged the
	// descriptor, so the viewer must be able to open one for caged to refuse.
	release, err := os.MkdirTemp("", "nixcage-release-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(release) })
	if err := os.Chmod(release, 0o755); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		uid  uint32
		args []string
		code int
	}{
		{"viewer reads status", nobody, []string{"status"}, ExitOK},
		{"stranger reads status", backup, []string{"status", "--json"}, ExitOK},
		{"viewer reads audit", nobody, []string{"audit", "alpha"}, ExitOK},
		{"stranger is refused audit", backup, []string{"audit", "alpha"}, ExitDenied},
		{"viewer is refused kill", nobody, []string{"kill", "alpha"}, ExitDenied},
		{"viewer is refused apply", nobody, []string{"apply", release}, ExitDenied},
		{"stranger is refused rollback", backup, []string{"rollback"}, ExitDenied},
		{"viewer is refused reload", nobody, []string{"reload"}, ExitDenied},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			code, out := run(tc.uid, tc.args...)
			if code != tc.code {
				t.Errorf("exit %d, want %d:\n%s", code, tc.code, out)
			}
			if tc.code == ExitDenied && !strings.Contains(out, "access denied") {
				t.Errorf("refusal does not say so: %s", out)
			}
		})
	}
	if a, _ := c.SD.State(paths.Instance(paths.AgentTemplate, "alpha")); a != "active" {
		t.Errorf("a refused kill changed alpha to %s", a)
	}
}

// Signed releases through caged: apply, events, status, generations,
// rollback; a tampered release is refused and nothing changes.
func TestApplyRollbackThroughCaged(t *testing.T) {
	releasetest.RequireNix(t)
	top1 := releasetest.Closure(t, "caged1", 32<<10)
	top2 := releasetest.Closure(t, "caged2", 32<<10)
	dir := t.TempDir()
	key := filepath.Join(dir, "ops")
	mustRun(t, "key", "generate", "--out", key)
	rel1, rel2 := filepath.Join(dir, "rel1"), filepath.Join(dir, "rel2")
	mustRun(t, "release", "create", top1, "--key", key+".key", "--channel", "stable", "--generation", "1", "--expires", "30d", "--out", rel1)
	mustRun(t, "release", "create", top2, "--key", key+".key", "--channel", "stable", "--generation", "2", "--expires", "30d", "--out", rel2)

	c := daemontest.Start(t, cliAgents+`
store {
  channel = "stable"
  keys    = ["/etc/nixcage/ops.pub"]
}
`)
	pub, _ := os.ReadFile(key + ".pub")
	os.WriteFile(c.Path("/etc/nixcage/ops.pub"), pub, 0o644)
	addr := c.Bus.Address

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cl := c.Client()
	events, err := cl.Events(ctx)
	if err != nil {
		t.Fatal(err)
	}
	out := mustRun(t, "apply", rel1, "--bus", addr)
	if !strings.Contains(out, "generation 1 (channel stable) is current") {
		t.Fatalf("apply: %q", out)
	}
	for ev := range events {
		if ev.Kind == bus.SignalReleaseApplied {
			if ev.Data["generation"] != "1" || !strings.Contains(ev.Data["by"], fmt.Sprintf("(uid %d)", daemontest.CallerUID())) {
				t.Errorf("ReleaseApplied = %+v", ev)
			}
			break
		}
	}
	// -v through caged: the phases caged reported to this caller, timed.
	out = mustRun(t, "apply", rel2, "-v", "--bus", addr)
	for _, phase := range []string{"verify", "unpack", "switch"} {
		if !regexp.MustCompile(`(?m)^  ` + phase + ` +[0-9.]+[µm]?s$`).MatchString(out) {
			t.Errorf("apply -v through caged lacks the %s phase:\n%s", phase, out)
		}
	}
	st, err := cl.Status(ctx)
	if err != nil || st.Generation != 2 || st.Channel != "stable" {
		t.Fatalf("status after apply: %+v %v", st, err)
	}
	// The header names the generation in use.
	if out := mustRun(t, "status", "--bus", addr); !strings.Contains(out, "store generation 2 (stable)") {
		t.Errorf("status table:\n%s", out)
	}
	gens, err := cl.Generations(ctx)
	if err != nil || len(gens) != 2 || !gens[1].Current {
		t.Fatalf("generations = %+v %v", gens, err)
	}

	// Older generation again: refused (anti-rollback), nothing changes.
	_, errOut, code := cagectl(t, "apply", rel1, "--bus", addr)
	if code != ExitFailure || errOut == "" {
		t.Errorf("re-applying generation 1: exit %d %q", code, errOut)
	}
	if st, _ := cl.Status(ctx); st.Generation != 2 {
		t.Errorf("refused apply changed the generation to %d", st.Generation)
	}
	if out := mustRun(t, "rollback", "--bus", addr); !strings.Contains(out, "from generation 2 to 1") {
		t.Errorf("rollback: %q", out)
	}
	if st, _ := cl.Status(ctx); st.Generation != 1 {
		t.Errorf("generation after rollback: %d", st.Generation)
	}
}

// A bus without caged on it: every verb exits 4 at once, events included
// (a bare subscription would wait for ever).
func TestNoCagedOnTheBus(t *testing.T) {
	b := bustest.Start(t, bustest.Options{})
	for _, args := range [][]string{{"events"}, {"status"}, {"audit", "alpha"}, {"secret", "rotate", "alpha"}, {"apply-config", "../../examples/quickstart.hcl"}} {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		var out, errb strings.Builder
		code := Main(ctx, append(args, "--bus", b.Address), Stdio{In: strings.NewReader(""), Out: &out, Err: &errb})
		cancel()
		if code != ExitNoConn || !strings.Contains(errb.String(), "caged is not running") {
			t.Errorf("%v with caged down: exit %d (want %d) %s", args, code, ExitNoConn, errb.String())
		}
	}
}
