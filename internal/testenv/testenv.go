// Package testenv gates tests by the tier they need. Tiers are switched on by
// environment variables that .ci/run sets, so a plain `go test ./...` on a
// laptop skips them with a printed reason and CI runs them for real.
package testenv

import (
	"os"
	"os/exec"
	"testing"
)

// Privileged tests need root and real kernel namespaces on this host.
const PrivilegedVar = "NIXCAGE_TEST_PRIVILEGED"

// System tests boot a real systemd (debootstrap + systemd-nspawn).
const SystemVar = "NIXCAGE_TEST_SYSTEM"

// RequirePrivileged skips unless privileged tests are switched on and we are root.
func RequirePrivileged(t testing.TB) {
	t.Helper()
	if os.Getenv(PrivilegedVar) != "1" {
		t.Skipf("privileged test: set %s=1 and run as root (bash .ci/run does)", PrivilegedVar)
	}
	if os.Geteuid() != 0 {
		t.Fatalf("%s=1 but not running as root", PrivilegedVar)
	}
}

// RequireSystem skips unless system tests are switched on and we are root.
func RequireSystem(t testing.TB) {
	t.Helper()
	if os.Getenv(SystemVar) != "1" {
		t.Skipf("system test: set %s=1 and run as root on a machine with debootstrap and systemd-nspawn (bash .ci/run does)", SystemVar)
	}
	if os.Geteuid() != 0 {
		t.Fatalf("%s=1 but not running as root", SystemVar)
	}
}

// LookPath returns the path of a tool a test needs. When the test's tier is
// switched on, a missing tool is a failure (CI must install it), otherwise a skip.
func LookPath(t testing.TB, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		if os.Getenv(PrivilegedVar) == "1" || os.Getenv(SystemVar) == "1" {
			t.Fatalf("%s not found: .ci/run must install it", name)
		}
		t.Skipf("%s not installed", name)
	}
	return p
}
