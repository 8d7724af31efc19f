package daemon_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/daemon/daemontest"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/quarantine"
	"github.com/nixcage/nixcage/internal/release"
	"github.com/nixcage/nixcage/internal/release/releasetest"
	"github.com/nixcage/nixcage/internal/testenv"
)

const twoAgents = `
agent "alpha" {
  backend = "service"
  command = ["/bin/sleep", "infinity"]
}
agent "beta" {
  backend   = "service"
  command   = ["/bin/sleep", "infinity"]
  autostart = false
}
`

func unit(a string) string { return paths.Instance(paths.AgentTemplate, a) }

func TestStartupReconcilesAndReportsStatus(t *testing.T) {
	c := daemontest.Start(t, twoAgents)
	if a, _ := c.SD.State(unit("alpha")); a != "active" {
		t.Fatalf("autostart agent is %s after caged started", a)
	}
	if _, err := os.Stat(c.Path("/run/systemd/system/" + unit("beta"))); err != nil {
		t.Fatalf("units not rendered into /run: %v", err)
	}
	st, err := c.Client().Status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode != "render" || len(st.Agents) != 2 || st.ReconcileError != "" {
		t.Fatalf("status = %+v", st)
	}
	a, b := st.Agents[0], st.Agents[1]
	if a.Name != "alpha" || a.ActiveState != "active" || a.LoadState != "loaded" || !a.Autostart {
		t.Errorf("alpha = %+v", a)
	}
	if b.Name != "beta" || b.ActiveState != "inactive" || b.Autostart {
		t.Errorf("beta = %+v", b)
	}
}

func TestLifecycleKillAndEvents(t *testing.T) {
	c := daemontest.Start(t, twoAgents)
	cl := c.Client()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	events, err := cl.Events(ctx)
	if err != nil {
		t.Fatal(err)
	}
	c.SD.Reset()
	if err := cl.Start(ctx, "beta"); err != nil {
		t.Fatal(err)
	}
	waitEvent(t, events, func(e bus.Event) bool {
		return e.Kind == bus.SignalAgentStateChanged && e.Agent == "beta" && e.Data["active_state"] == "active"
	})
	if err := cl.Kill(ctx, "beta"); err != nil {
		t.Fatal(err)
	}
	waitEvent(t, events, func(e bus.Event) bool {
		return e.Kind == bus.SignalAgentKilled && e.Agent == "beta" && e.Data["by"] != ""
	})
	if err := cl.Restart(ctx, "beta"); err != nil {
		t.Fatal(err)
	}
	if err := cl.Stop(ctx, "beta"); err != nil {
		t.Fatal(err)
	}
	want := []string{
		"ResetFailedUnit " + unit("beta"), "StartUnit " + unit("beta"),
		"KillUnit " + unit("beta") + " all 9",
		// A restart is the whole cage's: the prepare step re-runs (a rotated
		// secret is picked up), then the agent is started.
		"ResetFailedUnit " + paths.Instance(paths.PrepTemplate, "beta"),
		"ResetFailedUnit " + paths.Instance(paths.ProxySocketTpl, "beta"), "ResetFailedUnit " + paths.Instance(paths.DNSSocketTpl, "beta"),
		"ResetFailedUnit " + paths.Instance(paths.EgressTemplate, "beta"),
		"ResetFailedUnit " + unit("beta"), "RestartUnit " + paths.Instance(paths.PrepTemplate, "beta"), "StartUnit " + unit("beta"),
		"StopUnit " + unit("beta"),
	}
	if got := c.SD.Calls(); !slices.Equal(got, want) {
		t.Errorf("systemd calls:\n got %q\nwant %q", got, want)
	}
	if err := cl.Start(ctx, "nope"); !errors.Is(err, bus.ErrNoSuchAgent) {
		t.Errorf("start unknown agent: %v", err)
	}

	// Egress decisions from the gateway's audit log become counters and
	// signals (blocked and flagged only).
	auditFile := c.Path(filepath.Join(paths.AuditDir("alpha"), "audit.jsonl"))
	os.MkdirAll(filepath.Dir(auditFile), 0o755)
	recs := `{"schema":1,"agent":"alpha","host":"api.example.com","decision":"allowed"}
{"schema":1,"agent":"alpha","host":"evil.example","decision":"blocked","reason":"host not allowed"}
{"schema":1,"agent":"alpha","host":"api.example.com","decision":"flagged","reason":"high entropy body"}
`
	if err := os.WriteFile(auditFile, []byte(recs), 0o644); err != nil {
		t.Fatal(err)
	}
	e := waitEvent(t, events, func(e bus.Event) bool { return e.Kind == bus.SignalEgressDecision })
	if e.Agent != "alpha" || e.Data["decision"] != "blocked" || e.Data["host"] != "evil.example" || e.Data["reason"] != "host not allowed" {
		t.Errorf("first egress event = %+v", e)
	}
	e = waitEvent(t, events, func(e bus.Event) bool { return e.Kind == bus.SignalEgressDecision })
	if e.Data["decision"] != "flagged" {
		t.Errorf("second egress event = %+v", e)
	}
	st, err := cl.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if a := st.Agents[0]; a.Allowed != 1 || a.Blocked != 1 || a.Flagged != 1 {
		t.Errorf("counters = %d/%d/%d, want 1/1/1", a.Allowed, a.Flagged, a.Blocked)
	}
	lines, next, err := cl.ReadAudit(ctx, "alpha", 0, 2)
	if err != nil || len(lines) != 2 || !strings.Contains(lines[1], "evil.example") {
		t.Fatalf("ReadAudit = %q %v", lines, err)
	}
	lines, _, err = cl.ReadAudit(ctx, "alpha", next, 100)
	if err != nil || len(lines) != 1 || !strings.Contains(lines[0], "flagged") {
		t.Fatalf("ReadAudit from %d = %q %v", next, lines, err)
	}
	lines, _, err = cl.ReadAudit(ctx, "alpha", -1, 1)
	if err != nil || len(lines) != 1 || !strings.Contains(lines[0], "flagged") {
		t.Fatalf("ReadAudit tail = %q %v", lines, err)
	}
}

