package render

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nixcage/nixcage/internal/config"
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

// The service backend's bind check runs in a root of its own: an empty
// per-start directory with the programs and the store root at their host
// paths (so its refusals name the host path) and nothing else of the host.
func TestBindCheckRoot(t *testing.T) {
	root := []string{"RuntimeDirectory", "nixcage/binds/%i", "RootDirectory", "/run/nixcage/binds/%i", "BindReadOnlyPaths", "/usr"}
	for _, c := range []struct {
		bindir, store string
		want          []string
	}{
		{"/usr/local/bin", "/var/lib/nixcage/store", []string{"BindReadOnlyPaths", "-/var/lib/nixcage/store"}},
		{"/nix/store/0000000000000000000000000000000a-nixcage/bin", "/srv/nixcage/store", []string{
			"BindReadOnlyPaths", "/nix/store", "BindReadOnlyPaths", "-/srv/nixcage/store"}},
		{"/opt/nixcage/bin", "/opt/nixcage/store", []string{
			"BindReadOnlyPaths", "/opt/nixcage/bin", "BindReadOnlyPaths", "-/opt/nixcage/store"}},
	} {
		o := DefaultOptions()
		o.BinDir = c.bindir
		r := &renderer{cfg: &config.Config{Store: &config.Store{Root: c.store}}, o: o}
		want := append(append([]string{}, root...), c.want...)
		if got := r.bindCheckRoot(); strings.Join(got, "\n") != strings.Join(want, "\n") {
			t.Errorf("bindir %s, store %s:\n got %q\nwant %q", c.bindir, c.store, got, want)
		}
	}
}
