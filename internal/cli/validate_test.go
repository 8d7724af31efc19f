package cli

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// run drives cagectl in-process, as a shell would.
func run(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	code = Main(context.Background(), args, Stdio{In: strings.NewReader(""), Out: &out, Err: &errb})
	return code, out.String(), errb.String()
}

func TestValidateAcceptsExamples(t *testing.T) {
	files, _ := filepath.Glob("../../examples/*.hcl")
	pol, _ := filepath.Glob("../../policies/*.hcl")
	files = append(files, pol...)
	code, out, errs := run(t, append([]string{"validate"}, files...)...)
	if code != ExitOK {
		t.Fatalf("exit %d\n%s", code, errs)
	}
	if !strings.Contains(out, "valid") {
		t.Fatalf("stdout = %q", out)
	}
}

// Every broken config is refused with exit 1 and a diagnostic on stderr
// that points at file:line and shows the offending source.
func TestValidateRejectsCorpus(t *testing.T) {
	files, _ := filepath.Glob("../config/testdata/bad/*")
	for _, f := range files {
		if strings.HasSuffix(f, ".want") {
			continue
		}
		t.Run(filepath.Base(f), func(t *testing.T) {
			code, out, errs := run(t, "validate", f)
			if code != ExitFailure {
				t.Fatalf("exit %d, want %d", code, ExitFailure)
			}
			if out != "" {
				t.Errorf("stdout not empty: %q", out)
			}
			if !strings.Contains(errs, "Error: ") || !strings.Contains(errs, "error(s) in configuration") {
				t.Errorf("stderr lacks a diagnostic:\n%s", errs)
			}
			if !strings.HasSuffix(f, "bad_version.hcl") && !strings.Contains(errs, "on "+f+" line ") {
				t.Errorf("stderr does not name %s and a line:\n%s", f, errs)
			}
		})
	}
}

func TestUsageErrors(t *testing.T) {
	for _, c := range []struct {
		name string
		args []string
		code int
	}{
		{"no args", nil, ExitUsage},
		{"unknown command", []string{"frobnicate"}, ExitUsage},
		{"validate without files", []string{"validate"}, ExitUsage},
		{"render without out", []string{"render", "../../examples/reference.hcl"}, ExitUsage},
		{"missing file", []string{"validate", "/nonexistent.hcl"}, ExitFailure},
		{"bad flag", []string{"render", "--colour"}, ExitUsage},
	} {
		t.Run(c.name, func(t *testing.T) {
			if code, _, _ := run(t, c.args...); code != c.code {
				t.Fatalf("exit %d, want %d", code, c.code)
			}
		})
	}
}

// render writes the same tree twice, byte for byte, and refuses to write
// anything for an invalid config.
func TestRenderDeterministicAndAllOrNothing(t *testing.T) {
	a, b := t.TempDir(), t.TempDir()
	for _, dir := range []string{a, b} {
		if code, _, errs := run(t, "render", "../../examples/reference.hcl", "--out", dir); code != 0 {
			t.Fatalf("render: exit %d\n%s", code, errs)
		}
	}
	n := 0
	filepath.Walk(a, func(p string, info os.FileInfo, err error) error {
		if err != nil || info.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(a, p)
		x, _ := os.ReadFile(p)
		y, err := os.ReadFile(filepath.Join(b, rel))
		if err != nil || !bytes.Equal(x, y) {
			t.Errorf("%s differs between renders", rel)
		}
		n++
		return nil
	})
	if n < 15 {
		t.Fatalf("only %d files rendered", n)
	}
	if _, err := os.Stat(filepath.Join(a, "systemd/system/nixcage-agent@alice.service")); err != nil {
		t.Fatal(err)
	}

	empty := t.TempDir()
	code, _, _ := run(t, "render", "../config/testdata/bad/conflicting_rules.hcl", "--out", empty)
	if code != ExitFailure {
		t.Fatalf("exit %d for invalid config", code)
	}
	if entries, _ := os.ReadDir(empty); len(entries) != 0 {
		t.Fatalf("invalid config wrote %d entries", len(entries))
	}
}

func TestExitErrorUnwraps(t *testing.T) {
	inner := errors.New("x")
	if !errors.Is(&ExitError{Code: 1, Err: inner}, inner) {
		t.Fatal("ExitError does not unwrap")
	}
}

// The reference example allows *.example.org and denies evil.example.org:
// validate accepts it and explains that the deny covers the names below.
func TestValidateExplainsDenyBelow(t *testing.T) {
	code, _, errs := run(t, "validate", "../../examples/reference.hcl")
	if code != ExitOK {
		t.Fatalf("exit %d\n%s", code, errs)
	}
	if !strings.Contains(errs, "Warning: Deny covers the names below it") || !strings.Contains(errs, "x.evil.example.org") || !strings.Contains(errs, `allow "*.example.org"`) {
		t.Fatalf("no explanation of the deny rule:\n%s", errs)
	}
}