func waitEvent(t *testing.T, events <-chan bus.Event, match func(bus.Event) bool) bus.Event {
	t.Helper()
	for {
		select {
		case e, ok := <-events:
			if !ok {
				t.Fatal("event stream ended")
			}
			if match(e) {
				return e
			}
		case <-time.After(20 * time.Second):
			t.Fatal("expected event did not arrive")
		}
	}
}

func TestQuarantineSurvivesRestartUntilReleased(t *testing.T) {
	c := daemontest.Start(t, twoAgents)
	cl := c.Client()
	ctx := context.Background()
	ws := c.Path(paths.DefaultWorkspace("alpha"))
	os.MkdirAll(ws, 0o755)
	os.WriteFile(filepath.Join(ws, "loot.txt"), []byte("secrets\n"), 0o644)

	ev, err := cl.Quarantine(ctx, "alpha", "tried to exfiltrate")
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(testenv.LookPath(t, "sha256sum"), "--strict", "-c", quarantine.ManifestName)
	cmd.Dir = ev
	if out, err := cmd.CombinedOutput(); err != nil || !strings.Contains(string(out), "workspace/loot.txt: OK") {
		t.Fatalf("sha256sum -c in %s: %v\n%s", ev, err, out)
	}
	if a, _ := c.SD.State(unit("alpha")); a != "inactive" {
		t.Fatalf("quarantined agent is %s", a)
	}
	st, _ := cl.Status(ctx)
	if !st.Agents[0].Quarantined || st.Agents[0].QuarantineReason != "tried to exfiltrate" {
		t.Errorf("status = %+v", st.Agents[0])
	}
	if _, err := cl.Quarantine(ctx, "alpha", "again"); err == nil {
		t.Error("second quarantine accepted")
	}

	// caged restarts (crash, upgrade, reboot): the autostart agent stays
	// down, and an explicit start is refused with the reason.
	c.Restart()
	cl = c.Client()
	if a, _ := c.SD.State(unit("alpha")); a != "inactive" {
		t.Fatalf("quarantined agent is %s after caged restarted", a)
	}
	err = cl.Start(ctx, "alpha")
	var re *bus.RemoteError
	if !errors.As(err, &re) || re.Name != bus.ErrorQuarantined || !strings.Contains(err.Error(), "cagectl release alpha") {
		t.Fatalf("start of a quarantined agent: %v", err)
	}
	// Even bypassing caged, systemd's condition keeps it down.
	c.SD.Reset()
	if err := cl.Restart(ctx, "alpha"); err == nil {
		t.Fatal("restart of a quarantined agent accepted")
	}

	if err := cl.Release(ctx, "alpha"); err != nil {
		t.Fatal(err)
	}
	if err := cl.Release(ctx, "alpha"); err == nil {
		t.Error("second release accepted")
	}
	if err := cl.Start(ctx, "alpha"); err != nil {
		t.Fatal(err)
	}
	if a, _ := c.SD.State(unit("alpha")); a != "active" {
		t.Fatalf("released agent is %s after start", a)
	}
}

