package cli

import (
	"regexp"
	"strings"
	"testing"

	"github.com/nixcage/nixcage/internal/daemon/daemontest"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/policy"
	"github.com/nixcage/nixcage/internal/testenv"
)

// TestGrantsThroughCaged: cagectl allow, grants list, status, promote and
// revoke against a real caged on a real dbus-daemon; the grants file caged
// writes is the one the gateway loads (policy.LoadGrants, the gateway's own
// reader, accepts it).
func TestGrantsThroughCaged(t *testing.T) {
	testenv.RequireRoot(t, "caged accepts only a root-owned grants file, and a non-root test process writes files it owns")
	c := daemontest.Start(t, cliAgents)
	bus := []string{"--bus", c.Bus.Address}
	out := mustRun(t, append([]string{"allow", "alpha", "api.example.com:8443", "--for", "2h", "--reason", "npm install"}, bus...)...)
	m := regexp.MustCompile(`grant (g-[0-9a-f]+): alpha may reach api.example.com:8443 until `).FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("allow: %q", out)
	}
	id := m[1]
	doc, err := policy.LoadGrants(c.Path(paths.GrantsFile("alpha")), "alpha")
	if err != nil || len(doc.Grants) != 1 || doc.Grants[0].ID != id || doc.Grants[0].Host != "api.example.com" || doc.Grants[0].Port != 8443 || doc.Grants[0].Reason != "npm install" {
		t.Fatalf("grants file: %+v %v", doc, err)
	}
	if out := mustRun(t, append([]string{"grants", "list"}, bus...)...); !strings.Contains(out, id) || !strings.Contains(out, "npm install") {
		t.Errorf("grants list:\n%s", out)
	}
	if out := mustRun(t, append([]string{"status"}, bus...)...); !strings.Contains(out, "egress grants in force") || !strings.Contains(out, id) {
		t.Errorf("status does not show the grant:\n%s", out)
	}
	if out := mustRun(t, append([]string{"grants", "promote", id}, bus...)...); !strings.Contains(out, `allow = [..., "api.example.com"]`) || !strings.Contains(out, "ports = [..., 8443]") {
		t.Errorf("promote:\n%s", out)
	}
	mustRun(t, append([]string{"grants", "revoke", id}, bus...)...)
	if out := mustRun(t, append([]string{"grants", "list", "alpha"}, bus...)...); !strings.Contains(out, "no grants in force") {
		t.Errorf("after revoke:\n%s", out)
	}
	if doc, err := policy.LoadGrants(c.Path(paths.GrantsFile("alpha")), "alpha"); err != nil || len(doc.Grants) != 0 {
		t.Errorf("grants file after revoke: %+v %v", doc, err)
	}
}

// TestGrantRightsAsOtherUsers: cagectl as real other uids against caged: a
// viewer is refused a grant (exit 3), an operator grants an exact name but
// is refused a wildcard (exit 3), which root (admin) may grant.
func TestGrantRightsAsOtherUsers(t *testing.T) {
	testenv.RequirePrivileged(t)
	c := daemontest.Start(t, cliAgents+`
account "ops" {
  user = "www-data"
  role = "operator"
}
`)
	run := asOtherUID(t, c)
	const nobody, wwwData = 65534, 33
	for _, tc := range []struct {
		uid  uint32
		args []string
		code int
	}{
		{nobody, []string{"allow", "alpha", "api.example.com"}, ExitDenied},
		{wwwData, []string{"allow", "alpha", "*.example.com"}, ExitDenied},
		{wwwData, []string{"allow", "alpha", "api.example.com", "--for", "10m"}, ExitOK},
		{0, []string{"allow", "alpha", "*.example.com", "--for", "10m"}, ExitOK},
		{nobody, []string{"grants", "list", "alpha"}, ExitOK},
	} {
		got, out := run(tc.uid, tc.args...)
		if got != tc.code {
			t.Errorf("uid %d %v: exit %d, want %d:\n%s", tc.uid, tc.args, got, tc.code, out)
		}
		if tc.code == ExitDenied && !strings.Contains(out, "access denied") {
			t.Errorf("uid %d %v: refusal does not say so: %s", tc.uid, tc.args, out)
		}
	}
	doc, err := policy.LoadGrants(c.Path(paths.GrantsFile("alpha")), "alpha")
	if err != nil || len(doc.Grants) != 2 || doc.Grants[0].Host != "api.example.com" || doc.Grants[1].Host != "*.example.com" {
		t.Errorf("grants file: %+v %v", doc, err)
	}
}
