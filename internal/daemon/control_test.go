package daemon_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/control"
	"github.com/nixcage/nixcage/internal/daemon"
	"github.com/nixcage/nixcage/internal/daemon/daemontest"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/policy"
	"github.com/nixcage/nixcage/internal/quarantine"
	"github.com/nixcage/nixcage/internal/release"
	"github.com/nixcage/nixcage/internal/release/releasetest"
)

type signer struct {
	t    *testing.T
	keys map[string]*release.PrivateKey
	pubs map[string]string // public key files
}

func newSigner(t *testing.T, names ...string) *signer {
	s := &signer{t: t, keys: map[string]*release.PrivateKey{}, pubs: map[string]string{}}
	for _, n := range names {
		s.keys[n], _, s.pubs[n] = releasetest.Key(t, release.AlgEd25519)
	}
	return s
}

// writePub installs key name's public half at path.
func (s *signer) writePub(path, name string) {
	pem, err := os.ReadFile(s.pubs[name])
	if err != nil {
		s.t.Fatal(err)
	}
	os.MkdirAll(filepath.Dir(path), 0o755)
	if err := os.WriteFile(path, pem, 0o644); err != nil {
		s.t.Fatal(err)
	}
}

// command is what an issuer (honest or not) would write: mut changes the
// command before it is signed by the named keys.
func (s *signer) command(action, agent string, mut func(*control.Command), by ...string) []byte {
	s.t.Helper()
	nonce, _ := control.NewNonce()
	now := time.Now().UTC().Truncate(time.Second)
	c := &control.Command{Schema: control.Schema, Action: action, Host: "web-01", Agent: agent, Issued: now, Expires: now.Add(time.Hour), Nonce: nonce, Reason: "seen exfiltrating"}
	if mut != nil {
		mut(c)
	}
	var keys []*release.PrivateKey
	for _, n := range by {
		keys = append(keys, s.keys[n])
	}
	sg, err := control.Sign(c, keys)
	if err != nil {
		s.t.Fatal(err)
	}
	b, err := sg.Marshal()
	if err != nil {
		s.t.Fatal(err)
	}
	return b
}

// ackServer is a real HTTP server taking acks by PUT, as an S3-style
// bucket or a WebDAV directory would.
type ackServer struct {
	*httptest.Server
	mu  sync.Mutex
	got map[string]control.Ack
}

func newAckServer(t *testing.T) *ackServer {
	a := &ackServer{got: map[string]control.Ack{}}
	a.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPut || !strings.HasPrefix(r.URL.Path, "/acks/") {
			http.Error(w, "no", http.StatusMethodNotAllowed)
			return
		}
		b, _ := io.ReadAll(r.Body)
		var ack control.Ack
		if err := json.Unmarshal(b, &ack); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		a.mu.Lock()
		a.got[strings.TrimPrefix(r.URL.Path, "/acks/")] = ack
		a.mu.Unlock()
		w.WriteHeader(http.StatusCreated)
	}))
	t.Cleanup(a.Close)
	return a
}

