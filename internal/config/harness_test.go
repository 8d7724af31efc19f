package config

import "testing"

// A harness fills in what its CLI needs: the policy, the key's variable and
// header, and its environment under the agent's own.
func TestHarnessScaffold(t *testing.T) {
	src := `agent "c" {
  backend     = "service"
  harness     = "codex"
  command     = ["/nix/tools/bin/codex", "exec", "hi"]
  environment = { LANG = "C.UTF-8" }
  secret "openai" { source = "/run/secrets/openai" }
}
agent "d" {
  backend     = "service"
  harness     = "claude-code"
  command     = ["/nix/tools/bin/claude", "-p", "hi"]
  environment = { DISABLE_TELEMETRY = "0" }
  secret "anthropic" { source = "/run/secrets/anthropic" }
}`
	cfg, diags := NewLoader().Load(Source{Name: "c.hcl", Data: []byte(src)})
	if diags.HasErrors() {
		t.Fatal(diags)
	}
	c, d := cfg.Agent("c"), cfg.Agent("d")
	if c.Harness != "codex" || c.Policy.Name != "codex" || c.Environment["LANG"] != "C.UTF-8" {
		t.Fatalf("codex agent = harness %q policy %q env %v", c.Harness, c.Policy.Name, c.Environment)
	}
	if s := c.Secrets[0]; s.Env != "CODEX_API_KEY" || s.Header != "Authorization" || len(s.Hosts) != 1 || s.Hosts[0] != "api.openai.com" {
		t.Fatalf("codex secret = %+v", s)
	}
	if d.Policy.Name != "claude-code" || d.Secrets[0].Env != "ANTHROPIC_API_KEY" || d.Secrets[0].Header != "x-api-key" {
		t.Fatalf("claude agent = policy %q secret %+v", d.Policy.Name, d.Secrets[0])
	}
	if d.Environment["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] != "1" || d.Environment["DISABLE_TELEMETRY"] != "0" {
		t.Fatalf("claude env = %v: want the harness's under the agent's own", d.Environment)
	}
	// The canonical form keeps the harness and loads back the same.
	doc, err := Canonical(cfg)
	if err != nil {
		t.Fatal(err)
	}
	back, diags := NewLoader().Load(Source{Name: "c.json", Data: doc})
	if diags.HasErrors() {
		t.Fatal(diags)
	}
	if back.Agent("c").Harness != "codex" || back.Agent("c").Secrets[0].Env != "CODEX_API_KEY" {
		t.Fatalf("canonical round trip lost the harness: %s", doc)
	}
}
