package egress

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/nixcage/nixcage/internal/testenv"
)

// The gateway holds an agent's real credentials, so it stays small: no
// D-Bus (it must never be able to talk to caged or systemd's bus), no CLI,
// no config-language parser. A test, because an import is one line away.
func TestGatewayDependencies(t *testing.T) {
	goTool := testenv.LookPath(t, "go")
	out, err := exec.Command(goTool, "list", "-deps", "github.com/nixcage/nixcage/cmd/cage-egress").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	for _, forbidden := range []string{
		"github.com/godbus/dbus",
		"github.com/coreos/go-systemd/v22/dbus",
		"github.com/hashicorp/hcl",
		"github.com/nixcage/nixcage/internal/cli",
	} {
		for _, dep := range strings.Fields(string(out)) {
			if strings.HasPrefix(dep, forbidden) {
				t.Errorf("cage-egress depends on %s", dep)
			}
		}
	}
}
