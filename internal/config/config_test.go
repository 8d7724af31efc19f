package config

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/hcl/v2"
)

func load(t *testing.T, files ...string) (*Config, hcl.Diagnostics) {
	t.Helper()
	return NewLoader().LoadFiles(files...)
}

// Every documented example and every shipped policy is valid as written.
func TestExamplesAndPoliciesValidate(t *testing.T) {
	var files []string
	for _, g := range []string{"../../examples/*.hcl", "../../examples/*.json", "../../policies/*.hcl", "../../docs/examples/*.hcl"} {
		m, _ := filepath.Glob(g)
		files = append(files, m...)
	}
	if len(files) < 5 {
		t.Fatalf("found only %d example files: %v", len(files), files)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			if _, diags := load(t, f); diags.HasErrors() {
				t.Fatalf("%s: %v", f, diags)
			}
		})
	}
}

func TestReferenceModel(t *testing.T) {
	cfg, diags := load(t, "../../examples/reference.hcl")
	if diags.HasErrors() {
		t.Fatal(diags)
	}
	var names []string
	for _, a := range cfg.Agents {
		names = append(names, a.Name+"/"+a.Backend)
	}
	if want := []string{"alice/service", "bob/nspawn", "carol/podman"}; !reflect.DeepEqual(names, want) {
		t.Fatalf("agents = %v, want %v", names, want)
	}
	alice := cfg.Agent("alice")
	if alice.Policy.Name != "web" || !reflect.DeepEqual(alice.Policy.Ports, []int{443}) {
		t.Errorf("alice policy = %+v", alice.Policy)
	}
	if len(alice.Secrets) != 1 || alice.Secrets[0].Header != "Authorization" || alice.Secrets[0].Hosts[0] != "api.example.com" {
		t.Errorf("alice secrets = %+v", alice.Secrets)
	}
	if cfg.Agent("bob").Workspace != "/var/lib/nixcage/agents/bob" {
		t.Errorf("bob workspace default = %q", cfg.Agent("bob").Workspace)
	}
	acct := cfg.Accounts[0]
	if !acct.Covers("alice") || acct.Covers("carol") || acct.Role != RoleOperator {
		t.Errorf("account = %+v", acct)
	}
	if cfg.Store == nil || cfg.Store.Threshold != 1 || cfg.Store.Generations != DefaultGenerations {
		t.Errorf("store = %+v", cfg.Store)
	}
	if want := (Evidence{MaxBytes: 2 << 30, MaxEntries: 200000, MaxDuration: 5 * time.Minute}); cfg.Evidence != want {
		t.Errorf("evidence = %+v, want %+v", cfg.Evidence, want)
	}
}

// A secret named like a shipped policy's credential inherits its hosts and
// header, so using Claude Code takes one line per secret.
func TestBuiltinPolicyCredentialBinding(t *testing.T) {
	src := `agent "c" {
  backend = "service"
  command = ["/bin/true"]
  egress  = "claude-code"
  secret "anthropic" {
    source = "/run/secrets/anthropic"
    env    = "ANTHROPIC_API_KEY"
  }
}`
	cfg, diags := NewLoader().Load(Source{Name: "c.hcl", Data: []byte(src)})
	if diags.HasErrors() {
		t.Fatal(diags)
	}
	s := cfg.Agents[0].Secrets[0]
	if s.Header != "x-api-key" || !reflect.DeepEqual(s.Hosts, []string{"api.anthropic.com"}) {
		t.Fatalf("secret = %+v", s)
	}
	// The shipped policy keeps the key out of Claude Code's telemetry and
	// lets the model API through (issue 11 item 8).
	p := cfg.Agents[0].Policy
	for path, want := range map[string]string{
		"/api/event_logging/batch":                       "http_rule:telemetry",
		"/api/event_logging/v2/batch":                    "http_rule:telemetry",
		"/api/claude_code/metrics":                       "http_rule:telemetry",
		"/api/claude_code/organizations/metrics_enabled": "http_rule:telemetry",
		"/api/eval/sdk-zAZezfDKGoZuXXKe":                 "http_rule:telemetry",
		"/v1/messages":                                   "",
		"/v1/messages/count_tokens":                      "",
	} {
		if d := p.DecideHTTP("api.anthropic.com", "POST", path, path, false); d.Rule != want {
			t.Errorf("claude-code policy, POST %s: rule %q, want %q", path, d.Rule, want)
		}
	}
	if !p.WebSocket {
		t.Error("websocket default is not on")
	}
}

func TestDefaultPolicyDeniesEverything(t *testing.T) {
	cfg, diags := NewLoader().Load(Source{Name: "d.hcl", Data: []byte(`agent "d" {
  backend = "service"
  command = ["/bin/true"]
}`)})
	if diags.HasErrors() {
		t.Fatal(diags)
	}
	if p := cfg.Agents[0].Policy; p.Name != "none" || len(p.Allow) != 0 {
		t.Fatalf("default policy = %+v", p)
	}
}

