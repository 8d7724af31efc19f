package daemon_test

import (
	"context"
	"os"
	"strings"
	"testing"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/daemon/daemontest"
)

// A bus caller allowed to run cages names its run with "..": caged must
// refuse the name before it looks anything up under it. It used to Lstat
// /run/nixcage/runs/NAME first, as root, so "a cage named X is still being
// torn down" against "not a name" told the caller whether any path exists
// that caged can see (/root/..., another run's secrets). cagectl checks
// --name itself; this caller speaks D-Bus directly (red team).
func TestRunNameIsCheckedBeforeAnyLookup(t *testing.T) {
	c := daemontest.Start(t, "")
	if err := os.WriteFile(c.Path("/probe-me"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	null, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer null.Close()
	stdio := [3]*os.File{null, null, null}
	cl := c.Client()
	errFor := func(name string) string {
		_, err := cl.StartRun(context.Background(), bus.RunRequest{Name: name, Command: []string{"/bin/true"}}, stdio, nil, nil)
		if err == nil {
			t.Fatalf("run named %q was started", name)
		}
		msg := strings.ReplaceAll(err.Error(), name, "NAME")
		return strings.ReplaceAll(msg, strings.TrimPrefix(name, "../../../"), "BASE") // its suggested rename
	}
	present, absent := errFor("../../../probe-me"), errFor("../../../absent-file")
	if present != absent {
		t.Errorf("the refusal depends on whether the path exists:\n  present: %s\n  absent:  %s", present, absent)
	}
	if strings.Contains(present, "torn down") || !strings.Contains(present, "names become unit names") {
		t.Errorf("refusal of a name with '..': %s; want the name rule", present)
	}
}
