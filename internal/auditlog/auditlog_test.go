package auditlog

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestRead(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "audit.jsonl")
	write := func(s string) {
		if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cases := []struct {
		name     string
		content  string
		offset   int64
		max      int
		want     []string
		wantNext int64
	}{
		{"missing log is empty", "", 0, 10, nil, 0},
		{"from the start", "a\nb\nc\n", 0, 10, []string{"a", "b", "c"}, 6},
		{"max bounds the records", "a\nb\nc\n", 0, 2, []string{"a", "b"}, 4},
		{"continue from an offset", "a\nb\nc\n", 4, 10, []string{"c"}, 6},
		{"a partial last record waits", "a\nb\npart", 0, 10, []string{"a", "b"}, 4},
		{"offset beyond the end restarts (rotated)", "a\n", 50, 10, []string{"a"}, 2},
		{"tail gives the newest", "a\nb\nc\n", -1, 2, []string{"b", "c"}, 6},
		{"empty lines are skipped", "a\n\nb\n", 0, 10, []string{"a", "b"}, 5},
		{"an offset inside a record starts at the next", "abc\ndef\nghi\n", 5, 10, []string{"ghi"}, 12},
		{"an offset on a record's last byte", "abc\ndef\n", 2, 10, []string{"def"}, 8},
		{"an offset inside the last record", "abc\ndef\n", 6, 10, nil, 8},
		{"an offset inside a partial record", "abc\nde", 5, 10, nil, 5},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			os.Remove(p)
			if c.content != "" {
				write(c.content)
			}
			got, next, err := Read(p, c.offset, c.max)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, c.want) || next != c.wantNext {
				t.Errorf("Read = %q, %d; want %q, %d", got, next, c.want, c.wantNext)
			}
		})
	}
}

func TestReadTailOfALargeLogStartsAtARecord(t *testing.T) {
	p := filepath.Join(t.TempDir(), "audit.jsonl")
	rec := strings.Repeat("x", 999) + "\n"
	if err := os.WriteFile(p, []byte(strings.Repeat(rec, MaxRead/1000+100)), 0o644); err != nil {
		t.Fatal(err)
	}
	got, _, err := Read(p, -1, 5)
	if err != nil || len(got) != 5 {
		t.Fatalf("Read = %d records, %v", len(got), err)
	}
	for _, l := range got {
		if len(l) != 999 {
			t.Errorf("a torn record of %d bytes", len(l))
		}
	}
}
