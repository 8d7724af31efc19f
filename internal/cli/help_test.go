package cli

import (
	"strings"
	"testing"
)

// Every command documents itself: a description, examples, and `--help`
// that exits 0 with its usage line. A command added without an entry in
// the help table fails here.
func TestEveryCommandHasHelp(t *testing.T) {
	for _, name := range commandNames() {
		h, ok := help[name]
		if !ok || h.long == "" || len(h.examples) == 0 {
			t.Errorf("%s: no help entry with a description and examples in help.go", name)
			continue
		}
		for _, ex := range h.examples {
			if !strings.Contains(ex, "cagectl "+name) && !strings.Contains(ex, "cagectl --") && !strings.Contains(ex, "caged ") && !strings.Contains(ex, "sha256sum") {
				t.Errorf("%s: example %q does not run the command", name, ex)
			}
		}
		code, out, errs := run(t, append(strings.Fields(name), "--help")...)
		if code != ExitOK || !strings.HasPrefix(out, "usage: cagectl "+name) || !strings.Contains(out, "examples:") {
			t.Errorf("cagectl %s --help: exit %d\n%s%s", name, code, out, errs)
		}
	}
}

func TestGroupAndVersion(t *testing.T) {
	for _, c := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"key", "--help"}, ExitOK, "key generate"},
		{[]string{"store", "--help"}, ExitOK, "store verify"},
		{[]string{"secret", "-h"}, ExitOK, "secret rotate"},
		{[]string{"key"}, ExitUsage, "key generate"},
		{[]string{"help", "store", "gc"}, ExitOK, "usage: cagectl store gc"},
		{[]string{"--version"}, ExitOK, "cagectl dev"},
		{[]string{"version"}, ExitOK, "cagectl dev"},
		{[]string{"help"}, ExitOK, "apply-config"},
	} {
		code, out, _ := run(t, c.args...)
		if code != c.code || !strings.Contains(out, c.want) {
			t.Errorf("cagectl %s: exit %d (want %d), output lacks %q:\n%s", strings.Join(c.args, " "), code, c.code, c.want, out)
		}
	}
}

// rollback and store gc list only the flags they read.
func TestHelpListsOnlyOwnFlags(t *testing.T) {
	for cmd, absent := range map[string][]string{
		"rollback":     {"--jobs", "--nix-key", "--keep", "--expiry-warning"},
		"store gc":     {"--channel", "--jobs", "--nix-key", "--key", "--threshold"},
		"generations":  {"--key", "--offline"},
		"store verify": {"--offline", "--channel"},
	} {
		_, out, _ := run(t, append(strings.Fields(cmd), "--help")...)
		for _, f := range absent {
			if strings.Contains(out, "  "+f+" ") {
				t.Errorf("cagectl %s --help lists %s, which it does not read:\n%s", cmd, f, out)
			}
		}
	}
}

// A bad flag says how to get help, with exit 2.
func TestBadFlagPointsAtHelp(t *testing.T) {
	code, _, errs := run(t, "status", "--nope")
	if code != ExitUsage || !strings.Contains(errs, "cagectl status --help") {
		t.Errorf("exit %d, stderr %q", code, errs)
	}
}