func (a *ackServer) wait(t *testing.T, path string) control.Ack {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		a.mu.Lock()
		ack, ok := a.got[path]
		a.mu.Unlock()
		if ok {
			return ack
		}
		if time.Now().After(deadline) {
			t.Fatalf("no ack uploaded at %s; got %v", path, a.got)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func controlConfig(ackURL string) string {
	ack := ""
	if ackURL != "" {
		ack = fmt.Sprintf("  ack_url   = %q\n", ackURL)
	}
	return twoAgents + `
control {
  host_id   = "web-01"
  keys      = ["/etc/nixcage/control/ops.pub", "/etc/nixcage/control/sec.pub"]
  threshold = 2
` + ack + "}\n"
}

// TestControlCommandsThroughCaged runs caged with a control block and
// hands it commands over the bus as a malicious publisher would craft
// them: every bad one is refused with its reason, acked, and changes
// nothing (no unit call, no quarantine, no ban); the good quarantine runs
// once, its replay is a duplicate before and after a caged restart; a ban
// reaches the bans file and the status, an unban lifts it; acks are in
// the ack file, the bus listing and on the upload server.
func TestControlCommandsThroughCaged(t *testing.T) {
	acks := newAckServer(t)
	s := newSigner(t, "ops", "sec", "stranger", "release")
	c := daemontest.Start(t, twoAgents)
	s.writePub(c.Path("/etc/nixcage/control/ops.pub"), "ops")
	s.writePub(c.Path("/etc/nixcage/control/sec.pub"), "sec")
	c.WriteConfig(controlConfig(acks.URL + "/acks/"))
	c.Restart()
	cl := c.Client()
	ctx := context.Background()

	nothingHappened := func(t *testing.T, what string) {
		t.Helper()
		for _, call := range c.SD.Calls() {
			if strings.Contains(call, "KillUnit") || strings.Contains(call, "FreezeUnit") || strings.Contains(call, "StopUnit "+unit("alpha")) {
				t.Errorf("%s: systemd was called: %s", what, call)
			}
		}
		if quarantine.Quarantined(quarantine.Dirs{Root: c.Root}, "alpha") {
			t.Errorf("%s: alpha was quarantined", what)
		}
		if _, err := os.Stat(c.Path(paths.BansFile)); err == nil {
			t.Errorf("%s: a bans file was written", what)
		}
	}

	// Signed by a release key only: a release key is not a control key.
	forged := s.command(control.ActionQuarantine, "alpha", nil, "ops", "release")
	// A valid signature pair over different bytes: the attacker edits
	// the target of a genuine command for beta and keeps its signatures.
	genuine := s.command(control.ActionKill, "beta", nil, "ops", "sec")
	var env control.Signed
	json.Unmarshal(genuine, &env)
	var edited control.Command
	json.Unmarshal(env.Command, &edited)
	edited.Action, edited.Agent = control.ActionQuarantine, "alpha"
	env.Command = edited.Canonical()
	transplanted, _ := json.Marshal(env)

	c.SD.Reset()
	bad := []struct {
		name, status, reason string
		raw                  []byte
	}{
		{"wrong key", control.StatusRejected, "not in control.keys", s.command(control.ActionQuarantine, "alpha", nil, "stranger", "ops")},
		{"release key", control.StatusRejected, "threshold is 2", forged},
		{"below threshold", control.StatusRejected, "1 valid signature(s) from control keys, threshold is 2", s.command(control.ActionKill, "alpha", nil, "ops")},
		{"signature over other bytes", control.StatusRejected, "does not match the command", transplanted},
		{"expired", control.StatusExpired, "expired at", s.command(control.ActionKill, "alpha", func(c *control.Command) {
			c.Issued, c.Expires = c.Issued.Add(-3*time.Hour), c.Issued.Add(-2*time.Hour)
		}, "ops", "sec")},
		{"not yet valid", control.StatusRejected, "not yet valid", s.command(control.ActionKill, "alpha", func(c *control.Command) {
			c.Issued, c.Expires = c.Issued.Add(time.Hour), c.Issued.Add(2*time.Hour)
		}, "ops", "sec")},
		{"expires too far ahead", control.StatusRejected, "more than the 24h0m0s allowed", s.command(control.ActionKill, "alpha", func(c *control.Command) {
			c.Expires = c.Issued.Add(30 * 24 * time.Hour)
		}, "ops", "sec")},
		{"wrong host", control.StatusRejected, "wrong host", s.command(control.ActionKill, "alpha", func(c *control.Command) { c.Host = "db-02" }, "ops", "sec")},
		{"unknown action", control.StatusRejected, "unknown action", s.command("rm-rf", "alpha", nil, "ops", "sec")},
		{"unknown agent", control.StatusRejected, `unknown agent "mallory"`, s.command(control.ActionQuarantine, "mallory", nil, "ops", "sec")},
		{"malformed JSON", control.StatusRejected, "malformed", []byte(`{"schema": 1, "command": {"action": "kill"`)},
		{"ban of an address", control.StatusRejected, "not a host name", s.command(control.ActionBanHost, control.All, func(c *control.Command) { c.Ban = "169.254.169.254" }, "ops", "sec")},
	}
	for _, b := range bad {
		ack, err := cl.ApplyControl(ctx, b.raw)
		if err != nil {
			t.Fatalf("%s: %v", b.name, err)
		}
		if ack.Status != b.status || !strings.Contains(ack.Reason, b.reason) || ack.Host != "web-01" || ack.SHA256 == "" {
			t.Errorf("%s: ack %+v, want %s with %q", b.name, ack, b.status, b.reason)
		}
		nothingHappened(t, b.name)
	}

	// The genuine quarantine: executed once.
	q := s.command(control.ActionQuarantine, "alpha", nil, "ops", "sec")
	ack, err := cl.ApplyControl(ctx, q)
	if err != nil || ack.Status != control.StatusExecuted || !strings.Contains(ack.Reason, "alpha: quarantined") {
		t.Fatalf("quarantine: %+v %v", ack, err)
	}
	mark, err := quarantine.Read(quarantine.Dirs{Root: c.Root}, "alpha")
	if err != nil || mark.Reason != "seen exfiltrating" || !strings.Contains(mark.By, "control command "+ack.SHA256[:16]) {
		t.Fatalf("quarantine mark %+v %v", mark, err)
	}
	st, _ := cl.Status(ctx)
	if !st.Agents[0].Quarantined || st.Agents[1].Quarantined {
		t.Fatalf("status after the command: %+v", st.Agents)
	}
	up := acks.wait(t, "web-01/"+ack.SHA256+"/executed.json")
	if up.Status != control.StatusExecuted || up.Action != control.ActionQuarantine {
		t.Errorf("uploaded ack %+v", up)
	}
	evidence := func() int {
		es, _ := os.ReadDir(c.Path(paths.EvidenceRoot))
		return len(es)
	}
	if n := evidence(); n != 1 {
		t.Fatalf("%d evidence directories", n)
	}

	replay := func(when string) {
		t.Helper()
		a, err := cl.ApplyControl(ctx, q)
		if err != nil || a.Status != control.StatusDuplicate || !strings.Contains(a.Reason, "already executed") {
			t.Fatalf("replay %s: %+v %v", when, a, err)
		}
		if n := evidence(); n != 1 {
			t.Fatalf("replay %s ran again: %d evidence directories", when, n)
		}
		if m, _ := quarantine.Read(quarantine.Dirs{Root: c.Root}, "alpha"); !m.At.Equal(mark.At) {
			t.Fatalf("replay %s rewrote the mark", when)
		}
	}
	replay("at once")
	// The operator releases alpha; a replay must not quarantine it again,
	// also after caged restarted (the cache is on disk).
	if err := cl.Release(ctx, "alpha"); err != nil {
		t.Fatal(err)
	}
	c.Restart()
	cl = c.Client()
	a, err := cl.ApplyControl(ctx, q)
	if err != nil || a.Status != control.StatusDuplicate {
		t.Fatalf("replay after restart: %+v %v", a, err)
	}
	if quarantine.Quarantined(quarantine.Dirs{Root: c.Root}, "alpha") {
		t.Fatal("the replay after a caged restart quarantined alpha again")
	}
	acks.wait(t, "web-01/"+ack.SHA256+"/duplicate.json")

	// Ban and unban, visible in the status and the bans file the
	// gateways watch.
	ban := s.command(control.ActionBanHost, control.All, func(c *control.Command) { c.Host, c.Ban = control.All, "evil.example.com" }, "ops", "sec")
	ba, err := cl.ApplyControl(ctx, ban)
	if err != nil || ba.Status != control.StatusExecuted {
		t.Fatalf("ban: %+v %v", ba, err)
	}
	doc, err := policy.LoadBans(c.Path(paths.BansFile))
	if os.Geteuid() != 0 {
		b, _ := os.ReadFile(c.Path(paths.BansFile))
		doc, err = policy.ParseBans(b)
	}
	if err != nil || len(doc.Bans) != 1 || doc.Bans[0].Host != "evil.example.com" || doc.Bans[0].Agent != "*" || doc.Bans[0].ID != control.BanID(ba.SHA256) {
		t.Fatalf("bans file %+v %v", doc, err)
	}
	if st, _ := os.Stat(c.Path(paths.BansFile)); st.Mode().Perm() != 0o644 {
		t.Errorf("bans file mode %v: every gateway must read it", st.Mode())
	}
	st, _ = cl.Status(ctx)
	if len(st.Bans) != 1 || st.Bans[0].Host != "evil.example.com" {
		t.Errorf("status bans %+v", st.Bans)
	}
	unban := s.command(control.ActionUnbanHost, control.All, func(c *control.Command) { c.Ban = "evil.example.com" }, "ops", "sec")
	if ua, err := cl.ApplyControl(ctx, unban); err != nil || ua.Status != control.StatusExecuted || !strings.Contains(ua.Reason, "1 ban(s) removed") {
		t.Fatalf("unban: %+v %v", ua, err)
	}
	if st, _ = cl.Status(ctx); len(st.Bans) != 0 {
		t.Errorf("status bans after unban %+v", st.Bans)
	}

	// Every attempt is in the ack listing, in order.
	list, err := cl.ControlAcks(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	var statuses []string
	for _, a := range list {
		statuses = append(statuses, a.Status)
	}
	want := len(bad) + 1 + 2 + 2
	if len(list) != want || list[len(bad)].Status != control.StatusExecuted || slices.Index(statuses, control.StatusDuplicate) != len(bad)+1 {
		t.Errorf("acks %v, want %d", statuses, want)
	}
	if st, err := os.Stat(c.Path(filepath.Join(paths.ControlDir, "replay.json"))); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("replay cache: %v %v", st, err)
	}
}

// channelServer is a real HTTP server serving a channel's index and its
// control feed (docs/fleet.md "Layout"); it counts feed reads.
type channelServer struct {
	*httptest.Server
	mu    sync.Mutex
	files map[string][]byte
	polls int
}

func newChannelServer(t *testing.T, cmds map[string][]byte) *channelServer {
	cs := &channelServer{files: map[string][]byte{
		"/channel.json": []byte(`{"schema": 1, "channel": "stable", "generation": 1, "release": "releases/1"}`),
	}}
	var names []string
	for n, b := range cmds {
		cs.files["/controls/"+n] = b
		names = append(names, n)
	}
	slices.Sort(names)
	idx, _ := json.Marshal(map[string]any{"schema": 1, "commands": names})
	cs.files["/controls/index.json"] = idx
	cs.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		cs.mu.Lock()
		defer cs.mu.Unlock()
		if r.URL.Path == "/controls/index.json" {
			cs.polls++
		}
		b, ok := cs.files[r.URL.Path]
		if !ok {
			http.NotFound(w, r)
			return
		}
		w.Write(b)
	}))
	t.Cleanup(cs.Close)
	return cs
}

