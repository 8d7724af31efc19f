package systest

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestMirrorFromSources(t *testing.T) {
	tests := []struct {
		name, sources, want string
	}{
		{
			name: "deb822 with security first",
			sources: "Types: deb\nURIs: http://deb.debian.org/debian-security\nSuites: bookworm-security\nComponents: main\n\n" +
				"Types: deb\nURIs: http://mirror.example/debian/\nSuites: bookworm bookworm-updates\nComponents: main\n",
			want: "http://mirror.example/debian",
		},
		{
			name:    "one-line with options",
			sources: "# comment\ndeb [arch=amd64 signed-by=/k.gpg] https://mirror.example/debian bookworm main\n",
			want:    "https://mirror.example/debian",
		},
		{
			name:    "other suite only",
			sources: "deb http://deb.debian.org/debian trixie main\n",
			want:    "",
		},
		{
			name:    "deb-src ignored",
			sources: "Types: deb-src\nURIs: http://src.example/debian\nSuites: bookworm\n",
			want:    "",
		},
		{
			name:    "third-party repo for another suite",
			sources: "deb https://packages.example.com/apt cloud-sdk-bookworm main\n",
			want:    "",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := mirrorFromSources(tt.sources); got != tt.want {
				t.Errorf("mirrorFromSources = %q, want %q", got, tt.want)
			}
		})
	}
}

func TestRootfsKeyChangesWithInputs(t *testing.T) {
	a := RootfsKey("http://a.example/debian")
	if b := RootfsKey("http://b.example/debian"); a == b {
		t.Fatal("key ignores the mirror")
	}
	saved := Packages
	t.Cleanup(func() { Packages = saved })
	Packages = append(append([]string{}, saved...), "extra")
	if c := RootfsKey("http://a.example/debian"); a == c {
		t.Fatal("key ignores the package list")
	}
}

func TestShellJoin(t *testing.T) {
	got := shellJoin([]string{"systemd-nspawn", "--machine=x", "-D", "/var/cache/a b", "it's"})
	want := `systemd-nspawn --machine=x -D '/var/cache/a b' 'it'\''s'`
	if got != want {
		t.Fatalf("shellJoin = %s, want %s", got, want)
	}
}

// A cache under /tmp would be built and then be invisible to nspawn (a tmpfs
// covers /tmp where machines boot): refused before anything is built.
func TestCacheUnderTmpRefused(t *testing.T) {
	dir := filepath.Join("/tmp", "nixcage-systest-cache-test-"+filepath.Base(t.TempDir()))
	t.Setenv("NIXCAGE_SYSTEST_CACHE", dir)
	_, err := EnsureRootfs(context.Background(), io.Discard)
	if err == nil || !strings.Contains(err.Error(), "NIXCAGE_SYSTEST_CACHE") || !strings.Contains(err.Error(), "under /tmp") {
		t.Fatalf("EnsureRootfs with the cache in %s: %v", dir, err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("%s was created (%v)", dir, err)
	}
}
