package render

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
)

// throwawayAgent is a run's agent as caged validates it.
func throwawayAgent(t *testing.T, backend string) *config.Agent {
	t.Helper()
	src := `agent "run-test" {
  backend   = "` + backend + `"
  command   = ["/bin/sh", "-c", "exec \"$0\" \"$@\"", "claude"]
  autostart = false
  egress    = "claude-code"
  environment = { TERM = "xterm-256color" }
  secret "anthropic" {
    source = "/run/nixcage/runs/run-test/secrets/anthropic"
    env    = "ANTHROPIC_API_KEY"
  }
}`
	cfg, diags := config.NewLoader().Load(config.Source{Name: "run.hcl", Data: []byte(src)})
	if diags.HasErrors() {
		t.Fatal(diags)
	}
	return cfg.Agent("run-test")
}

// TestThrowawayGolden: the files of a throw-away cage per backend, as
// reviewable bytes under testdata/golden/throwaway/BACKEND.
func TestThrowawayGolden(t *testing.T) {
	for _, backend := range []string{config.BackendService, config.BackendNspawn} {
		t.Run(backend, func(t *testing.T) {
			files, err := RenderThrowaway(throwawayAgent(t, backend), nil, DefaultOptions(), Throwaway{
				Prefix: "/run/nixcage/runs/run-test", User: "alice", UID: 1000, GID: 1000, TTY: true, Transient: true,
				Binds: []Bind{{Source: "/home/alice/project", Dest: "/workspace"}, {Source: "/srv/data", Dest: "/mnt/data", ReadOnly: true}},
			})
			if err != nil {
				t.Fatal(err)
			}
			golden := filepath.Join("testdata/golden/throwaway", backend)
			if *update {
				os.RemoveAll(golden)
				if _, err := Write(golden, files); err != nil {
					t.Fatal(err)
				}
			}
			var agent string
			for _, f := range files {
				want, err := os.ReadFile(filepath.Join(golden, f.Path))
				if err != nil || !bytes.Equal(want, f.Data) {
					t.Errorf("%s differs from golden; run go test ./internal/render -update and review the diff", f.Path)
				}
				if strings.HasSuffix(f.Path, "nixcage-agent@run-test.service.d/50-cage.conf") {
					agent = string(f.Data)
				}
				if strings.HasPrefix(f.Path, "etc/") || strings.Contains(f.Path, "@.") {
					t.Errorf("a run must not touch shared files: %s", f.Path)
				}
			}
			for _, want := range []string{"Restart=no", "BindsTo=nixcage-netns@run-test.service", "IPAddressDeny=any"} {
				if !strings.Contains(agent, want) {
					t.Errorf("agent drop-in lacks %s:\n%s", want, agent)
				}
			}
			for _, bad := range []string{"StateDirectory", "PartOf=", "Restart=on-failure"} {
				if strings.Contains(agent, bad) {
					t.Errorf("agent drop-in has %s:\n%s", bad, agent)
				}
			}
			if backend == config.BackendNspawn {
				for _, want := range []string{"--bind=/run/nixcage/binds/0:/workspace:idmap", "--bind-ro=/run/nixcage/binds/1:/mnt/data:idmap", "--user=alice", "--console=interactive", "ProtectHome=tmpfs",
					"TemporaryFileSystem=/run/nixcage/binds:mode=0700,nosuid,nodev", "BindPaths=/home/alice/project:/run/nixcage/binds/0", "BindReadOnlyPaths=/srv/data:/run/nixcage/binds/1"} {
					if !strings.Contains(agent, want) {
						t.Errorf("nspawn drop-in lacks %s", want)
					}
				}
				// nspawn never resolves a caller's path itself: it follows
				// the host's renames and symlinks until nspawn reads it,
				// after caged's check (docs/run.md).
				for _, bad := range []string{":/home/alice/project:", "=/home/alice/project:/workspace", "=/srv/data:/mnt/data"} {
					if strings.Contains(agent, bad) {
						t.Errorf("nspawn drop-in binds a caller's path directly (%s):\n%s", bad, agent)
					}
				}
			} else {
				for _, want := range []string{"BindPaths=/home/alice/project:/workspace", "BindReadOnlyPaths=/srv/data:/mnt/data", "DynamicUser=yes",
					// The skeleton root is what hides the rest of /home (no
					// /home in it; serviceCageHardening).
					"RootDirectory=" + paths.CageRootfs} {
					if !strings.Contains(agent, want) {
						t.Errorf("service drop-in lacks %s", want)
					}
				}
			}
		})
	}
}

func TestCheckBindPath(t *testing.T) {
	for p, ok := range map[string]bool{
		"/home/alice/project": true, "relative": false, "/a/../b": false, "/with space": false,
		"/a:b": false, "/a%i": false, "/a$HOME": false, `/a"b`: false,
	} {
		if err := CheckBindPath(p); (err == nil) != ok {
			t.Errorf("CheckBindPath(%q) = %v, want ok=%v", p, err, ok)
		}
	}
}

// The spare namespace caged starts ahead of a run is byte for byte the
// namespace unit the run's own rendering has (caged then leaves it as it
// is), and has nothing that would stop it while no unit needs it yet.
func TestThrowawayNetnsIsTheRunsOwn(t *testing.T) {
	spare, err := ThrowawayNetns(DefaultOptions(), "run-test")
	if err != nil {
		t.Fatal(err)
	}
	for _, backend := range []string{config.BackendService, config.BackendNspawn} {
		files, err := RenderThrowaway(throwawayAgent(t, backend), nil, DefaultOptions(), Throwaway{Prefix: "/run/nixcage/runs/run-test", User: "alice", UID: 1000, GID: 1000, Transient: true})
		if err != nil {
			t.Fatal(err)
		}
		found := false
		for _, f := range files {
			if f.Path == spare.Path {
				found = true
				if !bytes.Equal(f.Data, spare.Data) || f.Mode != spare.Mode {
					t.Errorf("%s: the run's %s differs from the spare's:\n%s\n---\n%s", backend, f.Path, f.Data, spare.Data)
				}
			}
		}
		if !found {
			t.Errorf("%s: the run has no %s", backend, spare.Path)
		}
	}
	if strings.Contains(string(spare.Data), "StopWhenUnneeded") || !strings.Contains(string(spare.Data), "ip netns add nixcage-%i") {
		t.Errorf("spare namespace unit:\n%s", spare.Data)
	}
}