func (cs *channelServer) waitPolls(t *testing.T, n int) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		cs.mu.Lock()
		p := cs.polls
		cs.mu.Unlock()
		if p >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the channel's feed was read %d times, want %d", p, n)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// pollingCaged starts caged with the control keys ops and sec (threshold
// 2) polling cs every second.
func pollingCaged(t *testing.T, s *signer, cs *channelServer) *daemontest.Caged {
	c := daemontest.Start(t, twoAgents)
	s.writePub(c.Path("/etc/nixcage/control/ops.pub"), "ops")
	s.writePub(c.Path("/etc/nixcage/control/sec.pub"), "sec")
	s.writePub(c.Path("/etc/nixcage/release.pub"), "release")
	c.WriteConfig(controlConfig("") + fmt.Sprintf(`
store {
  channel = "stable"
  keys    = ["/etc/nixcage/release.pub"]
}
channel {
  url      = %q
  interval = "1s"
}
`, cs.URL+"/"))
	c.Restart()
	return c
}

// TestControlFeedFromChannel: caged polling a channel on a real HTTP
// server runs the feed's commands through the same checks: the genuine
// quarantine runs once (and is not acked again on later polls nor after a
// caged restart: it is in the replay cache), a forged one is refused and
// acked once per caged run, and a command for another host is skipped
// without an ack.
func TestControlFeedFromChannel(t *testing.T) {
	s := newSigner(t, "ops", "sec", "stranger", "release")
	cs := newChannelServer(t, map[string][]byte{
		"q-alpha.json":    s.command(control.ActionQuarantine, "alpha", nil, "ops", "sec"),
		"forged.json":     s.command(control.ActionKill, "beta", nil, "stranger", "ops"),
		"other-host.json": s.command(control.ActionKill, "alpha", func(c *control.Command) { c.Host = "db-02" }, "ops", "sec"),
	})
	c := pollingCaged(t, s, cs)
	cl := c.Client()
	ctx := context.Background()
	cs.waitPolls(t, 3)
	count := func() map[string]int {
		list, err := cl.ControlAcks(ctx, 0)
		if err != nil {
			t.Fatal(err)
		}
		n := map[string]int{}
		for _, a := range list {
			if a.Source != "channel" || !strings.HasPrefix(a.By, "controls/") {
				t.Errorf("ack from the feed: source %q by %q", a.Source, a.By)
			}
			n[a.Status+" "+a.Action+" "+a.Agent]++
		}
		return n
	}
	want := map[string]int{"executed quarantine alpha": 1, "rejected kill beta": 1}
	if got := count(); !maps.Equal(got, want) {
		t.Fatalf("acks after 3 polls: %v, want %v", got, want)
	}
	if !quarantine.Quarantined(quarantine.Dirs{Root: c.Root}, "alpha") {
		t.Fatal("the channel's quarantine did not run")
	}
	for _, call := range c.SD.Calls() {
		if strings.Contains(call, "KillUnit") {
			t.Errorf("a refused or foreign kill reached systemd: %s", call)
		}
	}
	if err := cl.Release(ctx, "alpha"); err != nil {
		t.Fatal(err)
	}
	c.Restart()
	cl = c.Client()
	cs.mu.Lock()
	cs.polls = 0
	cs.mu.Unlock()
	cs.waitPolls(t, 2)
	want["rejected kill beta"] = 2
	if got := count(); !maps.Equal(got, want) {
		t.Fatalf("acks after caged restarted: %v, want %v", got, want)
	}
	if quarantine.Quarantined(quarantine.Dirs{Root: c.Root}, "alpha") {
		t.Fatal("the channel's quarantine ran again after caged restarted")
	}
}

