package bus

import "testing"

// The audit records a command as a shell would read it back.
func TestFormatCommand(t *testing.T) {
	for in, want := range map[string][]string{
		"/bin/sh":                      {"/bin/sh"},
		`sh -c 'id; echo '\''x y'\'''`: {"sh", "-c", "id; echo 'x y'"},
		`ls '' /workspace/a=b`:         {"ls", "", "/workspace/a=b"},
		`printf '%s\n' '$HOME' 'a"b'`:  {"printf", `%s\n`, "$HOME", `a"b`},
	} {
		if got := FormatCommand(want); got != in {
			t.Errorf("FormatCommand(%q) = %s, want %s", want, got, in)
		}
	}
}
