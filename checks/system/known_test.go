package system

import (
	"os"
	"strings"
	"testing"
)

// knownIssue is a defect these tests found in another component and reported
// to its owner. A test that hits one logs it with the fix and, unless
// NIXCAGE_SYSTEST_STRICT=1, skips or softens only the affected assertion, so
// the suite stays usable while the fix lands. Once fixed, the signature no
// longer shows up and the test runs in full; then delete the entry.
type knownIssue struct {
	id        string
	owner     string
	signature string // text in a unit's journal (or probe output) that identifies it
	fix       string
}

var knownIssues = []knownIssue{
	{
		id:        "service-root-visible",
		owner:     "internal/render (service backend)",
		signature: "probe sees the host root",
		fix: "systemd 252 ignores TemporaryFileSystem=/ without RootDirectory=: the cage sees the whole host read-only " +
			"(bus socket connectable, /var/lib readable). Add RootDirectory=/var/lib/nixcage/rootfs (the tmpfiles skeleton) " +
			"to service agent units; checked by hand on systemd 252: root then holds only the skeleton and the binds, requests still work",
	},
	{
		id:        "nspawn-netns-join",
		owner:     "internal/render (nspawn backend)",
		signature: "Failed to join network namespace: Operation not permitted",
		fix: "with --private-users=pick nspawn joins the netns after creating its user namespace and lacks CAP_SYS_ADMIN over it. " +
			"Drop --network-namespace-path= and put NetworkNamespacePath=/run/netns/nixcage-%i on the unit: nspawn then inherits it (checked)",
	},
	{
		id:        "nspawn-idmap-root",
		owner:     "internal/render (nspawn backend)",
		signature: "Failed to set up ID mapped mounts: Device or resource busy",
		fix: "--volatile=yes with --private-users-ownership=auto fails (at least when / is overlayfs, as in the test machine); " +
			"--private-users-ownership=off works: the volatile root is a fresh tmpfs and /usr is read-only anyway",
	},
	{
		id:        "nspawn-store-bind",
		owner:     "internal/render (nspawn backend)",
		signature: "Failed to stat /var/lib/nixcage/store",
		fix: "nspawn --bind-ro= has no optional form: create /var/lib/nixcage/store/nix/store and .../current in tmpfiles, " +
			"or leave the binds out while no store exists",
	},
	{
		id:        "podman-userns-auto-rootfs",
		owner:     "internal/render (podman backend)",
		signature: "User namespaces enabled, but no uid mappings found",
		fix: "podman 4.3 --userns=auto yields no mapping with --rootfs (no image layers to size it). Use an explicit per-agent " +
			"--uidmap=0:BASE:65536 --gidmap=0:BASE:65536 from a range reserved in /etc/subuid (checked), or an image",
	},
	{
		id:        "podman-skeleton-targets",
		owner:     "internal/render (podman backend, tmpfiles)",
		signature: "to rootfs at \"/etc/",
		fix: "with a user namespace, container root cannot create mount targets in the root-owned skeleton: tmpfiles must create " +
			"etc/hostname, run/.containerenv and etc/nixcage/ca-bundle.crt under /var/lib/nixcage/rootfs; then podman's default " +
			"sysctl net.ipv4.ping_group_range fails in the host-owned netns: run podman with CONTAINERS_CONF pointing at a file " +
			"with `[containers] default_sysctls = []` (checked)",
	},
}

// strict reports whether known issues fail tests.
func strict() bool { return os.Getenv("NIXCAGE_SYSTEST_STRICT") == "1" }

// matchKnown returns the known issue whose signature occurs in text.
func matchKnown(text string) *knownIssue {
	for i := range knownIssues {
		if strings.Contains(text, knownIssues[i].signature) {
			return &knownIssues[i]
		}
	}
	return nil
}

// skipKnown skips the test if text shows a known issue (unless strict).
func skipKnown(t *testing.T, text string) {
	t.Helper()
	if k := matchKnown(text); k != nil {
		if strict() {
			t.Fatalf("KNOWN ISSUE %s (%s): %s", k.id, k.owner, k.fix)
		}
		t.Skipf("KNOWN ISSUE %s (%s), reported; fix: %s", k.id, k.owner, k.fix)
	}
}

// softKnown logs a known issue instead of failing (unless strict).
func softKnown(t *testing.T, id, what string) {
	t.Helper()
	for _, k := range knownIssues {
		if k.id == id {
			if strict() {
				t.Errorf("%s: KNOWN ISSUE %s (%s): %s", what, k.id, k.owner, k.fix)
			} else {
				t.Logf("%s: KNOWN ISSUE %s (%s), reported; not failing (NIXCAGE_SYSTEST_STRICT=1 makes it fail). Fix: %s", what, k.id, k.owner, k.fix)
			}
			return
		}
	}
	t.Errorf("%s: unknown issue id %s", what, id)
}