// TestControlPauseResume: pause freezes the agent unit and resume thaws
// it; where systemd cannot freeze (cgroup v1), pause is acked "failed"
// with systemd's reason and the agent is not stopped instead.
func TestControlPauseResume(t *testing.T) {
	s := newSigner(t, "ops", "sec")
	c := daemontest.Start(t, twoAgents)
	s.writePub(c.Path("/etc/nixcage/control/ops.pub"), "ops")
	s.writePub(c.Path("/etc/nixcage/control/sec.pub"), "sec")
	c.WriteConfig(controlConfig(""))
	c.Restart()
	cl := c.Client()
	ctx := context.Background()
	apply := func(action string) *control.Ack {
		t.Helper()
		a, err := cl.ApplyControl(ctx, s.command(action, "alpha", nil, "ops", "sec"))
		if err != nil {
			t.Fatal(err)
		}
		return a
	}
	if a := apply(control.ActionPause); a.Status != control.StatusExecuted {
		t.Fatalf("pause: %+v", a)
	}
	if _, sub := c.SD.State(unit("alpha")); sub != "frozen" {
		t.Fatalf("alpha is %s after pause", sub)
	}
	if a := apply(control.ActionResume); a.Status != control.StatusExecuted {
		t.Fatalf("resume: %+v", a)
	}
	if act, sub := c.SD.State(unit("alpha")); act != "active" || sub == "frozen" {
		t.Fatalf("alpha is %s/%s after resume", act, sub)
	}
	c.SD.NoFreeze = true
	c.SD.Reset()
	if a := apply(control.ActionPause); a.Status != control.StatusFailed || !strings.Contains(a.Reason, "freeze") {
		t.Fatalf("pause without a freezer: %+v", a)
	}
	for _, call := range c.SD.Calls() {
		if strings.Contains(call, "StopUnit") || strings.Contains(call, "KillUnit") {
			t.Errorf("pause without a freezer stopped the agent: %s", call)
		}
	}
	if act, _ := c.SD.State(unit("alpha")); act != "active" {
		t.Errorf("alpha is %s after a failed pause", act)
	}
}

