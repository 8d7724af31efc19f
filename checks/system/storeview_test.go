package system

import (
	"context"
	"strings"
	"testing"

	"github.com/nixcage/nixcage/internal/systest"
)

// storeProbe runs as the agent, in a cage started on the store as it is at
// that moment (cagectl shell starts one with the agent's unit): what
// /nix/tools and /nix/store resolve to, whether the generation's tool runs,
// and every host marker (hostMarkers' names) found in any directory the
// store's links can lead to: the tools, the store, the store root and the
// release's own links. Each marker sits in a different host directory, so
// whichever of them a link led to, its marker shows.
const storeProbe = `echo tools=$(readlink -f /nix/tools) store=$(readlink -f /nix/store) uid=$(id -u); ` +
	`ls -a /nix/tools/ | tr "\n" " "; echo; ` +
	`if [ -x /nix/tools/bin/hello ]; then /nix/tools/bin/hello; fi; ` +
	`for d in /nix/tools /nix/tools/host-root /nix/tools/host-etc /nix/tools/up /nix/store /nix/store/* /nix/.nixcage; do ` +
	`for f in $d/nixcage-host-marker-*; do [ -e "$f" ] && echo "found $f"; done; done; ` +
	`(exec 3</nix/.nixcage/lock) 2>/dev/null && echo store-lock-opened; ` +
	`echo probe-end`

// hostMarkers are files only the host has: in its root, its /etc, its
// /var/lib and nixcage's state directory (next to the store root, with
// the gateways' CA keys and the workspaces).
var hostMarkers = []string{"/nixcage-host-marker-root", "/etc/nixcage-host-marker-etc",
	"/var/lib/nixcage-host-marker-varlib", "/var/lib/nixcage/nixcage-host-marker-statedir"}

// storeSeesNoHost: a service cage resolves its store links inside its own
// root, so a store changed behind apply's back (each tampering of
// store.TestTamperedTopRefusedAtBind, and one more up to nixcage's state
// directory) and a correctly signed release whose contents link to "/",
// /etc and above the root (generation 2, makeRelease) show the cage only
// its own paths. Checked from inside, as the agent, on the real store
// under caged; `store verify` still reports each tampering. With the
// store bound at /nix/store and /nix/tools from the host, as before, and
// no check unit, the cage saw the host's root (the tampering "top -> /").
func storeSeesNoHost(t *testing.T, ctx context.Context, m *systest.Machine, sh func(string) string, exitCode func(string) int) {
	t.Helper()
	for _, f := range hostMarkers {
		sh("echo host-only > " + f)
	}
	defer sh("rm -f " + strings.Join(hostMarkers, " "))
	probe := func(name string) string {
		t.Helper()
		out := sh("cagectl shell alpha -- /bin/sh -c '" + storeProbe + "'")
		if !strings.Contains(out, "probe-end") {
			t.Fatalf("%s: the probe did not finish:\n%s", name, out)
		}
		if strings.Contains(out, "nixcage-host-marker-") || strings.Contains(out, "host-only") {
			t.Errorf("%s: the cage sees host files through the store:\n%s", name, out)
		}
		// The store's writer lock: an agent holding it would hold off every
		// apply (docs/store.md).
		if strings.Contains(out, "store-lock-opened") {
			t.Errorf("%s: the agent opened the store's lock:\n%s", name, out)
		}
		t.Logf("%s: %s", name, strings.TrimSpace(out))
		return out
	}
	// The release as applied: its own links stay in the cage, its tool runs
	// (the store root's own lock exists: the probe's open of it is real).
	if out := probe("AsApplied"); !strings.Contains(out, "hello-from-generation-2") {
		t.Errorf("the cage does not run generation 2's tool:\n%s", out)
	}
	const root = "/var/lib/nixcage/store"
	sh("test -f " + root + "/lock")
	name := strings.TrimPrefix(strings.TrimSpace(sh("readlink "+root+"/generations/2/top")), "../../nix/store/")
	top := func(link string) [2]string {
		return [2]string{"cd " + root + "/generations/2 && mv top top.saved && ln -s " + link + " top", "cd " + root + "/generations/2 && rm top && mv top.saved top"}
	}
	for _, c := range []struct {
		name   string
		tamper [2]string // the change and its undo
	}{
		{"StorePathIsLinkToRoot", [2]string{"cd " + root + "/nix/store && mv " + name + " " + name + ".saved && ln -s / " + name,
			"cd " + root + "/nix/store && rm " + name + " && mv " + name + ".saved " + name}},
		{"TopLinkToRoot", top("/")},
		{"TopLinkToHostEtc", top("/etc")},
		{"TopLinkAboveRoot", top("../../../../../../var/lib")},
		{"TopLinkToStateDir", top("../../..")},
		{"TopLinkInsideRootOutsideStore", top("..")},
		{"NixStoreIsLink", [2]string{"cd " + root + "/nix && mv store store.saved && ln -s / store", "cd " + root + "/nix && rm store && mv store.saved store"}},
	} {
		sh(c.tamper[0])
		if got := exitCode("cagectl store verify --store " + root); got == 0 {
			t.Errorf("%s: store verify passed a tampered store", c.name)
		}
		probe(c.name)
		sh(c.tamper[1])
	}
	if got := exitCode("cagectl store verify --store " + root); got != 0 {
		t.Fatalf("store verify fails after the tampering was undone (exit %d)", got)
	}
}
