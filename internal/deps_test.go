// Dependency direction, enforced (after tailscale's cmd/tailscaled/deps_test.go):
// the egress gateway never links D-Bus or caged's machinery, and the CLI
// never links the daemon or the gateway. Test-only imports do not count.
package internal_test

import (
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

const mod = "github.com/nixcage/nixcage/"

var rules = []struct {
	subject   string   // package path prefix (module-relative)
	forbidden []string // dependency path prefixes (full import paths or module-relative)
	why       string
}{
	{"internal/egress", []string{"github.com/godbus/dbus", "github.com/coreos/go-systemd/v22/dbus", mod + "internal/bus", mod + "internal/daemon", mod + "internal/reconcile", mod + "internal/quarantine", mod + "internal/store", mod + "internal/cli"},
		"the gateway faces the cage; it must not link the system bus or caged's machinery"},
	{"cmd/cage-egress", []string{"github.com/godbus/dbus", "github.com/coreos/go-systemd/v22/dbus", mod + "internal/bus", mod + "internal/daemon", mod + "internal/reconcile"},
		"the gateway binary must not link the system bus"},
	{"internal/cli", []string{mod + "internal/egress", mod + "internal/daemon", mod + "internal/reconcile", mod + "internal/quarantine"},
		"cagectl talks to caged through the typed bus client, never through the daemon or the sandbox runtime"},
	{"cmd/cagectl", []string{mod + "internal/egress", mod + "internal/daemon", mod + "internal/reconcile"},
		"cagectl must not link the daemon or the gateway"},
	{"internal/bus", []string{mod + "internal/daemon", mod + "internal/reconcile", mod + "internal/quarantine", mod + "internal/store", mod + "internal/egress"},
		"the bus package is shared by the CLI; it must stay free of the daemon's machinery"},
	{"internal/policy", []string{"github.com/godbus/dbus", mod + "internal/bus", mod + "internal/daemon"},
		"the policy document is read by the gateway"},
	{"internal/relay", []string{mod + "internal/daemon", mod + "internal/egress", mod + "internal/store", mod + "internal/reconcile", mod + "internal/quarantine", mod + "internal/cli", mod + "internal/render"},
		"the relay reaches caged only through the typed bus client; it links none of caged's machinery"},
	{"internal/relay/tg", []string{"github.com/godbus/dbus", mod + "internal/bus"},
		"the Telegram side knows nothing of caged"},
	{"cmd/cage-seal", []string{"net", "os/user", "runtime/cgo", mod + "internal/config", mod + "internal/bus"},
		"cage-seal runs inside cages (an image's root has no libc of the host's): it must link statically and stay tiny"},
}

func TestDependencyDirection(t *testing.T) {
	goBin := filepath.Join(runtime.GOROOT(), "bin", "go")
	out, err := exec.Command(goBin, "list", "-f", `{{.ImportPath}} {{join .Deps " "}}`, mod+"...").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	seen := map[string]bool{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		fields := strings.Fields(line)
		if len(fields) == 0 {
			continue
		}
		pkg := strings.TrimPrefix(fields[0], mod)
		for _, r := range rules {
			if pkg != r.subject && !strings.HasPrefix(pkg, r.subject+"/") {
				continue
			}
			seen[r.subject] = true
			for _, dep := range fields[1:] {
				for _, f := range r.forbidden {
					if dep == f || strings.HasPrefix(dep, f+"/") {
						t.Errorf("%s depends on %s: %s", fields[0], dep, r.why)
					}
				}
			}
		}
	}
	for _, r := range rules {
		if !seen[r.subject] {
			t.Logf("%s does not exist in this tree yet; its rule is checked once it does", r.subject)
		}
	}
}