// TestAckUploadRedirectRefused: the ack server is run by whoever runs the
// fleet's controller, and with an http ack_url anyone on the path can
// answer for it. caged uploads as root from the host's network namespace,
// so a 307 must not aim its PUT (body and all) at a service on this
// host's loopback, as the release fetcher refuses the same redirect.
func TestAckUploadRedirectRefused(t *testing.T) {
	var mu sync.Mutex
	var hit []string
	local := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		hit = append(hit, r.Method+" "+r.URL.Path)
		mu.Unlock()
		w.WriteHeader(http.StatusCreated)
	}))
	t.Cleanup(local.Close)
	asked := make(chan string, 16)
	evil := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		asked <- r.URL.Path
		http.Redirect(w, r, local.URL+"/v1/agent/service/register", http.StatusTemporaryRedirect)
	}))
	t.Cleanup(evil.Close)

	s := newSigner(t, "ops", "sec")
	c := daemontest.Start(t, twoAgents)
	s.writePub(c.Path("/etc/nixcage/control/ops.pub"), "ops")
	s.writePub(c.Path("/etc/nixcage/control/sec.pub"), "sec")
	c.WriteConfig(controlConfig(evil.URL + "/acks/"))
	c.Restart()
	ack, err := c.Client().ApplyControl(context.Background(), s.command(control.ActionKill, "alpha", nil, "ops"))
	if err != nil || ack.Status != control.StatusRejected {
		t.Fatalf("ack %+v %v", ack, err)
	}
	select {
	case p := <-asked:
		if !strings.HasSuffix(p, "/"+ack.SHA256+"/rejected.json") {
			t.Errorf("ack PUT at %s", p)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("caged never tried to upload the ack")
	}
	// The redirect, if followed, reaches the local service within
	// milliseconds; give it far longer.
	time.Sleep(2 * time.Second)
	mu.Lock()
	defer mu.Unlock()
	if len(hit) > 0 {
		t.Fatalf("the ack server redirected caged's upload to a loopback service, which got %v", hit)
	}
}

