package events

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

// Ids are 128-bit hex, unique, field names are valid journal field names,
// and docs/fleet.md lists exactly this table (a shipper's filters are
// written from it).
func TestKindsTable(t *testing.T) {
	doc, err := os.ReadFile("../../docs/fleet.md")
	if err != nil {
		t.Fatal(err)
	}
	idRE := regexp.MustCompile(`^[0-9a-f]{32}$`)
	fieldRE := regexp.MustCompile(`^[A-Z0-9][A-Z0-9_]*$`)
	seen := map[string]bool{}
	for _, k := range Kinds {
		if !idRE.MatchString(k.ID) || seen[k.ID] || seen[k.Name] {
			t.Errorf("%s: id %q is not a unique 128-bit hex id", k.Name, k.ID)
		}
		seen[k.ID], seen[k.Name] = true, true
		row := "| " + k.Name + " | `" + k.ID + "` |"
		if !strings.Contains(string(doc), row) {
			t.Errorf("docs/fleet.md lacks the row %q", row)
		}
		for _, f := range k.Fields {
			if !fieldRE.MatchString(f) || !strings.HasPrefix(f, "NIXCAGE_") {
				t.Errorf("%s: field %q is not a NIXCAGE_ journal field name", k.Name, f)
			}
		}
		if k.Signal != "" {
			if got, ok := ForSignal(k.Signal); !ok || got.ID != k.ID {
				t.Errorf("%s: ForSignal(%s) does not find it", k.Name, k.Signal)
			}
		}
	}
	if n := len(regexp.MustCompile("(?m)^\\| [a-z-]+ \\| `[0-9a-f]{32}` \\|").FindAll(doc, -1)); n != len(Kinds) {
		t.Errorf("docs/fleet.md has %d event rows, the table %d", n, len(Kinds))
	}
}

// An entry carries the id, the kind and the signal's arguments by name, and
// its MESSAGE stays one line whatever an agent put in a reason.
func TestEntry(t *testing.T) {
	msg, _, vars := AgentQuarantined.Entry(AgentQuarantined.FieldsOf("alice", "bad\nline", "/var/lib/nixcage/evidence/alice-1", "root"))
	if vars["MESSAGE_ID"] != AgentQuarantined.ID || vars["NIXCAGE_EVENT"] != "agent-quarantined" || vars["NIXCAGE_AGENT"] != "alice" || vars["NIXCAGE_REASON"] != "bad\nline" || vars["SYSLOG_IDENTIFIER"] != "caged" {
		t.Fatalf("vars = %v", vars)
	}
	if strings.Contains(msg, "\n") || !strings.Contains(msg, `bad\nline`) {
		t.Fatalf("MESSAGE = %q", msg)
	}
	if _, ok := ForSignal("EgressDecision"); ok {
		t.Fatal("egress decisions must not become journal events (the audit log is their record)")
	}
}
