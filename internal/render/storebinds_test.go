package render

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/systest"
)

// The nspawn and podman wrappers run for real: sh executes the rendered
// script, which runs the real cagectl (built here) on a store laid out as
// apply lays it out, and execs a stand-in container manager that records
// its argv. The binds it gets are the resolved, link-free sources; with
// current/top turned into a link to "/" the wrapper exits 1 and the
// container manager never runs.
func TestStoreBindWrapperRuns(t *testing.T) {
	if testing.Short() {
		t.Skip("builds cagectl")
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "bin")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := systest.Build(t.Context(), "./cmd/cagectl", bin); err != nil {
		t.Fatal(err)
	}
	root := filepath.Join(dir, "store")
	top := "0000000000000000000000000000000a-tools"
	for _, d := range []string{"nix/store/" + top + "/bin", "generations/1"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.Symlink("../../nix/store/"+top, filepath.Join(root, "generations/1/top")))
	must(os.Symlink("generations/1", filepath.Join(root, "current")))
	record := filepath.Join(dir, "argv")
	fake := filepath.Join(dir, "manager")
	must(os.WriteFile(fake, []byte("#!/bin/sh\nprintf '%s\\n' \"$@\" > "+record+"\n"), 0o755))

	r := &renderer{cfg: &config.Config{Store: &config.Store{Root: root}}, o: Options{BinDir: bin}}
	a := &config.Agent{Name: "w"}
	for _, c := range []struct{ backend, want string }{
		{config.BackendNspawn, "--bind-ro=%s"},
		{config.BackendPodman, "--volume=%s:ro"},
	} {
		t.Run(c.backend, func(t *testing.T) {
			run := func() (string, error) {
				os.Remove(record)
				argv := r.storeBindsArgv(a, c.backend, []string{fake}, []string{"--", "agent-cmd"})
				out, err := exec.Command(argv[0], argv[1:]...).CombinedOutput()
				got, _ := os.ReadFile(record)
				return string(got), wrapErr(err, out)
			}
			got, err := run()
			if err != nil {
				t.Fatal(err)
			}
			for _, m := range []string{root + "/nix/store:/nix/store", root + "/nix/store/" + top + ":/nix/tools"} {
				if !strings.Contains(got, strings.Replace(c.want, "%s", m, 1)+"\n") {
					t.Fatalf("the container manager got:\n%s\nwant a bind of %s", got, m)
				}
			}
			if !strings.HasSuffix(got, "--\nagent-cmd\n") {
				t.Fatalf("the agent's command did not come last:\n%s", got)
			}
			must(os.Remove(filepath.Join(root, "generations/1/top")))
			must(os.Symlink("/", filepath.Join(root, "generations/1/top")))
			defer func() {
				must(os.Remove(filepath.Join(root, "generations/1/top")))
				must(os.Symlink("../../nix/store/"+top, filepath.Join(root, "generations/1/top")))
			}()
			got, err = run()
			if err == nil || got != "" || !strings.Contains(err.Error(), "does not resolve inside the store") {
				t.Fatalf("wrapper on a store whose top links to /: err %v, manager ran with %q", err, got)
			}
		})
	}
}

func wrapErr(err error, out []byte) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("%w: %s", err, out)
}

// A service cage gets the store as one bind of the store root and resolves
// /nix/store and /nix/tools itself, through the skeleton's links: no bind
// source systemd follows on the host lies inside the store, and no check
// unit runs before the cage (docs/store.md). checks/system
// TestCagedOnSystemd tampers with a real store under a running caged and
// looks from inside the cage.
func TestServiceStoreView(t *testing.T) {
	cfg := &config.Config{Store: &config.Store{Root: "/srv/store"}, Agents: []*config.Agent{{
		Name: "s", Backend: config.BackendService, Command: []string{"/bin/true"}, Workspace: "/var/lib/nixcage/agents/s",
		Resources: config.Resources{Memory: "1G", Tasks: 64},
	}}}
	r := &renderer{cfg: cfg, o: DefaultOptions()}
	svc := r.serviceBackend(cfg.Agents[0])
	var storeBinds []string
	for _, kv := range svc.opts {
		k, v := kv[0], kv[1]
		if k != "BindReadOnlyPaths" && k != "BindPaths" {
			continue
		}
		src, _, _ := strings.Cut(strings.TrimPrefix(v, "-"), ":")
		if src == "/srv/store" || strings.HasPrefix(src, "/srv/store/") {
			storeBinds = append(storeBinds, v)
		}
	}
	if want := "-/srv/store:" + paths.CageStoreRoot; strings.Join(storeBinds, " ") != want {
		t.Errorf("store binds of the service cage: %q, want only %q", storeBinds, want)
	}
	r.tmpfiles()
	var tmpfiles string
	for _, f := range r.files {
		if f.Path == paths.TmpfilesConf {
			tmpfiles = string(f.Data)
		}
	}
	for _, line := range []string{
		"d " + paths.CageRootfs + paths.CageStoreRoot + " 0755 root root -\n",
		"L+ " + paths.CageRootfs + "/nix/store - - - - .nixcage/nix/store\n",
		"L+ " + paths.CageRootfs + "/nix/tools - - - - .nixcage/current/top\n",
		// podman's skeleton keeps the mount points its binds need.
		"d " + paths.PodmanRootfs + "/nix/tools 0755 root root -\n",
	} {
		if !strings.Contains(tmpfiles, line) {
			t.Errorf("tmpfiles lacks %q:\n%s", line, tmpfiles)
		}
	}
	if strings.Contains(tmpfiles, "d "+paths.CageRootfs+"/nix/tools ") {
		t.Errorf("the service skeleton still makes /nix/tools a directory:\n%s", tmpfiles)
	}
}
