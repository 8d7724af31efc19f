package config

import (
	"testing"
	"time"
)

// A channel block takes the one default interval, keeps what is written,
// and survives the canonical JSON caged reads.
func TestChannelBlock(t *testing.T) {
	const store = "store {\n  channel = \"stable\"\n  keys = [\"/etc/nixcage/a.pub\"]\n}\n"
	for _, tc := range []struct {
		src  string
		want *Channel
	}{
		{store, nil},
		{store + "channel {\n  url = \"https://r.example.org/stable/\"\n}\n", &Channel{URL: "https://r.example.org/stable/", Interval: DefaultChannelInterval}},
		{store + "channel {\n  url = \"https://r.example.org/s/\"\n  interval = \"2s\"\n  ca_file = \"/etc/nixcage/ca.pem\"\n}\n", &Channel{URL: "https://r.example.org/s/", Interval: 2 * time.Second, CAFile: "/etc/nixcage/ca.pem"}},
		{store + "channel {\n  url = \"/srv/channel\"\n  interval = \"1d\"\n}\n", &Channel{URL: "/srv/channel", Interval: 24 * time.Hour}},
	} {
		cfg, diags := NewLoader().Load(Source{Name: "c.hcl", Data: []byte(tc.src)})
		if diags.HasErrors() {
			t.Fatalf("%q: %v", tc.src, diags)
		}
		if (cfg.Channel == nil) != (tc.want == nil) || (tc.want != nil && *cfg.Channel != *tc.want) {
			t.Fatalf("%q: channel %+v, want %+v", tc.src, cfg.Channel, tc.want)
		}
		again, b := canonicalRoundTrip(t, cfg)
		if (again.Channel == nil) != (tc.want == nil) || (tc.want != nil && *again.Channel != *tc.want) {
			t.Fatalf("round trip changed the channel: %+v -> %+v\n%s", cfg.Channel, again.Channel, b)
		}
	}
}