func TestReloadAppliesNewConfigAndRefusesBadOnes(t *testing.T) {
	c := daemontest.Start(t, twoAgents)
	cl := c.Client()
	ctx := context.Background()
	c.WriteConfig(`agent "beta" {
  backend = "service"
  command = ["/bin/sleep", "1"]
}`)
	c.SD.Reset()
	if err := cl.Reload(ctx); err != nil {
		t.Fatal(err)
	}
	calls := c.SD.Calls()
	if !slices.Contains(calls, "StopUnit "+unit("alpha")) || !slices.Contains(calls, "Reload") || !slices.Contains(calls, "StartUnit "+unit("beta")) {
		t.Errorf("calls after reload: %q", calls)
	}
	st, _ := cl.Status(ctx)
	if len(st.Agents) != 1 || st.Agents[0].Name != "beta" {
		t.Errorf("agents after reload: %+v", st.Agents)
	}
	conn := c.Bus.Conn(t)
	if _, err := conn.Object(bus.Name, bus.AgentPath("alpha")).GetProperty(bus.AgentIface + ".Name"); err == nil {
		t.Error("removed agent keeps its bus object")
	}

	c.WriteConfig(`agent "Bad Name" {}`)
	err := cl.Reload(ctx)
	if err == nil || !strings.Contains(err.Error(), "running configuration is unchanged") {
		t.Fatalf("bad reload: %v", err)
	}
	if st, _ := cl.Status(ctx); len(st.Agents) != 1 {
		t.Errorf("bad config changed the agents: %+v", st.Agents)
	}
}

func TestApplyWithoutStoreIsAClearError(t *testing.T) {
	c := daemontest.Start(t, twoAgents)
	_, err := c.Client().Apply(context.Background(), "/nonexistent")
	if err == nil || !strings.Contains(err.Error(), "declare store") {
		t.Fatalf("apply without a store block: %v", err)
	}
}

