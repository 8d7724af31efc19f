// Package testenv gates tests by the tier they need. Tiers are switched on by
// environment variables that checks/test.sh sets, so a plain `go test ./...`
// on a laptop skips them with a printed reason and CI runs them for real.
//
// Three kinds of missing prerequisite are told apart (docs/testing.md):
//   - a tier not switched on, or not root: skip, saying how to switch it on;
//   - a tool checks/deps.sh installs, missing while a tier is switched on:
//     failure (the repo promised to install it; a skip would hide that);
//   - something a machine may simply not have (a nixpkgs lib checkout,
//     cgroup v2 controllers, KVM): always a skip, via MachineLacks, naming
//     what is missing and how to provide it.
//
// Every gate logs a tier marker first, so checks/summary can attribute the
// test (and its subtests) to its tier even when it skips.
package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"testing"
)

// Privileged tests need root and change host state (network namespaces,
// real Nix stores, a dbus-daemon with the shipped root-only policy).
const PrivilegedVar = "NIXCAGE_TEST_PRIVILEGED"

// System tests boot a real systemd (debootstrap + systemd-nspawn).
const SystemVar = "NIXCAGE_TEST_SYSTEM"

// Tiers as the summary names them. A test that calls no gate is a unit test.
const (
	TierUnit       = "unit"
	TierPrivileged = "privileged"
	TierSystem     = "system"
)

// Marker starts the log line by which a gate tells checks/summary the
// test's tier: "nixcage-tier: privileged".
const Marker = "nixcage-tier:"

// SkipPrefix starts the reason of every MachineLacks skip, so the summary
// can list what this machine lacks.
const SkipPrefix = "this machine lacks"

func mark(t testing.TB, tier string) {
	t.Helper()
	t.Log(Marker, tier)
}

// RequirePrivileged skips unless privileged tests are switched on and we are root.
func RequirePrivileged(t testing.TB) {
	t.Helper()
	mark(t, TierPrivileged)
	if os.Getenv(PrivilegedVar) != "1" {
		t.Skipf("privileged test: set %s=1 and run as root (bash checks/test.sh does)", PrivilegedVar)
	}
	if os.Geteuid() != 0 {
		t.Fatalf("%s=1 but not running as root: run as root, or unset it to skip the privileged tier", PrivilegedVar)
	}
}

// RequireRoot skips, saying why, unless the test runs as root. It is for
// tests that need root but change nothing outside their temporary
// directories beyond what root's tools do anyway (a private dbus-daemon with
// the shipped root-only policy, adding paths to the local /nix/store), so
// they run in a plain `go test ./...` as root without a switch. They count
// as the privileged tier.
func RequireRoot(t testing.TB, why string) {
	t.Helper()
	mark(t, TierPrivileged)
	if os.Geteuid() != 0 {
		t.Skipf("needs root: %s (run as root; bash checks/test.sh does)", why)
	}
}

// RequireSystem skips unless system tests are switched on and we are root.
func RequireSystem(t testing.TB) {
	t.Helper()
	mark(t, TierSystem)
	if os.Getenv(SystemVar) != "1" {
		t.Skipf("system test: set %s=1 and run as root on a machine with debootstrap and systemd-nspawn (bash checks/test.sh does)", SystemVar)
	}
	if os.Geteuid() != 0 {
		t.Fatalf("%s=1 but not running as root: run as root, or unset it to skip the system tier", SystemVar)
	}
}

// TierOn reports whether any tier beyond unit is switched on, i.e. whether
// the run promises that checks/deps.sh has installed every tool.
func TierOn() bool {
	return os.Getenv(PrivilegedVar) == "1" || os.Getenv(SystemVar) == "1"
}

// LookPath returns the path of a tool a test needs. Every tool a test looks
// up must be installed by checks/deps.sh: when a tier is switched on, a
// missing tool is a failure, otherwise a skip.
func LookPath(t testing.TB, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		if TierOn() {
			t.Fatalf("%s not found in PATH: checks/deps.sh must install it (a tier is switched on, so this is a failure, not a skip)", name)
		}
		t.Skipf("%s not installed (checks/deps.sh installs it)", name)
	}
	return p
}

// MachineLacks skips the test because this machine does not have what,
// something no install script can provide (hardware, kernel configuration,
// a source checkout that cannot be fetched here), whatever tier is on. how
// tells the reader how to provide it. The reason reads
// "this machine lacks WHAT: HOW".
func MachineLacks(t testing.TB, what, how string) {
	t.Helper()
	t.Skip(fmt.Sprintf("%s %s: %s", SkipPrefix, what, how))
}
