package auditlog

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"
)

// Every agent-controlled field is cut to its bound counted in JSON bytes
// (what reaches the file), at a character boundary, with a marker naming
// how much was cut; a cut field is not cut again; a record with every
// field at its worst stays within MaxRecordBytes.
func TestBoundCutsAgentFields(t *testing.T) {
	cases := []struct {
		name string
		in   string
	}{
		{"short is kept", "/v1/messages"},
		{"long ASCII", strings.Repeat("A", 14<<10)},
		{"escaped six-fold", strings.Repeat("<", 5000)},
		{"control bytes", strings.Repeat("\x01", 5000)},
		{"invalid UTF-8", strings.Repeat("\xff", 5000)},
		{"multi-byte runes", strings.Repeat("é€😀", 2000)},
		{"just at the bound", strings.Repeat("a", MaxPath)},
		{"one over", strings.Repeat("a", MaxPath+1)},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := Clip(c.in, MaxPath)
			enc, _ := json.Marshal(got)
			if n := len(enc) - 2; n > MaxPath {
				t.Fatalf("encoded %d bytes, bound %d", n, MaxPath)
			}
			full, _ := json.Marshal(c.in)
			if len(full)-2 <= MaxPath {
				if got != c.in {
					t.Fatalf("a field within its bound was changed: %q", got)
				}
				return
			}
			prefix, marker, ok := strings.Cut(got, "…(+")
			if !ok || !strings.HasPrefix(c.in, prefix) || !strings.HasSuffix(marker, " bytes)") {
				t.Fatalf("cut field %.60q... has no marker or is not a prefix", got)
			}
			n, err := strconv.Atoi(strings.TrimSuffix(marker, " bytes)"))
			if err != nil || len(prefix)+n != len(c.in) {
				t.Fatalf("marker says +%s bytes; kept %d of %d", marker, len(prefix), len(c.in))
			}
			if utf8.ValidString(c.in) && !utf8.ValidString(got) {
				t.Fatal("cut inside a character")
			}
			if again := Clip(got, MaxPath); again != got {
				t.Fatal("a cut field was cut again")
			}
		})
	}

	worst := strings.Repeat("<", 64<<10)
	names := make([]string, 100)
	for i := range names {
		names[i] = worst
	}
	r := Record{Schema: Schema, TS: worst, Agent: worst, Event: worst, Method: worst, Host: worst, Port: 65535, Path: worst,
		Decision: worst, Reason: worst, Rule: worst, Inspectors: names, SecretsInjected: names, SecretsRedacted: names,
		BytesOut: -1 << 63, BytesIn: -1 << 63, DurationMS: -1 << 63, Count: -1 << 63}
	r.Bound()
	b, _ := json.Marshal(r)
	if len(b)+1 > MaxRecordBytes {
		t.Fatalf("worst record is %d bytes, MaxRecordBytes %d", len(b)+1, MaxRecordBytes)
	}
	if len(r.Inspectors) != MaxList || !strings.HasPrefix(r.Inspectors[MaxList-1], "…(+85 more)") {
		t.Fatalf("list of 100 names became %d, last %q", len(r.Inspectors), r.Inspectors[len(r.Inspectors)-1])
	}
	if names[0] != worst {
		t.Fatal("Bound wrote into the caller's list")
	}
	t.Logf("worst record %d bytes, MaxRecordBytes %d", len(b)+1, MaxRecordBytes)
}
