package config

import (
	"strings"
	"testing"
)

// The NixOS module writes a metrics block as a JSON array of one object, so
// an empty block (the default listen) survives its null-dropping.
func TestMetricsBlockJSONArray(t *testing.T) {
	cfg, diags := NewLoader().Load(Source{Name: "m.json", Data: []byte(`{"metrics": [{}]}`)})
	if diags.HasErrors() {
		t.Fatal(diags)
	}
	if cfg.Metrics == nil || cfg.Metrics.Listen != DefaultMetricsListen {
		t.Fatalf("metrics = %+v", cfg.Metrics)
	}
}

// Metrics are off without a block, on the one default with an empty block,
// and survive the canonical JSON caged reads.
func TestMetricsBlock(t *testing.T) {
	for _, tc := range []struct{ src, want string }{
		{"", ""},
		{"metrics {}\n", DefaultMetricsListen},
		{"metrics {\n  listen = \"[::1]:9100\"\n}\n", "[::1]:9100"},
		{"metrics {\n  listen = \"unix:/run/nixcage/metrics.sock\"\n}\n", "unix:/run/nixcage/metrics.sock"},
	} {
		cfg, diags := NewLoader().Load(Source{Name: "m.hcl", Data: []byte(tc.src)})
		if diags.HasErrors() {
			t.Fatalf("%q: %v", tc.src, diags)
		}
		got := ""
		if cfg.Metrics != nil {
			got = cfg.Metrics.Listen
		}
		if got != tc.want {
			t.Fatalf("%q: listen %q, want %q", tc.src, got, tc.want)
		}
		again, b := canonicalRoundTrip(t, cfg)
		if (again.Metrics == nil) != (cfg.Metrics == nil) || (cfg.Metrics != nil && *again.Metrics != *cfg.Metrics) {
			t.Fatalf("round trip changed metrics: %+v -> %+v\n%s", cfg.Metrics, again.Metrics, b)
		}
		if tc.want == "" && strings.Contains(string(b), "metrics") {
			t.Fatalf("metrics off but canonical JSON names them:\n%s", b)
		}
	}
}

// canonicalRoundTrip renders cfg as the canonical JSON caged reads and
// loads it again.
func canonicalRoundTrip(t *testing.T, cfg *Config) (*Config, []byte) {
	t.Helper()
	b, err := Canonical(cfg)
	if err != nil {
		t.Fatal(err)
	}
	again, diags := NewLoader().Load(Source{Name: "canonical.json", Data: b})
	if diags.HasErrors() {
		t.Fatalf("canonical JSON does not load: %v\n%s", diags, b)
	}
	return again, b
}