// The corpus of broken configs: each file names the position and summary
// of the error it must produce.
func TestBrokenConfigs(t *testing.T) {
	files, _ := filepath.Glob("testdata/bad/*")
	n := 0
	for _, f := range files {
		if strings.HasSuffix(f, ".want") {
			continue
		}
		n++
		t.Run(filepath.Base(f), func(t *testing.T) {
			data, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			want := ""
			if strings.HasSuffix(f, ".json") {
				w, err := os.ReadFile(f + ".want")
				if err != nil {
					t.Fatal(err)
				}
				want = strings.TrimSpace(string(w))
			} else {
				first, _, _ := strings.Cut(string(data), "\n")
				want = strings.TrimSpace(strings.TrimPrefix(first, "# want:"))
			}
			pos, summary, _ := strings.Cut(want, " ")
			_, diags := load(t, f)
			if !diags.HasErrors() {
				t.Fatalf("no error; want %q", want)
			}
			for _, d := range diags {
				got := "0:0"
				if d.Subject != nil {
					got = strings.Join([]string{itoa(d.Subject.Start.Line), itoa(d.Subject.Start.Column)}, ":")
					if d.Subject.Filename != f {
						continue
					}
				}
				if got == pos && d.Summary == summary {
					if d.Detail == "" {
						t.Errorf("diagnostic %q has no detail telling how to fix it", d.Summary)
					}
					return
				}
			}
			var got []string
			for _, d := range diags {
				s := d.Summary
				if d.Subject != nil {
					s = d.Subject.String() + " " + s
				}
				got = append(got, s)
			}
			t.Fatalf("want %s %q, got:\n%s", pos, summary, strings.Join(got, "\n"))
		})
	}
	if n < 20 {
		t.Fatalf("only %d broken configs in the corpus", n)
	}
}

func itoa(n int) string {
	return strings.TrimSpace(strings.Repeat(" ", 0) + fmtInt(n))
}

func fmtInt(n int) string {
	if n == 0 {
		return "0"
	}
	var b []byte
	for n > 0 {
		b = append([]byte{byte('0' + n%10)}, b...)
		n /= 10
	}
	return string(b)
}

// The canonical JSON loads back to the same model, and is a fixed point.
func TestCanonicalRoundTrip(t *testing.T) {
	for _, f := range []string{"../../examples/reference.hcl"} {
		cfg, diags := load(t, f)
		if diags.HasErrors() {
			t.Fatal(diags)
		}
		b, err := Canonical(cfg)
		if err != nil {
			t.Fatal(err)
		}
		again, diags := NewLoader().Load(Source{Name: "canonical.json", Data: b})
		if diags.HasErrors() {
			t.Fatalf("canonical JSON does not load: %v\n%s", diags, b)
		}
		if !reflect.DeepEqual(cfg, again) {
			t.Fatalf("round trip changed the model:\n%+v\n%+v", cfg.Agents[0], again.Agents[0])
		}
		b2, _ := Canonical(again)
		if string(b) != string(b2) {
			t.Fatal("canonical output is not a fixed point")
		}
	}
}

func TestMultipleFilesMerge(t *testing.T) {
	l := NewLoader()
	_, diags := l.Load(
		Source{Name: "a.hcl", Data: []byte(`agent "x" {
  backend = "service"
  command = ["/bin/true"]
}`)},
		Source{Name: "b.hcl", Data: []byte(`agent "x" {
  backend = "nspawn"
  command = ["/bin/true"]
}`)})
	if !diags.HasErrors() || !strings.Contains(diags.Error(), "already declared at a.hcl:1") {
		t.Fatalf("want duplicate across files naming a.hcl, got %v", diags)
	}
}

// FuzzLoad: no input makes the loader panic, in either syntax.
func FuzzLoad(f *testing.F) {
	for _, g := range []string{"../../examples/*.hcl", "../../policies/*.hcl", "testdata/bad/*"} {
		m, _ := filepath.Glob(g)
		for _, p := range m {
			if b, err := os.ReadFile(p); err == nil {
				f.Add(b, strings.HasSuffix(p, ".json"))
			}
		}
	}
	f.Fuzz(func(t *testing.T, data []byte, isJSON bool) {
		name := "f.hcl"
		if isJSON {
			name = "f.json"
		}
		cfg, diags := NewLoader().Load(Source{Name: name, Data: data})
		if cfg != nil && diags.HasErrors() {
			t.Fatal("config returned with errors")
		}
		if cfg != nil {
			if _, err := Canonical(cfg); err != nil {
				t.Fatal(err)
			}
		}
	})
}

// An agent without backend runs under the default, the service backend.
func TestBackendDefaultsToService(t *testing.T) {
	cfg, diags := NewLoader().Load(Source{Name: "a.hcl", Data: []byte("agent \"a\" {\n  command = [\"/bin/true\"]\n}\n")})
	if diags.HasErrors() {
		t.Fatal(diags.Error())
	}
	if got := cfg.Agents[0].Backend; got != BackendService {
		t.Errorf("backend = %q, want %q", got, BackendService)
	}
	if b, _ := Canonical(cfg); !strings.Contains(string(b), `"backend": "service"`) {
		t.Errorf("canonical config does not spell the default out:\n%s", b)
	}
}
