package system

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/bus/bustest"
	"github.com/nixcage/nixcage/internal/events"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/release/releasetest"
	"github.com/nixcage/nixcage/internal/systest"
	"github.com/nixcage/nixcage/internal/testenv"
)

// channelConfig is one host's caged: a store and the channel nginx serves
// over https with the test CA given as ca_file. Host paths of host B are
// under its --root, so the same text serves both.
const channelConfig = `
store {
  channel = "stable"
  keys    = ["/etc/nixcage/release.pub"]
}
channel {
  url      = "https://127.0.0.1:8443/nixcage/stable/"
  interval = "1s"
  ca_file  = "/etc/nixcage/channel-ca.pem"
}
`

// channelNginx is the whole nginx configuration: Debian's nginx as a
// static server of /srv/www over TLS, nothing nixcage-specific.
const channelNginx = `
worker_processes 1;
error_log stderr;
pid /run/channel-nginx.pid;
events { worker_connections 64; }
http {
  include /etc/nginx/mime.types;
  access_log /var/log/nginx/channel-access.log;
  server {
    listen 127.0.0.1:8443 ssl;
    ssl_certificate     /etc/channel-nginx/cert.pem;
    ssl_certificate_key /etc/channel-nginx/key.pem;
    root /srv/www;
  }
  # Acks of control commands are PUT here (control.ack_url), as any
  # WebDAV-capable server takes them.
  server {
    listen 127.0.0.1:8080;
    root /srv/acks;
    client_body_temp_path /srv/acks-tmp;
    location /acks/ {
      dav_methods PUT;
      create_full_put_path on;
    }
  }
}
`

