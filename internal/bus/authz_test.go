package bus

import (
	"strings"
	"testing"

	"github.com/nixcage/nixcage/internal/config"
)

func TestAuthorize(t *testing.T) {
	accounts := []*config.Account{
		{Name: "watchers", Group: "watch", Role: config.RoleViewer},
		{Name: "ops-alpha", User: "olga", Role: config.RoleOperator, Agents: []string{"alpha"}},
		{Name: "ops-all", Group: "1500", Role: config.RoleOperator},
		{Name: "scoped-admin", User: "sam", Role: config.RoleAdmin, Agents: []string{"alpha"}},
		{Name: "admins", User: "2000", Role: config.RoleAdmin},
	}
	var (
		root     = Identity{UID: 0, User: "root"}
		stranger = Identity{UID: 1234, User: "eve"}
		viewer   = Identity{UID: 1001, User: "vic", Groups: []string{"watch", "100"}}
		olga     = Identity{UID: 1002, User: "olga"}
		gidOp    = Identity{UID: 1003, User: "gus", Groups: []string{"1500"}}
		sam      = Identity{UID: 1004, User: "sam"}
		byUID    = Identity{UID: 2000} // no passwd entry
	)
	cases := []struct {
		name  string
		id    Identity
		act   Action
		agent string
		ok    bool
		want  string // in the refusal
	}{
		{"anyone reads status", stranger, ActRead, "", true, ""},
		{"root does everything", root, ActAdmin, "", true, ""},
		{"stranger cannot read audit", stranger, ActView, "alpha", false, `role "viewer"`},
		{"viewer reads audit", viewer, ActView, "beta", true, ""},
		{"viewer cannot kill", viewer, ActOperate, "alpha", false, `may not control agent alpha; it needs role "operator"`},
		{"scoped operator controls its agent", olga, ActOperate, "alpha", true, ""},
		{"scoped operator cannot control others", olga, ActOperate, "beta", false, "covering agent beta"},
		{"scoped operator reads its audit", olga, ActView, "alpha", true, ""},
		{"operator cannot apply", gidOp, ActAdmin, "", false, `role "admin"`},
		{"group by gid operates every agent", gidOp, ActOperate, "beta", true, ""},
		{"admin scoped to one agent cannot apply", sam, ActAdmin, "", false, "covering all agents"},
		{"admin scoped to one agent controls it", sam, ActOperate, "alpha", true, ""},
		{"admin by numeric uid applies", byUID, ActAdmin, "", true, ""},
		{"viewer cannot run a throw-away cage", viewer, ActRun, "", false, `may not start a throw-away cage (cagectl run); it needs role "operator" or higher covering all agents`},
		{"scoped operator cannot run a throw-away cage", olga, ActRun, "", false, "covering all agents"},
		{"operator of every agent runs a throw-away cage", gidOp, ActRun, "", true, ""},
		{"admin runs a throw-away cage", byUID, ActRun, "", true, ""},
		{"operator cannot open a shell", gidOp, ActShell, "alpha", false, `may not open a shell in agent alpha (cagectl shell); it needs role "admin"`},
		{"scoped admin opens a shell in its agent", sam, ActShell, "alpha", true, ""},
		{"scoped admin cannot open a shell elsewhere", sam, ActShell, "beta", false, "covering agent beta"},
		{"admin opens a shell anywhere", byUID, ActShell, "beta", true, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := Authorize(accounts, c.id, c.act, c.agent)
			if (err == nil) != c.ok {
				t.Fatalf("Authorize = %v, want ok=%v", err, c.ok)
			}
			if err != nil && !strings.Contains(err.Error(), c.want) {
				t.Errorf("refusal %q does not say %q", err, c.want)
			}
		})
	}
}
