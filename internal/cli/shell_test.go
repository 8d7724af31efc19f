package cli

import (
	"os"
	"strings"
	"testing"
)

// TestShellCommandLine: the command goes after --, and flags of the
// command are not cagectl's; bad lines are exit 2 before caged is dialled,
// an unreachable caged exit 4.
func TestShellCommandLine(t *testing.T) {
	for _, c := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"shell"}, ExitUsage, "usage: cagectl shell AGENT"},
		{[]string{"shell", "alice", "id"}, ExitUsage, "the command goes after --"},
		{[]string{"shell", "Alice!"}, ExitUsage, "is not an agent name"},
		{[]string{"shell", "--bus", "unix:path=/nonexistent/bus", "alice", "--", "ls", "-la", "--bus"}, ExitNoConn, ""},
	} {
		// Real files: the descriptors are what crosses the bus.
		in, _ := os.Open(os.DevNull)
		out, _ := os.CreateTemp(t.TempDir(), "out")
		errf, _ := os.CreateTemp(t.TempDir(), "err")
		code := Main(t.Context(), c.args, Stdio{In: in, Out: out, Err: errf})
		in.Close()
		out.Close()
		errb, _ := os.ReadFile(errf.Name())
		errf.Close()
		if code != c.code || !strings.Contains(string(errb), c.want) {
			t.Errorf("%q: exit %d, stderr %q; want %d saying %q", c.args, code, errb, c.code, c.want)
		}
	}
}
