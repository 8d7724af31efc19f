package system

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/systest"
	"github.com/nixcage/nixcage/internal/testenv"
)

// A gateway crash loop (issue 22 item 4) on a real systemd: a config the
// gateway refuses makes every restart fail until systemd's start limit
// stops it and fails its sockets. The cage is cut off (fail closed); the
// operator is told, by `cagectl status` and by an EgressFailed event, and
// recovers as docs/operations.md says (`cagectl restart AGENT`).
func TestGatewayStartLimit(t *testing.T) {
	testenv.RequireSystem(t)
	bins := systest.Binaries{
		"cagectl":     systest.BuildT(t, "./cmd/cagectl"),
		"caged":       systest.BuildT(t, "./cmd/caged"),
		"cage-egress": systest.BuildT(t, "./cmd/cage-egress"),
	}
	m := systest.BootT(t)
	cfg := filepath.Join(t.TempDir(), "startlimit.hcl")
	os.WriteFile(cfg, []byte(`
egress_policy "p" {
  allow = ["api.example.com"]
}
agent "sl" {
  backend   = "service"
  command   = ["/bin/sleep", "infinity"]
  egress    = "p"
  autostart = false
}
`), 0o644)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if err := systest.InstallNixcage(ctx, m, bins, cfg, nil); err != nil {
		t.Fatal(err)
	}
	sh := func(script string) string {
		t.Helper()
		out, err := m.Shell(ctx, script)
		if err != nil {
			t.Fatalf("%s: %v\n%s", script, err, out)
		}
		return out
	}
	waitFor := func(what, script string) {
		t.Helper()
		for i := 0; ; i++ {
			if _, err := m.Shell(ctx, script); err == nil {
				return
			}
			if i > 300 {
				t.Fatalf("%s: never true: %s\nstatus:\n%s", what, script, sh("cagectl status; systemctl status --no-pager cage-egress@sl.service cage-egress@sl.socket || true"))
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	sh("systemctl reload dbus && systemctl start nixcage-caged.service")
	sh("cagectl start sl")
	waitFor("the gateway's sockets", "systemctl is-active -q cage-egress@sl.socket")
	sh("cagectl events >/run/operator.events 2>&1 & echo $! >/run/events.pid")
	waitFor("the events stream", "cagectl reload >/dev/null; grep -q Reconciled /run/operator.events")

	cfgFile := "/etc/nixcage/agents/sl/egress.json"
	sh("cp " + cfgFile + " /run/egress.json.good && echo '{broken' > " + cfgFile)
	sh("systemctl restart cage-egress@sl.service || true")
	// systemd 252 records the start limit on the socket (Result
	// service-start-limit-hit); the service keeps Result exit-code.
	waitFor("the gateway's start limit", `[ "$(systemctl show -P Result cage-egress@sl.socket)" = service-start-limit-hit ]`)
	waitFor("caged status names the start limit", "cagectl status | grep '^sl ' | grep -q 'failed: start limit hit'")
	waitFor("the event names it", "grep EgressFailed /run/operator.events | grep -q 'gateway failed: start limit hit'")
	ev := sh("grep EgressFailed /run/operator.events")
	if !strings.Contains(ev, "cagectl restart sl") {
		t.Errorf("the event does not say how to recover: %s", ev)
	}
	t.Logf("status with the gateway down:\n%s\nevent: %s", sh("cagectl status"), ev)

	// Recovery as documented.
	sh("cp /run/egress.json.good " + cfgFile + " && cagectl restart sl")
	waitFor("the gateway's sockets again", "systemctl is-active -q cage-egress@sl.socket")
	waitFor("caged status recovers", "! cagectl status | grep '^sl ' | grep -q 'failed'")
	sh("kill $(cat /run/events.pid) || true")
}
