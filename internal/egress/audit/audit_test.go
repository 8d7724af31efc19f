package audit

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestLogWritesOneRecordPerLine(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.jsonl")
	l, err := Open("alice", path, false)
	if err != nil {
		t.Fatal(err)
	}
	var hooked []Record
	l.Hook = func(r Record) { hooked = append(hooked, r) }
	for _, d := range []string{Allowed, Blocked} {
		if err := l.Log(Record{Method: "CONNECT", Host: "a.example.com", Port: 443, Decision: d, Reason: "r", Rule: "x"}); err != nil {
			t.Fatal(err)
		}
	}
	l.Close()
	b, _ := os.ReadFile(path)
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) != 2 || len(hooked) != 2 {
		t.Fatalf("got %d lines, %d hooked", len(lines), len(hooked))
	}
	var m map[string]any
	if err := json.Unmarshal([]byte(lines[1]), &m); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"schema", "ts", "agent", "method", "host", "port", "path", "decision", "reason", "rule", "inspectors", "secrets_injected", "secrets_redacted", "bytes_out", "bytes_in", "duration_ms", "event"} {
		if _, ok := m[k]; !ok {
			t.Errorf("field %s missing", k)
		}
	}
	if m["agent"] != "alice" || m["decision"] != Blocked || m["schema"] != float64(Schema) {
		t.Fatalf("record %v", m)
	}
	if _, isList := m["secrets_injected"].([]any); !isList {
		t.Fatal("empty lists must be [] not null")
	}
	f := Fields(hooked[0])
	if f["NIXCAGE_DECISION"] != Allowed || f["NIXCAGE_HOST"] != "a.example.com" || len(f) != 17 || f["NIXCAGE_EVENT"] != "request" {
		t.Fatalf("journal fields %v", f)
	}
}
