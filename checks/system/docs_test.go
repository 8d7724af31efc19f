package system

import (
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/systest"
	"github.com/nixcage/nixcage/internal/testenv"
)

// docBlock returns the fenced block that follows `<!-- systest: NAME ...-->`
// in a document of this repository: the commands a reader copies, which a
// test runs verbatim.
func docBlock(t *testing.T, doc, name string) string {
	t.Helper()
	root, err := systest.ModuleRoot()
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(root, doc))
	if err != nil {
		t.Fatal(err)
	}
	re := regexp.MustCompile("(?s)<!-- systest: " + regexp.QuoteMeta(name) + "[ \t][^\n]*-->\n```[a-z]*\n(.*?)\n```")
	m := re.FindSubmatch(b)
	if m == nil {
		t.Fatalf("%s has no block marked <!-- systest: %s -->", doc, name)
	}
	return string(m[1])
}

// TestInstallAsDocumented installs nixcage on a booted systemd exactly as
// README.md ("Install on any systemd host") and docs/operations.md
// ("Installing for render mode") say, running their blocks verbatim, and
// checks that the result runs: caged and the target enabled (so they come
// back after a reboot), the quick-start agent declared and run, status and
// doctor passing. The binaries are built as README's go build line builds
// them (static, version stamped) and put in /usr/local/bin.
func TestInstallAsDocumented(t *testing.T) {
	testenv.RequireSystem(t)
	bins := systest.Binaries{
		"cagectl":     systest.BuildT(t, "./cmd/cagectl"),
		"caged":       systest.BuildT(t, "./cmd/caged"),
		"cage-egress": systest.BuildT(t, "./cmd/cage-egress"),
	}
	root, _ := systest.ModuleRoot()
	quickstart, err := os.ReadFile(filepath.Join(root, "examples/quickstart.hcl"))
	if err != nil {
		t.Fatal(err)
	}
	boot := func(t *testing.T) (*systest.Machine, func(string) (string, error)) {
		m := systest.BootT(t)
		systest.StartInternetT(t, m)
		for name, p := range bins {
			if err := m.CopyIn(p, filepath.Join(systest.BinDir, name), 0o755); err != nil {
				t.Fatal(err)
			}
		}
		// What the reader has before the block: the config and its secret.
		m.MustWriteFile(t, "/root/cage.hcl", quickstart, 0o644)
		m.MustWriteFile(t, "/etc/nixcage/secrets/demo-api", []byte(realSecret+"\n"), 0o600)
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		t.Cleanup(cancel)
		return m, func(script string) (string, error) { return m.Shell(ctx, script) }
	}
	waitRan := func(t *testing.T, m *systest.Machine) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if _, err := m.WaitInactive(ctx, systest.AgentUnit("demo")); err != nil {
			t.Fatal(err)
		}
		if j, _ := m.Journal(ctx, systest.AgentUnit("demo")); !strings.Contains(j, "agent sees API_KEY=") {
			t.Errorf("the quick-start agent did not run:\n%s", j)
		}
	}

	t.Run("README", func(t *testing.T) {
		m, sh := boot(t)
		block := docBlock(t, "README.md", "install")
		out, err := sh("cd /root && " + block)
		if err != nil {
			t.Fatalf("README's install block failed: %v\n%s", err, out)
		}
		t.Logf("README block:\n%s", out)
		if !strings.Contains(out, "demo") || !strings.Contains(out, "caged "+systest.Version) {
			t.Errorf("status in the block does not show caged and the agent:\n%s", out)
		}
		for _, u := range []string{"nixcage-caged.service", "nixcage.target"} {
			if st, _ := sh("systemctl is-enabled " + u); strings.TrimSpace(st) != "enabled" {
				t.Errorf("%s is %q after the install, want enabled (nothing would start after a reboot)", u, strings.TrimSpace(st))
			}
		}
		if _, err := sh("test -L /etc/systemd/system/multi-user.target.wants/nixcage.target && test -L /etc/systemd/system/nixcage.target.wants/" + systest.AgentUnit("demo")); err != nil {
			t.Errorf("boot-time links missing: %v", err)
		}
		waitRan(t, m)
	})

	t.Run("render mode", func(t *testing.T) {
		m, sh := boot(t)
		block := docBlock(t, "docs/operations.md", "render-mode")
		out, err := sh("cd /root && " + block)
		if err != nil {
			t.Fatalf("operations.md's render-mode block failed: %v\n%s", err, out)
		}
		t.Logf("render-mode block:\n%s", out)
		if !strings.Contains(out, "units render") || !strings.Contains(out, "demo") || strings.Contains(out, "not-found") {
			t.Errorf("status after a render-mode install:\n%s", out)
		}
		if _, err := sh("test -f /run/systemd/system/" + systest.AgentUnit("demo") + " && ! test -e /etc/systemd/system/" + systest.AgentUnit("demo")); err != nil {
			t.Errorf("render mode did not put the agent's unit in /run only: %v", err)
		}
		if st, _ := sh("systemctl is-enabled nixcage-caged.service"); strings.TrimSpace(st) != "enabled" {
			t.Errorf("caged is %q, want enabled", strings.TrimSpace(st))
		}
		waitRan(t, m)
	})
}
