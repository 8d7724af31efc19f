package daemon_test

import (
	"context"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/channel"
	"github.com/nixcage/nixcage/internal/daemon/daemontest"
	"github.com/nixcage/nixcage/internal/release"
	"github.com/nixcage/nixcage/internal/release/releasetest"
	"github.com/nixcage/nixcage/internal/store"
)

// channelHost is one caged following the channel.
type channelHost struct {
	name string
	c    *daemontest.Caged
	cl   *bus.Client
}

// waitChannel polls h's status until ok holds (the poller runs on its own
// schedule; the test waits for its outcome, it does not time it).
func waitChannel(t *testing.T, h channelHost, what string, ok func(*bus.Status) bool) *bus.Status {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		st, err := h.cl.Status(context.Background())
		if err == nil && ok(st) {
			return st
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %s never happened; last status %+v (%v)", h.name, what, st, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Two hosts' worth of caged (separate roots, buses and stores) pull one
// channel from a real HTTP server: a release published once reaches both;
// one whose downloads break off fails without a half-switched store and
// is applied once the server works; a tampered one and replays of an old
// signed release are refused with the reason in status and nothing
// switched; the metrics show the poll.
func TestChannelPulledByTwoHosts(t *testing.T) {
	releasetest.RequireNix(t)
	sk, _, pubPath := releasetest.Key(t, release.AlgEd25519)
	pub, err := os.ReadFile(pubPath)
	if err != nil {
		t.Fatal(err)
	}
	chanDir := t.TempDir()
	// A real static server; dropNARs makes it cut every NAR off halfway
	// (a flaky link or a server dying mid-download).
	var dropNARs atomic.Bool
	files := http.FileServer(http.Dir(chanDir))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if dropNARs.Load() && strings.HasPrefix(r.URL.Path, "/nar/") {
			b, err := os.ReadFile(filepath.Join(chanDir, filepath.FromSlash(r.URL.Path)))
			if err != nil {
				http.NotFound(w, r)
				return
			}
			w.Header().Set("Content-Length", strconv.Itoa(len(b)))
			w.WriteHeader(http.StatusOK)
			w.Write(b[:len(b)/2])
			w.(http.Flusher).Flush()
			panic(http.ErrAbortHandler) // drop the connection mid-body
		}
		files.ServeHTTP(w, r)
	}))
	defer srv.Close()
	ctx := context.Background()

	rels := t.TempDir()
	build := func(gen uint64) string {
		top := releasetest.Closure(t, fmt.Sprintf("channel-%d", gen), 8<<10)
		out := filepath.Join(rels, fmt.Sprint(gen))
		if _, err := release.Create(ctx, release.CreateOptions{StorePath: top, Keys: []*release.PrivateKey{sk},
			Channel: "stable", Generation: gen, Expires: releasetest.Expires(), Out: out, Compression: "xz"}); err != nil {
			t.Fatal(err)
		}
		return out
	}
	publish := func(gen uint64) {
		t.Helper()
		if _, err := channel.Publish(ctx, build(gen), chanDir); err != nil {
			t.Fatal(err)
		}
	}

	const storeBlock = `
store {
  channel = "stable"
  keys    = ["/etc/nixcage/release.pub"]
}
`
	var hosts []channelHost
	for i, name := range []string{"host-a", "host-b"} {
		c := daemontest.Start(t, storeBlock)
		if err := os.MkdirAll(c.Path("/etc/nixcage"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(c.Path("/etc/nixcage/release.pub"), pub, 0o644); err != nil {
			t.Fatal(err)
		}
		cfg := storeBlock + fmt.Sprintf("channel {\n  url = %q\n  interval = \"1s\"\n}\n", srv.URL+"/")
		if i == 0 {
			cfg += "metrics {\n  listen = \"unix:/run/nixcage/metrics.sock\"\n}\n"
		}
		c.WriteConfig(cfg)
		c.Restart() // the channel block takes effect at a restart
		hosts = append(hosts, channelHost{name: name, c: c, cl: c.Client()})
	}

	// Nothing published yet: the poll fails, says why, and backs off.
	for _, h := range hosts {
		st := waitChannel(t, h, "a failed first poll", func(st *bus.Status) bool { return st.ChannelPoll.Failures >= 1 })
		if !strings.Contains(st.ChannelPoll.LastError, "has no channel.json") || st.ChannelPoll.URL != srv.URL+"/" || st.ChannelPoll.LastPollUnix == 0 || st.ChannelPoll.LastSuccessUnix != 0 {
			t.Fatalf("%s before anything is published: %+v", h.name, st.ChannelPoll)
		}
	}

	// Published once, reaching both.
	for _, gen := range []uint64{1, 2} {
		publish(gen)
		for _, h := range hosts {
			st := waitChannel(t, h, fmt.Sprintf("generation %d applied", gen), func(st *bus.Status) bool {
				return st.Generation == gen && st.ChannelPoll.LastError == "" && st.ChannelPoll.Published == gen
			})
			if st.ChannelPoll.Lag != 0 || st.ChannelPoll.Failures != 0 || st.ChannelPoll.LastSuccessUnix == 0 {
				t.Fatalf("%s at generation %d: %+v", h.name, gen, st.ChannelPoll)
			}
		}
	}
	currentOf := func(h channelHost) string {
		l, err := os.Readlink(h.c.Path("/var/lib/nixcage/store/current"))
		if err != nil {
			t.Fatal(err)
		}
		return l
	}

	// Generation 3 while every NAR download breaks off: the poll fails,
	// nothing is half-switched (generation 2 current, the store verifies,
	// no work directory left), and the next polls retry until it works.
	dropNARs.Store(true)
	publish(3)
	for _, h := range hosts {
		st := waitChannel(t, h, "generation 3 failing mid-download", func(st *bus.Status) bool {
			return st.ChannelPoll.Published == 3 && st.ChannelPoll.Failures >= 1 && strings.Contains(st.ChannelPoll.LastError, "/nix/store/")
		})
		t.Logf("%s: broken download: %s", h.name, st.ChannelPoll.LastError)
		if !strings.Contains(st.ChannelPoll.LastError, "fetch nar of") || strings.Contains(st.ChannelPoll.LastError, "release refused") {
			t.Fatalf("%s: a broken download reported as %q, want a fetch failure (not a refusal of the release)", h.name, st.ChannelPoll.LastError)
		}
		if st.Generation != 2 || currentOf(h) != "generations/2" {
			t.Fatalf("%s after a broken download: generation %d, current %s", h.name, st.Generation, currentOf(h))
		}
		s, err := store.Open(store.Options{Root: h.c.Path("/var/lib/nixcage/store"), ReadOnly: true})
		if err != nil {
			t.Fatal(err)
		}
		if rep, err := s.Verify(ctx, true); err != nil || len(rep.Problems) != 0 {
			t.Fatalf("%s: the store after a broken download: %+v %v", h.name, rep, err)
		}
		if tmp, _ := filepath.Glob(h.c.Path("/var/lib/nixcage/store/tmp-*")); len(tmp) != 0 {
			t.Fatalf("%s: work directories left behind: %v", h.name, tmp)
		}
	}
	dropNARs.Store(false)
	for _, h := range hosts {
		waitChannel(t, h, "generation 3 applied once the server works", func(st *bus.Status) bool {
			return st.Generation == 3 && st.ChannelPoll.LastError == ""
		})
	}

	// A tampered release (generation 4, manifest edited after signing: a
	// publisher's server compromised, the keys not) is refused on both
	// with the reason; generation 3 stays current.
	publish(4)
	rel4 := filepath.Join(chanDir, channel.ReleaseDir(4), release.ManifestFile)
	raw, err := os.ReadFile(rel4)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(rel4, []byte(strings.Replace(string(raw), `"generation": 4`, `"generation": 40`, 1)), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, h := range hosts {
		st := waitChannel(t, h, "the tampered release refused", func(st *bus.Status) bool {
			return st.ChannelPoll.Published == 4 && st.ChannelPoll.Failures >= 1
		})
		if !strings.Contains(st.ChannelPoll.LastError, "release refused") || !strings.Contains(st.ChannelPoll.LastError, "signature") {
			t.Fatalf("%s: tampered release: error %q, want a signature refusal", h.name, st.ChannelPoll.LastError)
		}
		if st.Generation != 3 || st.ChannelPoll.Lag != 1 || currentOf(h) != "generations/3" {
			t.Fatalf("%s after the tampered release: generation %d, lag %d, current %s", h.name, st.Generation, st.ChannelPoll.Lag, currentOf(h))
		}
	}
	mgr := hosts[1].c.Bus.Conn(t).Object(bus.Name, bus.Path)
	if v, err := mgr.GetProperty(bus.ManagerIface + ".ChannelError"); err != nil || !strings.Contains(fmt.Sprint(v.Value()), "release refused") {
		t.Fatalf("ChannelError property = %v (%v)", v.Value(), err)
	}
	if v, err := mgr.GetProperty(bus.ManagerIface + ".ChannelPublished"); err != nil || v.Value() != uint64(4) {
		t.Fatalf("ChannelPublished property = %v (%v)", v.Value(), err)
	}

	// Replays of the old, validly signed generation 1: an index that
	// claims it is new, and one that names it honestly. The store's
	// rollback protection refuses both; nothing is switched.
	writeIndex := func(gen uint64, dir string) {
		t.Helper()
		b, err := (&channel.Index{Schema: 1, Channel: "stable", Generation: gen, Release: dir}).Marshal()
		if err != nil {
			t.Fatal(err)
		}
		if err := release.WriteFileAtomic(filepath.Join(chanDir, channel.IndexFile), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		gen  uint64
		want string
	}{
		{50, "generation 1 is not newer than the accepted generation 3 (rollback protection)"},
		{1, "generation 1 is not newer than the accepted generation 3 (rollback protection)"},
	} {
		writeIndex(tc.gen, channel.ReleaseDir(1))
		for _, h := range hosts {
			st := waitChannel(t, h, fmt.Sprintf("the replay as generation %d refused", tc.gen), func(st *bus.Status) bool {
				return st.ChannelPoll.Published == tc.gen && strings.Contains(st.ChannelPoll.LastError, tc.want)
			})
			if st.Generation != 3 || currentOf(h) != "generations/3" {
				t.Fatalf("%s after a replay: generation %d, current %s", h.name, st.Generation, currentOf(h))
			}
		}
	}

	// The publisher recovers the channel with a new generation: both
	// follow, and the error clears.
	writeIndex(4, channel.ReleaseDir(3))
	publish(5)
	for _, h := range hosts {
		waitChannel(t, h, "generation 5 applied after the refusals", func(st *bus.Status) bool {
			return st.Generation == 5 && st.ChannelPoll.LastError == "" && st.ChannelPoll.Lag == 0
		})
	}

	// The metrics endpoint of host-a carries the poll.
	sock := hosts[0].c.Path("/run/nixcage/metrics.sock")
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}}
	resp, err := hc.Get("http://caged/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{"nixcage_channel_last_poll_timestamp_seconds ", "nixcage_channel_last_success_timestamp_seconds ",
		"nixcage_channel_published_generation 5", "nixcage_channel_lag_generations 0", "nixcage_channel_poll_failures 0", "nixcage_store_generation 5"} {
		if !strings.Contains(string(body), want) {
			t.Errorf("metrics lack %q:\n%s", want, body)
		}
	}

	// An operator rolls host-b back to 3: the channel still serves 5,
	// which the store refuses (rollback protection), and that is no error:
	// the rollback stands until something newer is published.
	h := hosts[1]
	if _, _, err := h.cl.Rollback(ctx, 3, false); err != nil {
		t.Fatal(err)
	}
	after := time.Now().Unix() + 1
	st := waitChannel(t, h, "a poll after the rollback", func(st *bus.Status) bool { return st.ChannelPoll.LastPollUnix > after })
	if st.Generation != 3 || st.ChannelPoll.LastError != "" || st.ChannelPoll.Lag != 2 || currentOf(h) != "generations/3" {
		t.Fatalf("after an operator rollback to 3 with the channel at 5: generation %d, %+v", st.Generation, st.ChannelPoll)
	}
}

// TestChannelRecoversFromRevokedKey is the fast-forward attack through the
// channel (red team): a compromised but still trusted release key
// publishes generation 2^64-1 and every host takes it; the root keys then
// revoke that key, and the legitimate publisher ships generation 2 signed
// by the new key with the key set in the channel's keys/. The store's
// counter accepts it (docs/store.md); the poller must hand it over rather
// than judge by number. Before it did, it answered "the channel serves
// generation 2, older than the current generation 18446744073709551615"
// on every poll: the host stayed on the attacker's release for ever.
func TestChannelRecoversFromRevokedKey(t *testing.T) {
	releasetest.RequireNix(t)
	key1, _, pub1Path := releasetest.Key(t, release.AlgEd25519)
	key2, pub2, _ := releasetest.Key(t, release.AlgEd25519)
	root, rootPub, rootPath := releasetest.Key(t, release.AlgEd25519)
	chanDir := t.TempDir()
	srv := httptest.NewServer(http.FileServer(http.Dir(chanDir)))
	defer srv.Close()
	ctx := context.Background()
	build := func(gen uint64, signer *release.PrivateKey, variant string) string {
		top := releasetest.Closure(t, variant, 4<<10)
		out := filepath.Join(t.TempDir(), "rel")
		if _, err := release.Create(ctx, release.CreateOptions{StorePath: top, Keys: []*release.PrivateKey{signer},
			Channel: "stable", Generation: gen, Expires: releasetest.Expires(), Out: out, Compression: "none"}); err != nil {
			t.Fatal(err)
		}
		return out
	}

	const cfg = `
store {
  channel   = "stable"
  keys      = ["/etc/nixcage/release.pub"]
  root_keys = ["/etc/nixcage/root.pub"]
}
`
	c := daemontest.Start(t, cfg)
	for p, src := range map[string]string{"/etc/nixcage/release.pub": pub1Path, "/etc/nixcage/root.pub": rootPath} {
		b, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		os.MkdirAll(filepath.Dir(c.Path(p)), 0o755)
		if err := os.WriteFile(c.Path(p), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	c.WriteConfig(cfg + fmt.Sprintf("channel {\n  url = %q\n  interval = \"1s\"\n}\n", srv.URL+"/"))
	c.Restart()
	h := channelHost{name: "host", c: c, cl: c.Client()}

	if _, err := channel.Publish(ctx, build(1, key1, "revoke-1"), chanDir); err != nil {
		t.Fatal(err)
	}
	waitChannel(t, h, "generation 1 applied", func(st *bus.Status) bool { return st.Generation == 1 })
	const attack = uint64(math.MaxUint64)
	if _, err := channel.Publish(ctx, build(attack, key1, "revoke-attack"), chanDir); err != nil {
		t.Fatal(err)
	}
	waitChannel(t, h, "the attacker's generation applied", func(st *bus.Status) bool { return st.Generation == attack })

	// The root revokes key 1 (key set 1 trusts key 2 only) and the
	// legitimate publisher takes the channel back: its index is replaced.
	good := build(2, key2, "revoke-2")
	ks := &release.KeySet{Schema: release.Schema, Version: 1, Created: time.Now().UTC().Truncate(time.Second),
		Expires: time.Now().Add(365 * 24 * time.Hour).UTC().Truncate(time.Second)}
	var err error
	if ks.Root, err = release.NewRole([]*release.PublicKey{rootPub}, 1); err != nil {
		t.Fatal(err)
	}
	if ks.Release, err = release.NewRole([]*release.PublicKey{pub2}, 1); err != nil {
		t.Fatal(err)
	}
	raw, sig, err := release.SignKeySet(ks, []*release.PrivateKey{root})
	if err != nil {
		t.Fatal(err)
	}
	os.MkdirAll(filepath.Join(good, release.KeySetDir), 0o755)
	os.WriteFile(filepath.Join(good, release.KeySetDir, release.KeySetFile(1)), raw, 0o644)
	os.WriteFile(filepath.Join(good, release.KeySetDir, release.KeySetFile(1)+".sig"), sig, 0o644)
	if err := os.Remove(filepath.Join(chanDir, channel.IndexFile)); err != nil {
		t.Fatal(err)
	}
	if _, err := channel.Publish(ctx, good, chanDir); err != nil {
		t.Fatal(err)
	}
	// Generation, poll and freshness are set one after another by the
	// poll that applied it: wait for all three rather than read them at
	// the first (a loaded CI run saw the generation before the lag).
	st := waitChannel(t, h, "key 2's generation 2 applied after the revocation", func(st *bus.Status) bool {
		return st.Generation == 2 && st.ChannelPoll.LastError == "" && st.ChannelPoll.Lag == 0 && st.Freshness == "ok"
	})
	if st.ChannelPoll.Lag != 0 || st.Freshness != "ok" {
		t.Fatalf("after recovering: %+v, freshness %s %s", st.ChannelPoll, st.Freshness, st.FreshnessMessage)
	}
}

// TestChannelSlowNARDoesNotLockOutOperator (red team, fails on main): a
// channel server holding no key serves the newest genuinely signed release
// (it has it: it is the channel) but trickles its NARs one byte at a time,
// each inside the idle timeout. caged applies from the channel holding the
// daemon's operation lock for up to channelApplyTimeout (an hour), so for
// that hour an operator's reload, apply, rollback or agent restart waits
// behind the server's download: the publisher decides when the operator
// may act. The operator's reload must not wait on a channel download.
func TestChannelSlowNARDoesNotLockOutOperator(t *testing.T) {
	releasetest.RequireNix(t)
	sk, _, pubPath := releasetest.Key(t, release.AlgEd25519)
	chanDir := t.TempDir()
	var trickle atomic.Bool
	narAsked := make(chan struct{}, 64)
	stop := make(chan struct{})
	files := http.FileServer(http.Dir(chanDir))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if trickle.Load() && strings.HasPrefix(r.URL.Path, "/nar/") {
			b, err := os.ReadFile(filepath.Join(chanDir, filepath.FromSlash(r.URL.Path)))
			if err != nil {
				http.NotFound(w, r)
				return
			}
			narAsked <- struct{}{}
			w.Header().Set("Content-Length", strconv.Itoa(len(b)))
			w.WriteHeader(http.StatusOK)
			for i := range b {
				select {
				case <-stop:
					panic(http.ErrAbortHandler)
				case <-r.Context().Done():
					return
				case <-time.After(500 * time.Millisecond):
				}
				w.Write(b[i : i+1])
				w.(http.Flusher).Flush()
			}
			return
		}
		files.ServeHTTP(w, r)
	}))
	defer srv.Close()
	defer close(stop)
	ctx := context.Background()
	publish := func(gen uint64) {
		t.Helper()
		top := releasetest.Closure(t, fmt.Sprintf("slow-%d", gen), 8<<10)
		out := filepath.Join(t.TempDir(), "rel")
		if _, err := release.Create(ctx, release.CreateOptions{StorePath: top, Keys: []*release.PrivateKey{sk},
			Channel: "stable", Generation: gen, Expires: releasetest.Expires(), Out: out, Compression: "none"}); err != nil {
			t.Fatal(err)
		}
		if _, err := channel.Publish(ctx, out, chanDir); err != nil {
			t.Fatal(err)
		}
	}
	const storeBlock = `
store {
  channel = "stable"
  keys    = ["/etc/nixcage/release.pub"]
}
`
	c := daemontest.Start(t, storeBlock)
	pub, err := os.ReadFile(pubPath)
	if err != nil {
		t.Fatal(err)
	}
	os.MkdirAll(c.Path("/etc/nixcage"), 0o755)
	if err := os.WriteFile(c.Path("/etc/nixcage/release.pub"), pub, 0o644); err != nil {
		t.Fatal(err)
	}
	c.WriteConfig(storeBlock + fmt.Sprintf("channel {\n  url = %q\n  interval = \"1s\"\n}\n", srv.URL+"/"))
	c.Restart()
	h := channelHost{name: "host", c: c, cl: c.Client()}
	publish(1)
	waitChannel(t, h, "generation 1 applied", func(st *bus.Status) bool { return st.Generation == 1 })

	trickle.Store(true)
	publish(2)
	select {
	case <-narAsked:
	case <-time.After(60 * time.Second):
		t.Fatal("caged never fetched generation 2's NARs")
	}
	rctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	if err := h.cl.Reload(rctx); err != nil {
		t.Fatalf("the operator's reload while the channel server trickles a NAR: %v (it waits on caged's operation lock, held by the channel apply for up to an hour)", err)
	}
	// The stopped apply is a failed poll saying why, and the next poll
	// retries it: once the server serves, generation 2 arrives.
	trickle.Store(false)
	waitChannel(t, h, "generation 2 applied after the operator's reload", func(st *bus.Status) bool {
		return st.Generation == 2 && st.ChannelPoll.LastError == ""
	})
}