// TestChannelOnSystemd is issue 18's pulled channel on a booted systemd:
// Debian's nginx serves a channel directory; two hosts' worth of caged
// (the machine's nixcage-caged.service on the system bus, and a second
// caged with its own root, store, state and bus, as a second host would
// have) poll it. Releases are published by running docs/fleet.md's CI
// block verbatim (examples/ci/publish-channel.sh) into nginx's root: each
// reaches both within a poll or two; a tampered one is refused on both
// with the reason in status and in a release-refused journal event from
// each caged; the metrics endpoint carries the last poll.
func TestChannelOnSystemd(t *testing.T) {
	testenv.RequireSystem(t)
	releasetest.RequireNix(t)
	cagectl, bins := cagedBinaries(t)
	keys := releaseKey(t, cagectl)
	caPEM, certPEM, keyPEM, err := systest.Certificates([]string{"channel.example.test"})
	if err != nil {
		t.Fatal(err)
	}

	m := systest.BootT(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	sh := func(script string) string { t.Helper(); return m.MustShell(t, script) }

	// The web server: Debian's nginx, started as a unit of its own.
	m.MustWriteFile(t, "/etc/channel-nginx/nginx.conf", []byte(channelNginx), 0o644)
	m.MustWriteFile(t, "/etc/channel-nginx/cert.pem", certPEM, 0o644)
	m.MustWriteFile(t, "/etc/channel-nginx/key.pem", keyPEM, 0o600)
	sh("mkdir -p /srv/www/nixcage/stable /srv/acks /srv/acks-tmp && chown nobody /srv/acks /srv/acks-tmp && systemd-run --unit=channel-nginx --property=Type=exec " +
		"/usr/sbin/nginx -c /etc/channel-nginx/nginx.conf -g 'daemon off;' && " +
		"for i in $(seq 50); do curl -sk -o /dev/null https://127.0.0.1:8443/ && break; sleep 0.1; done")

	// Host A: the machine's own caged.
	if err := m.CopyIn(keys+".pub", "/etc/nixcage/release.pub", 0o644); err != nil {
		t.Fatal(err)
	}
	m.MustWriteFile(t, "/etc/nixcage/channel-ca.pem", caPEM, 0o644)
	installConfig(t, ctx, m, bins, channelConfig+"metrics {\n  listen = \"127.0.0.1:9477\"\n}\n"+channelControlBlock("host-a")+channelAgent, nil)
	sh("systemctl start nixcage-caged.service")

	// Host B: a second caged with its own root (store, state, keys), its
	// own bus and config, under systemd as a unit of its own.
	const rootB = "/srv/host-b"
	if err := m.CopyIn(keys+".pub", rootB+"/etc/nixcage/release.pub", 0o644); err != nil {
		t.Fatal(err)
	}
	m.MustWriteFile(t, rootB+"/etc/nixcage/channel-ca.pem", caPEM, 0o644)
	m.MustWriteFile(t, rootB+"/etc/nixcage/nixcage.hcl", []byte(channelConfig+channelControlBlock("host-b")), 0o644)
	// Host B's bus has the system bus's rules: the defaults of Debian's
	// system.conf and the policy file nixcage installs.
	m.MustWriteFile(t, "/etc/host-b/bus.conf", []byte(bustest.Config("/run/host-b/bus",
		bustest.Options{Include: []string{"/etc/dbus-1/system.d/" + paths.BusName + ".conf"}})), 0o644)
	sh(`mkdir -p /run/host-b && systemd-run --unit=host-b-bus --property=Type=exec dbus-daemon --config-file=/etc/host-b/bus.conf --nofork --nopidfile &&
for i in $(seq 50); do [ -S /run/host-b/bus ] && break; sleep 0.1; done
systemd-run --unit=host-b-caged --property=Type=exec /usr/local/bin/caged --config ` + rootB + `/etc/nixcage/nixcage.hcl --root ` + rootB + ` --bus unix:path=/run/host-b/bus`)

	type host struct{ name, unit, status, store string }
	hosts := []host{
		{"host-a", "nixcage-caged.service", "cagectl status --json", "/var/lib/nixcage/store"},
		{"host-b", "host-b-caged.service", "cagectl status --json --bus unix:path=/run/host-b/bus", rootB + "/var/lib/nixcage/store"},
	}
	status := func(h host) (*bus.Status, error) {
		out, err := m.Shell(ctx, h.status)
		if err != nil {
			return nil, fmt.Errorf("%v: %s", err, out)
		}
		var st bus.Status
		if err := json.Unmarshal([]byte(out), &st); err != nil {
			return nil, fmt.Errorf("status JSON: %v\n%s", err, out)
		}
		return &st, nil
	}
	// waitFor counts polls (status refreshes), not seconds: the assertion
	// is "within a poll or two"; the deadline only stops a broken run.
	waitFor := func(h host, what string, ok func(*bus.Status) bool) *bus.Status {
		t.Helper()
		deadline := time.Now().Add(90 * time.Second)
		for {
			st, err := status(h)
			if err == nil && ok(st) {
				return st
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: %s never happened; last status %+v (%v)", h.name, what, st, err)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}

	// Publishing, as docs/fleet.md's CI block does it, into nginx's root.
	root, _ := systest.ModuleRoot()
	block := docBlock(t, "docs/fleet.md", "publish-channel")
	var publishTo func(commit, dir string)
	publish := func(commit string) { publishTo(commit, "/srv/www/nixcage/stable") }
	publishTo = func(commit, dir string) {
		t.Helper()
		cmd := exec.CommandContext(ctx, "bash", "-euc", block)
		cmd.Dir = root
		cmd.Env = append(os.Environ(),
			"PATH="+filepath.Dir(cagectl)+":"+os.Getenv("PATH"),
			"RELEASE_KEY="+keys+".key", "RELEASE_PUB="+keys+".pub",
			"CHANNEL_DIR="+m.Path(dir), "CI_COMMIT="+commit,
			// The example's builder is /bin/sh (see examples/ci/tools.nix);
			// test-scoped Nix config as everywhere (docs/testing.md).
			"NIX_CONFIG="+releasetest.NixConfig+"\nsandbox = false\nsubstituters =")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("the documented publish block failed: %v\n%s", err, out)
		}
		t.Logf("published %s:\n%s", commit, out)
	}

	for gen, commit := range []string{"c0ffee1", "c0ffee2"} {
		gen := uint64(gen + 1)
		publish(commit)
		for _, h := range hosts {
			st := waitFor(h, fmt.Sprintf("generation %d applied", gen), func(st *bus.Status) bool {
				return st.Generation == gen && st.ChannelPoll.Published == gen && st.ChannelPoll.LastError == ""
			})
			if st.ChannelPoll.Lag != 0 || st.ChannelPoll.URL != "https://127.0.0.1:8443/nixcage/stable/" {
				t.Fatalf("%s: %+v", h.name, st.ChannelPoll)
			}
			hello := sh("cat " + h.store + "/current/top/bin/hello")
			if !strings.Contains(hello, "tools "+commit) {
				t.Fatalf("%s: current tools are %q, want the ones built from %s", h.name, hello, commit)
			}
		}
	}

	// A tampered release: generation 3 published, then its manifest edited
	// on the server (the web server compromised, the signing key not).
	// Tampered in a staging copy and only then made visible, channel.json
	// last: edited in place, a poll between the publish and the edit took
	// the genuine generation 3 (seen in CI under load).
	sh("rm -rf /srv/www/stage && cp -a /srv/www/nixcage/stable /srv/www/stage")
	publishTo("c0ffee3", "/srv/www/stage")
	sh(`sed -i 's/"generation": 3/"generation": 33/' /srv/www/stage/releases/3/release.json`)
	sh("cd /srv/www/stage && mv channel.json /srv/www/channel.json.new && cp -a . /srv/www/nixcage/stable/ && mv /srv/www/channel.json.new /srv/www/nixcage/stable/channel.json && rm -rf /srv/www/stage")
	for _, h := range hosts {
		st := waitFor(h, "the tampered generation 3 refused", func(st *bus.Status) bool {
			return st.ChannelPoll.Published == 3 && strings.Contains(st.ChannelPoll.LastError, "release refused")
		})
		if !strings.Contains(st.ChannelPoll.LastError, "signature") || st.Generation != 2 || st.ChannelPoll.Lag != 1 {
			t.Fatalf("%s after the tampered release: generation %d, %+v", h.name, st.Generation, st.ChannelPoll)
		}
		if cur := strings.TrimSpace(sh("readlink " + h.store + "/current")); cur != "generations/2" {
			t.Fatalf("%s: current is %s after a refused release", h.name, cur)
		}
	}
	// The refusal is an event from each caged, as a shipper finds it.
	for _, h := range hosts {
		journalEvents(t, ctx, m, []journalWant{
			{kind: events.ReleaseRefused, unit: h.unit, fields: map[string]string{"NIXCAGE_OP": "poll", "NIXCAGE_BY": "channel",
				"NIXCAGE_SOURCE": "https://127.0.0.1:8443/nixcage/stable/releases/3"}},
			{kind: events.ReleaseApplied, unit: h.unit, fields: map[string]string{"NIXCAGE_GENERATION": "2", "NIXCAGE_PREVIOUS_GENERATION": "1",
				"NIXCAGE_BY": "channel https://127.0.0.1:8443/nixcage/stable/"}},
		})
	}

	// The metrics endpoint carries the poll (host A serves metrics).
	body := sh("curl -sf http://127.0.0.1:9477/metrics")
	for _, want := range []string{"nixcage_channel_last_poll_timestamp_seconds ", "nixcage_channel_last_success_timestamp_seconds ",
		"nixcage_channel_published_generation 3", "nixcage_channel_lag_generations 1", "nixcage_store_generation 2"} {
		if !strings.Contains(body, want) {
			t.Errorf("host-a metrics lack %q:\n%s", want, body)
		}
	}
	if !strings.Contains(sh("cagectl status"), "channel poll FAILED") {
		t.Error("cagectl status does not show the failing channel")
	}
	// nginx served it all: the requests are in its own access log.
	if log := sh("cat /var/log/nginx/channel-access.log"); !strings.Contains(log, "GET /nixcage/stable/channel.json") || !strings.Contains(log, "GET /nixcage/stable/releases/3/release.json") {
		t.Errorf("nginx's access log lacks the channel requests:\n%s", log)
	}

	// The channel's control feed (control_test.go).
	checkChannelControls(ctx, t, m, cagectl, sh, rootB)
}
