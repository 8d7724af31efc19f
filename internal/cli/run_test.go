package cli

import (
	"bytes"
	"errors"
	"slices"
	"strings"
	"testing"
)

// TestParseRun: the command line of cagectl run, including the bad ones,
// which must exit 2 with a message naming the problem before anything is
// opened or sent.
func TestParseRun(t *testing.T) {
	cases := []struct {
		name  string
		args  []string
		want  string // in the error; "" means it parses
		check func(t *testing.T, s *runSpec)
	}{
		{name: "command after --", args: []string{"--policy", "claude-code", "--", "claude", "--verbose"}, check: func(t *testing.T, s *runSpec) {
			if !slices.Equal(s.req.Command, []string{"claude", "--verbose"}) || s.req.Policy != "claude-code" || s.req.Backend != "nspawn" {
				t.Errorf("parsed %+v", s.req)
			}
		}},
		{name: "allow hosts", args: []string{"--allow", "a.example.com", "--allow", "b.example.com", "--backend", "service", "true"}, check: func(t *testing.T, s *runSpec) {
			if !slices.Equal(s.req.Allow, []string{"a.example.com", "b.example.com"}) || s.req.Backend != "service" {
				t.Errorf("parsed %+v", s.req)
			}
		}},
		{name: "secret default env", args: []string{"--secret", "anthropic=/k", "--", "true"}, check: func(t *testing.T, s *runSpec) {
			if len(s.secrets) != 1 || s.secrets[0] != (secretArg{"anthropic", "ANTHROPIC_API_KEY", "/k"}) {
				t.Errorf("secrets %+v", s.secrets)
			}
		}},
		{name: "secret explicit env", args: []string{"--secret", "gh-token:GH_TOKEN=/k", "--", "true"}, check: func(t *testing.T, s *runSpec) {
			if s.secrets[0] != (secretArg{"gh-token", "GH_TOKEN", "/k"}) {
				t.Errorf("secrets %+v", s.secrets)
			}
		}},
		{name: "binds at /mnt", args: []string{"--bind", "/srv/data:ro", "--bind", "/home/a/notes", "--", "true"}, check: func(t *testing.T, s *runSpec) {
			want := []bindArg{{"/srv/data", "/mnt/data", true}, {"/home/a/notes", "/mnt/notes", false}}
			if !slices.Equal(s.binds, want) {
				t.Errorf("binds %+v", s.binds)
			}
		}},
		{name: "learn", args: []string{"--learn", "--learn-for", "10m", "--", "true"}, check: func(t *testing.T, s *runSpec) {
			if !s.req.Learn || s.req.LearnSeconds != 600 {
				t.Errorf("parsed %+v", s.req)
			}
		}},
		{name: "learn default window", args: []string{"--learn", "--", "true"}, check: func(t *testing.T, s *runSpec) {
			if !s.req.Learn || s.req.LearnSeconds != 0 {
				t.Errorf("parsed %+v", s.req)
			}
		}},
		{name: "learn-for without learn", args: []string{"--learn-for", "10m", "true"}, want: "needs --learn"},
		{name: "learn-for too long", args: []string{"--learn", "--learn-for", "48h", "true"}, want: "use 1m to 24h"},
		{name: "no command", args: []string{"--policy", "none"}, want: "usage: cagectl run"},
		{name: "policy and allow", args: []string{"--policy", "p", "--allow", "x.example.com", "true"}, want: "not both"},
		{name: "unknown backend", args: []string{"--backend", "podman", "true"}, want: "use service or nspawn"},
		{name: "bad name", args: []string{"--name", "Bad_Name", "true"}, want: "not an agent name"},
		{name: "secret without file", args: []string{"--secret", "anthropic", "true"}, want: "NAME=FILE"},
		{name: "bad secret name", args: []string{"--secret", "Anthropic=/k", "true"}, want: "not a secret name"},
		{name: "two binds, one place", args: []string{"--bind", "/a/data", "--bind", "/b/data", "true"}, want: "both appear at /mnt/data"},
		{name: "workspace twice", args: []string{"--workspace", "/x", "--no-workspace", "true"}, want: "not both"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var errb bytes.Buffer
			s, err := parseRun(&Env{Stdio: Stdio{Err: &errb}, Getenv: func(string) string { return "" }}, c.args)
			if c.want == "" {
				if err != nil {
					t.Fatalf("parseRun: %v", err)
				}
				c.check(t, s)
				return
			}
			var ee *ExitError
			if !errors.As(err, &ee) || ee.Code != ExitUsage {
				t.Fatalf("parseRun = %v, want a usage error (exit 2)", err)
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Errorf("error %q does not say %q", err, c.want)
			}
		})
	}
}

// TestRunMissingSecret: a secret file that cannot be opened is named
// before caged is even dialled (there is no bus at this address).
func TestRunMissingSecret(t *testing.T) {
	var out, errb bytes.Buffer
	code := Main(t.Context(), []string{"run", "--bus", "unix:path=/nonexistent/bus", "--no-workspace", "--secret", "anthropic=/nonexistent/key", "--", "true"},
		Stdio{In: strings.NewReader(""), Out: &out, Err: &errb})
	if code != ExitUsage || !strings.Contains(errb.String(), "/nonexistent/key") {
		t.Fatalf("exit %d, stderr %q", code, errb.String())
	}
}
