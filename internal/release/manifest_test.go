package release

import (
	"bytes"
	"os"
	"strings"
	"testing"
)

func TestParseManifestGolden(t *testing.T) {
	raw, err := os.ReadFile("testdata/release.json")
	if err != nil {
		t.Fatal(err)
	}
	m, err := ParseManifest(raw)
	if err != nil {
		t.Fatal(err)
	}
	if m.Generation != 7 || len(m.Paths) != 2 || m.Paths[1].HashPart() != "gwx1prm724yw36lxakrjkdpqxkhj8zzy" {
		t.Fatalf("parsed %+v", m)
	}
	again, err := m.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(again, raw) {
		t.Fatalf("Marshal is not canonical:\n%s", again)
	}
	if _, ok := m.Lookup(m.Top); !ok {
		t.Fatal("Lookup(top) failed")
	}
}

func TestParseManifestRejects(t *testing.T) {
	golden, err := os.ReadFile("testdata/release.json")
	if err != nil {
		t.Fatal(err)
	}
	g := string(golden)
	cases := []struct {
		name, old, new, want string
	}{
		{"UnknownField", `"schema": 1,`, `"schema": 1, "extra": true,`, "unknown field"},
		{"FutureSchema", `"schema": 1`, `"schema": 2`, "schema 2 is not supported"},
		{"BadChannel", `"channel": "stable"`, `"channel": "../x"`, "channel \"../x\" is invalid"},
		{"GenerationZero", `"generation": 7`, `"generation": 0`, "generation must be at least 1"},
		{"ExpiresBeforeCreated", `"expires": "2026-02-01T00:00:00Z"`, `"expires": "2025-02-01T00:00:00Z"`, "is not after created"},
		{"TopNotListed", `"top": "/nix/store/c686`, `"top": "/nix/store/d686`, "is not among its paths"},
		{"MissingReference", `"/nix/store/gwx1prm724yw36lxakrjkdpqxkhj8zzy-tool-a"
      ]`, `"/nix/store/gwx1prm724yw36lxakrjkdpqxkhj8zzz-tool-a"
      ]`, "closure incomplete"},
		{"WeakHash", `"sha256:1frag2l4xpf3ir3hsr1y8f35qiqkfcv0kd46n8j7xsrndzvc89x2"`, `"sha1:0000000000000000000000000000000000000000"`, "only sha256"},
		{"ZeroSize", `"narSize": 4096`, `"narSize": 0`, "narSize is 0"},
		{"NotAStorePath", `"path": "/nix/store/gwx1`, `"path": "/etc/store/gwx1`, "mismatching store path prefix"},
		{"TrailingData", "}\n", "}\n{}", "trailing data"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if !strings.Contains(g, tc.old) {
				t.Fatalf("golden lacks %q", tc.old)
			}
			raw := strings.Replace(g, tc.old, tc.new, 1)
			if tc.name == "TrailingData" {
				raw = strings.TrimSuffix(g, "\n") + "\n{}"
			}
			_, err := ParseManifest([]byte(raw))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want it to contain %q", err, tc.want)
			}
		})
	}
}

func FuzzParseManifest(f *testing.F) {
	raw, _ := os.ReadFile("testdata/release.json")
	f.Add(raw)
	f.Add([]byte(`{}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := ParseManifest(b)
		if err == nil {
			if err := m.Validate(); err != nil {
				t.Fatalf("parsed manifest fails Validate: %v", err)
			}
		}
	})
}