// A quarantine never waits behind another agent's evidence copy: while
// alpha's copy is held back, beta's quarantine stops beta and cuts its
// egress, and returns. The order is asserted from the daemon's own
// events and the fake systemd's unit states, not from timing.
func TestQuarantinesDoNotWaitForEachOthersEvidence(t *testing.T) {
	c := daemontest.Start(t, twoAgents)
	cl := c.Client()
	ctx := context.Background()
	if err := cl.Start(ctx, "beta"); err != nil {
		t.Fatal(err)
	}
	var (
		mu     sync.Mutex
		events []string
	)
	note := func(s string) {
		mu.Lock()
		events = append(events, s)
		mu.Unlock()
	}
	alphaContained, betaContained := make(chan struct{}), make(chan struct{})
	c.Contained = func(agent string) {
		a, _ := c.SD.State(unit(agent))
		e, _ := c.SD.State(paths.Instance(paths.EgressTemplate, agent))
		p, _ := c.SD.State(paths.Instance(paths.ProxySocketTpl, agent))
		note(fmt.Sprintf("%s contained: agent %s, gateway %s, proxy socket %s", agent, a, e, p))
		switch agent {
		case "alpha":
			close(alphaContained)
			// Hold alpha's copy until beta is contained. Before the fix
			// beta's quarantine waited on caged's operation lock, held
			// across this copy, and this gives up.
			select {
			case <-betaContained:
				note("alpha copies its evidence")
			case <-time.After(30 * time.Second):
				note("alpha gave up: beta was not contained while alpha's copy was pending")
			}
		case "beta":
			close(betaContained)
		}
	}
	alphaErr := make(chan error, 1)
	go func() {
		_, err := cl.Quarantine(ctx, "alpha", "first")
		alphaErr <- err
	}()
	<-alphaContained
	if _, err := c.Client().Quarantine(ctx, "beta", "second"); err != nil {
		t.Fatal(err)
	}
	if err := <-alphaErr; err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	want := []string{
		"alpha contained: agent inactive, gateway inactive, proxy socket inactive",
		"beta contained: agent inactive, gateway inactive, proxy socket inactive",
		"alpha copies its evidence",
	}
	if !slices.Equal(events, want) {
		t.Errorf("events:\n got %q\nwant %q", events, want)
	}
}

// An events stream survives a caged restart: it follows the new owner of
// the name (addressed signals are checked against it) and subscribes again,
// so the new caged's audit signals still reach it.
func TestEventsFollowACagedRestart(t *testing.T) {
	c := daemontest.Start(t, twoAgents)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	events, err := c.Client().Events(ctx)
	if err != nil {
		t.Fatal(err)
	}
	c.Restart()
	cl := c.Client()
	// The stream subscribes again when it sees the new owner; until caged
	// has that, a kill's signal is not addressed to it. Kill until one is.
	for {
		if err := cl.Start(ctx, "beta"); err != nil {
			t.Fatal(err)
		}
		if err := cl.Kill(ctx, "beta"); err != nil {
			t.Fatal(err)
		}
		select {
		case e, ok := <-events:
			if !ok {
				t.Fatal("the events stream ended when caged restarted")
			}
			if e.Kind == bus.SignalAgentKilled && e.Agent == "beta" {
				return
			}
		case <-ctx.Done():
			t.Fatal("no audit signal from the restarted caged reached the stream")
		}
	}
}

// The config's evidence block bounds the copy caged makes.
func TestEvidenceLimitsComeFromTheConfig(t *testing.T) {
	c := daemontest.Start(t, twoAgents+`
evidence {
  max_entries = 3
}
`)
	ws := c.Path(paths.DefaultWorkspace("alpha"))
	os.MkdirAll(ws, 0o755)
	for i := 0; i < 10; i++ {
		os.WriteFile(filepath.Join(ws, fmt.Sprintf("f%d", i)), []byte("x"), 0o644)
	}
	ev, err := c.Client().Quarantine(context.Background(), "alpha", "limits")
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(ev, quarantine.SummaryName))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), `"stopped": "entry cap of 3 reached"`) || !strings.Contains(string(b), `"max_entries": 3`) {
		t.Errorf("evidence.json:\n%s", b)
	}
}