// TestControlFeedTimeOutOfRange: a channel server holding no key serves
// an unsigned command whose times are valid RFC 3339 in the document but
// fall outside the years 0-9999 in UTC (9999-12-31T23:59:59-23:59). The
// canonical bytes cannot be encoded; caged parses feed entries before any
// signature check, so this must be a malformed command, acked rejected,
// and caged keeps running (it used to panic in the poller and exit, on
// every restart again: a keyless channel server stopping the appliance).
func TestControlFeedTimeOutOfRange(t *testing.T) {
	s := newSigner(t, "ops", "sec", "release")
	bomb := []byte(`{"schema":1,"command":{"schema":1,"action":"kill","host":"*","agent":"*",` +
		`"issued":"9999-12-31T23:00:00-23:59","expires":"9999-12-31T23:59:59-23:59",` +
		`"nonce":"00000000000000000000000000000000","reason":"x"},"signatures":[]}`)
	cs := newChannelServer(t, map[string][]byte{"bomb.json": bomb})
	c := pollingCaged(t, s, cs)
	cs.waitPolls(t, 3)
	cl := c.Client()
	ctx := context.Background()
	if _, err := cl.Status(ctx); err != nil {
		t.Fatalf("caged after serving the feed: %v", err)
	}
	list, err := cl.ControlAcks(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 1 || list[0].Status != control.StatusRejected || !strings.Contains(list[0].Reason, "malformed") || list[0].SHA256 != control.HashBytes(bomb) {
		t.Fatalf("acks %+v, want one rejected as malformed", list)
	}
	for _, call := range c.SD.Calls() {
		if strings.Contains(call, "KillUnit") {
			t.Errorf("the unsigned command reached systemd: %s", call)
		}
	}
}

// TestControlFeedFloodBoundsAcks: a channel server holding no key lists
// 40 unsigned commands; one poll acks at most daemon.MaxRefusedFeedAcks of them,
// so the ack log the controller collects is not flooded, and later polls
// ack none of them again. A genuine command in the same feed still runs.
func TestControlFeedFloodBoundsAcks(t *testing.T) {
	s := newSigner(t, "ops", "sec", "stranger", "release")
	feed := map[string][]byte{
		"q-alpha.json": s.command(control.ActionQuarantine, "alpha", nil, "ops", "sec"),
	}
	for i := 0; i < 40; i++ {
		feed[fmt.Sprintf("junk-%02d.json", i)] = s.command(control.ActionKill, "beta", func(c *control.Command) { c.Reason = fmt.Sprint("junk ", i) }, "stranger")
	}
	cs := newChannelServer(t, feed)
	c := pollingCaged(t, s, cs)
	cs.waitPolls(t, 4)
	list, err := c.Client().ControlAcks(context.Background(), 0)
	if err != nil {
		t.Fatal(err)
	}
	refused, executed := 0, 0
	for _, a := range list {
		switch a.Status {
		case control.StatusRejected:
			refused++
		case control.StatusExecuted:
			executed++
		}
	}
	if refused > daemon.MaxRefusedFeedAcks || executed != 1 {
		t.Fatalf("after 4 polls of a feed with 40 forged commands: %d refused acks (limit %d), %d executed (want 1): %+v", refused, daemon.MaxRefusedFeedAcks, executed, list)
	}
}
