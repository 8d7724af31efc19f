package render

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/harness"
)

// A harness's files are rendered under the agent's config directory and
// bound read-only at their cage paths, in every backend.
func TestHarnessFilesBound(t *testing.T) {
	for _, backend := range []string{"service", "nspawn", "podman"} {
		t.Run(backend, func(t *testing.T) {
			src := `agent "cx" {
  backend = "` + backend + `"
  harness = "codex"
  command = ["/nix/tools/bin/codex", "exec", "hi"]
  secret "openai" { source = "/run/secrets/openai" }
}`
			cfg, diags := config.NewLoader().Load(config.Source{Name: "c.hcl", Data: []byte(src)})
			if diags.HasErrors() {
				t.Fatal(diags)
			}
			o := DefaultOptions()
			dir := renderTo(t, cfg, o)
			unit, err := os.ReadFile(filepath.Join(dir, "systemd/system/nixcage-agent@cx.service"))
			if err != nil {
				t.Fatal(err)
			}
			h, _ := harness.Lookup("codex")
			for cagePath, text := range h.RenderedFiles() {
				rel := "nixcage/agents/cx/harness/" + strings.ReplaceAll(strings.TrimPrefix(cagePath, "/"), "/", "_")
				got, err := os.ReadFile(filepath.Join(dir, rel))
				if err != nil || string(got) != text {
					t.Errorf("%s: %v, content matches: %v", rel, err, string(got) == text)
				}
				src := filepath.Join(o.Prefix, rel)
				if !strings.Contains(string(unit), src+":"+cagePath) {
					t.Errorf("%s is not bound at %s:\n%s", src, cagePath, unit)
				}
			}
		})
	}
}