// A store disk that fills up under caged: the apply is reported over the
// bus as an I/O failure (bus.ErrIO, cagectl's exit 5), not as a refusal; no
// ReleaseApplied signal, status still names generation 1. With space back
// the same release applies, is signalled and shows in status, as
// "expiring" since it expires within the default window.
func TestApplyOnFullStoreDiskThroughCaged(t *testing.T) {
	releasetest.RequireNix(t)
	testenv.RequirePrivileged(t)
	c := daemontest.Start(t, twoAgents)
	mustWrite := func(p string, b []byte) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	priv, pub, err := release.GenerateKey(release.AlgEd25519)
	if err != nil {
		t.Fatal(err)
	}
	mustWrite(c.Path("/etc/nixcage/release.pub"), pub)
	key, err := release.ParsePrivateKey(priv)
	if err != nil {
		t.Fatal(err)
	}
	store := c.Path("/var/lib/nixcage")
	if err := os.MkdirAll(store, 0o755); err != nil {
		t.Fatal(err)
	}
	releasetest.SmallFSAt(t, store, 16<<20, 2048)
	rels := t.TempDir()
	// Generation 2 expires in 3 days: inside the default 7-day window.
	expires := map[uint64]time.Time{1: releasetest.Expires(), 2: time.Now().Add(72 * time.Hour)}
	for gen, size := range map[uint64]int{1: 64 << 10, 2: 2 << 20} {
		top := releasetest.Closure(t, fmt.Sprintf("caged-full-%d", gen), size)
		if _, err := release.Create(context.Background(), release.CreateOptions{StorePath: top, Keys: []*release.PrivateKey{key},
			Channel: "stable", Generation: gen, Expires: expires[gen], Out: filepath.Join(rels, fmt.Sprint(gen)), Compression: "none"}); err != nil {
			t.Fatal(err)
		}
	}
	c.WriteConfig(twoAgents + `
store {
  channel = "stable"
  keys    = ["/etc/nixcage/release.pub"]
}
`)
	cl := c.Client()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := cl.Reload(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Apply(ctx, filepath.Join(rels, "1")); err != nil {
		t.Fatal(err)
	}
	events, err := cl.Events(ctx)
	if err != nil {
		t.Fatal(err)
	}
	free := releasetest.Fill(t, store, 256<<10, 1000)
	_, err = cl.Apply(ctx, filepath.Join(rels, "2"))
	if !errors.Is(err, bus.ErrIO) || strings.Contains(err.Error(), "release refused") || !strings.Contains(err.Error(), "no space left") {
		t.Fatalf("apply on a full store disk: %v, want a bus.ErrIO naming the cause", err)
	}
	if st, _ := cl.Status(ctx); st.Generation != 1 || st.Freshness != "ok" {
		t.Fatalf("status after the failed apply: generation %d freshness %q", st.Generation, st.Freshness)
	}
	free()
	res, err := cl.Apply(ctx, filepath.Join(rels, "2"))
	if err != nil || res.Generation != 2 {
		t.Fatalf("apply once space is back: %+v %v", res, err)
	}
	e := waitEvent(t, events, func(e bus.Event) bool { return e.Kind == bus.SignalReleaseApplied })
	if e.Data["generation"] != "2" || e.Data["previous"] != "1" {
		t.Fatalf("the first ReleaseApplied signal is %+v, want generation 2 from 1 (none for the failed apply)", e)
	}
	st, err := cl.Status(ctx)
	if err != nil || st.Generation != 2 || st.GenerationExpiresUnix != expires[2].Unix() || st.Freshness != "expiring" || !strings.Contains(st.FreshnessMessage, "publish and apply a fresh one") {
		t.Fatalf("status after applying a release that expires in 3 days: %+v %v", st, err)
	}
	mgr := c.Bus.Conn(t).Object(bus.Name, bus.Path)
	for prop, want := range map[string]any{"Freshness": "expiring", "GenerationExpires": expires[2].Unix(), "Generation": uint64(2)} {
		v, err := mgr.GetProperty(bus.ManagerIface + "." + prop)
		if err != nil || v.Value() != want {
			t.Errorf("Manager property %s = %v (%v), want %v", prop, v.Value(), err, want)
		}
	}
}
