package store

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/nixcage/nixcage/internal/testenv"
)

// The store library is shared by caged and cagectl --offline; it takes its
// settings as Options and must not grow a dependency on the config
// package, the bus or the CLI.
func TestStoreDependencies(t *testing.T) {
	gobin := testenv.LookPath(t, "go")
	out, err := exec.Command(gobin, "list", "-deps", "github.com/nixcage/nixcage/internal/store").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	for _, dep := range strings.Fields(string(out)) {
		for _, banned := range []string{"/internal/config", "/internal/cli", "/internal/bus", "godbus"} {
			if strings.Contains(dep, banned) {
				t.Errorf("internal/store depends on %s", dep)
			}
		}
	}
}
