package secrets

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestNewPlaceholder(t *testing.T) {
	for _, real := range []string{
		"sk-ant-api03-AbCdEf0123456789_-xyzXYZ0123456789abcdefghijkLMNOP",
		"ghp_0123456789abcdefghijklmnopqrstuvwxyzAB",
		"AKIAIOSFODNN7EXAMPLE",
		"plain-token-without-known-prefix-1234",
		"xoxb-1234-5678-abcdefghijkl",
	} {
		t.Run(real[:8], func(t *testing.T) {
			seen := map[string]bool{}
			for range 5 {
				p, err := NewPlaceholder(real)
				if err != nil {
					t.Fatal(err)
				}
				if len(p) != len(real) || p == real || !strings.HasPrefix(p, KnownPrefix(real)) {
					t.Fatalf("placeholder %q for %q", p, real)
				}
				seen[p] = true
			}
			if len(seen) < 5 {
				t.Fatal("placeholders are not random")
			}
		})
	}
	if _, err := NewPlaceholder(""); err == nil {
		t.Fatal("empty value accepted")
	}
}

func TestReadReal(t *testing.T) {
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "one"), []byte("value\n"), 0o600)
	os.WriteFile(filepath.Join(dir, "two"), []byte("a\nb\n"), 0o600)
	os.WriteFile(filepath.Join(dir, "empty"), []byte("\n"), 0o600)
	if v, err := ReadReal(dir, "one"); err != nil || v != "value" {
		t.Fatalf("got %q %v", v, err)
	}
	for _, n := range []string{"two", "empty", "missing"} {
		if _, err := ReadReal(dir, n); err == nil {
			t.Errorf("%s accepted", n)
		}
	}
	if _, err := ReadReal("", "one"); err == nil || !strings.Contains(err.Error(), "CREDENTIALS_DIRECTORY") {
		t.Fatalf("no credentials dir: %v", err)
	}
}
