package suggest

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/auditlog"
)

func line(t *testing.T, r auditlog.Record) string {
	r.Schema, r.Agent = auditlog.Schema, "a"
	b, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestWarningsAndWildcards: shards collapse into a wildcard with a warning,
// upload-heavy and placeholder hosts are warned about, --since drops old
// records, special-use and metadata names are never suggested.
func TestWarningsAndWildcards(t *testing.T) {
	var lines []string
	blocked := func(host, method string, port int, ts string) {
		lines = append(lines, line(t, auditlog.Record{TS: ts, Method: method, Host: host, Port: port, Decision: auditlog.Blocked, Rule: "default-deny"}))
	}
	for _, s := range []string{"a", "b", "c", "d"} {
		blocked(s+".cdn.example.com", "CONNECT", 443, "2026-12-01T10:00:00Z")
	}
	blocked("up.example.com", "CONNECT", 443, "2026-12-01T10:00:00Z")
	lines = append(lines, line(t, auditlog.Record{TS: "2026-12-01T10:00:01Z", Method: "CONNECT", Host: "up.example.com", Port: 443, Decision: auditlog.Allowed, Rule: "grant:g1", BytesOut: 5 << 20, BytesIn: 1000}))
	blocked("ph.example.com", "CONNECT", 443, "2026-12-01T10:00:00Z")
	lines = append(lines, line(t, auditlog.Record{TS: "2026-12-01T10:00:02Z", Method: "POST", Host: "ph.example.com", Port: 443, Decision: auditlog.Blocked, Rule: "placeholder:anthropic"}))
	blocked("metadata.google.internal", "CONNECT", 443, "2026-12-01T10:00:00Z")
	blocked("printer.local", "DNS", 53, "2026-12-01T10:00:00Z")
	blocked("old.example.com", "CONNECT", 443, "2026-11-01T10:00:00Z")
	lines = append(lines, "not json")

	s := Build("a", lines, Options{Since: time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)})
	out := s.HCL("a-suggested")
	for _, want := range []string{
		`"*.cdn.example.com"`, "WARNING: wildcard", "a.cdn.example.com, b.cdn.example.com",
		`"up.example.com"`, "WARNING: upload-heavy: the cage sent 5242880 bytes",
		`"ph.example.com"`, "WARNING: received a secret's placeholder (ph.example.com)",
		"not suggested: metadata.google.internal", "not suggested: printer.local",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	for _, never := range []string{`"a.cdn.example.com"`, "old.example.com", `"metadata.google.internal"`, "ports ="} {
		if strings.Contains(out, never) {
			t.Errorf("output has %q:\n%s", never, out)
		}
	}
}

// A learn run reads as a refused run: records learn mode let through
// (flagged, rule learn) are suggested, a tunnel's close record is not
// counted twice, and what learn mode refused stays unsuggested.
func TestLearnRecordsAreSuggested(t *testing.T) {
	lines := []string{
		line(t, auditlog.Record{TS: "2026-12-01T10:00:00Z", Event: auditlog.EventLearn, Decision: auditlog.Flagged, Rule: "learn", Reason: "learn mode on"}),
		line(t, auditlog.Record{TS: "2026-12-01T10:00:01Z", Event: auditlog.EventOpen, Method: "CONNECT", Host: "registry.npmjs.org", Port: 443, Decision: auditlog.Flagged, Rule: "learn"}),
		line(t, auditlog.Record{TS: "2026-12-01T10:00:02Z", Event: auditlog.EventClose, Method: "CONNECT", Host: "registry.npmjs.org", Port: 443, Decision: auditlog.Flagged, Rule: "learn"}),
		line(t, auditlog.Record{TS: "2026-12-01T10:00:03Z", Method: "DNS", Host: "registry.npmjs.org", Port: 53, Decision: auditlog.Flagged, Rule: "learn"}),
		line(t, auditlog.Record{TS: "2026-12-01T10:00:04Z", Method: "GET", Host: "mirror.example.org", Port: 8080, Decision: auditlog.Flagged, Rule: "learn"}),
		line(t, auditlog.Record{TS: "2026-12-01T10:00:05Z", Method: "CONNECT", Host: "metadata.google.internal", Port: 443, Decision: auditlog.Blocked, Rule: "special-use"}),
		line(t, auditlog.Record{TS: "2026-12-01T10:00:06Z", Method: "CONNECT", Host: "o1.ingest.sentry.io", Port: 443, Decision: auditlog.Blocked, Rule: "deny:*.sentry.io"}),
	}
	s := Build("a", lines, Options{})
	got := map[string]Entry{}
	for _, e := range s.Entries {
		got[e.Pattern] = e
	}
	if e := got["registry.npmjs.org"]; e.Requests != 1 || e.Lookups != 1 {
		t.Fatalf("registry.npmjs.org = %+v (want 1 request, 1 lookup)", e)
	}
	if e := got["mirror.example.org"]; e.Requests != 1 || len(e.Ports) != 1 || e.Ports[0] != 8080 {
		t.Fatalf("mirror.example.org = %+v", e)
	}
	if len(s.Entries) != 2 {
		t.Fatalf("entries %+v", s.Entries)
	}
	hcl := s.HCL("a-suggested")
	if strings.Contains(hcl, `"metadata.google.internal"`) || strings.Contains(hcl, `"o1.ingest.sentry.io"`) {
		t.Fatalf("suggested what learn mode refused:\n%s", hcl)
	}
}
