package podman

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/coreos/go-systemd/v22/unit"

	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/render"
	"github.com/nixcage/nixcage/internal/testenv"
)

// agent is unique to this test so it never touches a real cage's state.
const agent = "podmancheck"

// TestRenderedPodmanCage runs the rendered nixcage-agent@ ExecStart= with
// real podman on this host: the cage must run as the unit's explicit
// non-root uid range, write its workspace, and have no route out of its
// network namespace. The gateway is not started here (see the report:
// the proxied path is not covered yet).
func TestRenderedPodmanCage(t *testing.T) {
	testenv.RequirePrivileged(t)
	podman := testenv.LookPath(t, "podman")
	testenv.LookPath(t, "runc")
	ip := testenv.LookPath(t, "ip")
	tmpfiles := testenv.LookPath(t, "systemd-tmpfiles")
	if _, err := os.Stat("/usr/bin/curl"); err != nil {
		t.Skip("/usr/bin/curl missing: the cage mounts the host /usr and the agent command needs curl")
	}

	hcl := `
egress_policy "web" {
  allow = ["api.example.com"]
  ports = [443]
}
agent "` + agent + `" {
  backend = "podman"
  command = ["/bin/sh", "-c", "id -u > /workspace/uid && echo ok > /workspace/written && (curl -sS --noproxy '*' --max-time 5 https://1.1.1.1/ || echo direct-blocked > /workspace/direct)"]
  egress  = "web"
}
`
	cfg, diags := config.NewLoader().Load(config.Source{Name: "podman.hcl", Data: []byte(hcl)})
	if diags.HasErrors() {
		t.Fatalf("load: %v", diags)
	}
	o := render.DefaultOptions()
	o.Prefix = t.TempDir()
	o.Podman = podman
	// The cage execs its command through cage-seal from the bin directory,
	// and the ExecStart= wrapper resolves the store binds with cagectl.
	o.BinDir = t.TempDir()
	for _, name := range []string{"cage-seal", "cagectl"} {
		if out, err := exec.Command("go", "build", "-o", filepath.Join(o.BinDir, name), "github.com/nixcage/nixcage/cmd/"+name).CombinedOutput(); err != nil {
			t.Fatalf("go build %s: %v\n%s", name, err, out)
		}
	}
	files, err := render.Render(cfg, o)
	if err != nil {
		t.Fatalf("render: %v", err)
	}
	var unitText []byte
	for _, f := range files {
		p := filepath.Join(o.Prefix, f.Path)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, f.Data, f.Mode); err != nil {
			t.Fatal(err)
		}
		if f.Path == "systemd/system/nixcage-agent@"+agent+".service" {
			unitText = f.Data
		}
	}
	if unitText == nil {
		t.Fatal("no nixcage-agent@" + agent + ".service rendered")
	}
	opts, err := unit.DeserializeOptions(strings.NewReader(string(unitText)))
	if err != nil {
		t.Fatalf("parse unit: %v", err)
	}
	var execStart string
	var env []string
	for _, u := range opts {
		if u.Section != "Service" {
			continue
		}
		switch u.Name {
		case "ExecStart":
			execStart = u.Value
		case "Environment":
			env = append(env, u.Value)
		}
	}
	argv, err := execArgv(execStart)
	if err != nil {
		t.Fatalf("ExecStart=: %v", err)
	}

	// What nixcage-netns@ and nixcage-prep@ would do.
	run := func(name string, args ...string) {
		t.Helper()
		if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
			t.Fatalf("%s %v: %v\n%s", name, args, err, out)
		}
	}
	ns := paths.NetnsName(agent)
	_ = exec.Command(ip, "netns", "delete", ns).Run()
	run(ip, "netns", "add", ns)
	t.Cleanup(func() { _ = exec.Command(ip, "netns", "delete", ns).Run() })
	run(ip, "-n", ns, "link", "set", "lo", "up")
	run(tmpfiles, "--create", filepath.Join(o.Prefix, "tmpfiles.d/nixcage.conf"))

	bin := filepath.Join(t.TempDir(), "cage-egress")
	build := exec.Command("go", "build", "-o", bin, "github.com/nixcage/nixcage/cmd/cage-egress")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build cage-egress: %v\n%s", err, out)
	}
	prep := exec.Command(bin, "prepare", "--config", paths.EgressConfig(o.Prefix, agent))
	prep.Env = append(os.Environ(), "CREDENTIALS_DIRECTORY="+t.TempDir())
	if out, err := prep.CombinedOutput(); err != nil {
		t.Fatalf("cage-egress prepare: %v\n%s", err, out)
	}
	ws := cfg.Agents[0].Workspace
	for _, d := range []string{ws, paths.Runtime(agent), paths.EgressState(agent)} {
		d := d
		t.Cleanup(func() { _ = os.RemoveAll(d) })
	}
	if err := os.MkdirAll(ws, 0o700); err != nil {
		t.Fatal(err)
	}

	// --ulimit=host: the cage gets this process's rlimits (under systemd,
	// the unit's LimitNOFILE=/LimitNPROC=), nothing podman must raise.
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = append(os.Environ(), env...)
	t.Cleanup(func() { _ = exec.Command(podman, "rm", "--force", "--ignore", "nixcage-"+agent).Run() })
	out, err := cmd.CombinedOutput()
	if err != nil {
		if strings.Contains(string(out), "cgroup") {
			t.Skipf("podman cannot create the container's cgroup on this host: %s", out)
		}
		t.Fatalf("rendered podman command: %v\n%s", err, out)
	}
	t.Logf("podman output:\n%s", out)

	read := func(name string) string {
		b, err := os.ReadFile(filepath.Join(ws, name))
		if err != nil {
			t.Fatalf("cage did not write %s: %v", name, err)
		}
		return strings.TrimSpace(string(b))
	}
	if got := read("uid"); got != "0" {
		t.Errorf("uid inside cage = %q, want 0 (mapped)", got)
	}
	if got := read("written"); got != "ok" {
		t.Errorf("workspace file = %q", got)
	}
	if got := read("direct"); got != "direct-blocked" {
		t.Errorf("direct connection not blocked: %q", got)
	}
	fi, err := os.Stat(filepath.Join(ws, "written"))
	if err != nil {
		t.Fatal(err)
	}
	owner := fi.Sys().(*syscall.Stat_t).Uid
	if owner == 0 || owner < 0x70000000 {
		t.Errorf("file written in cage is owned by host uid %d, want the unit's --uidmap range", owner)
	}
	if !strings.Contains(strings.Join(argv, " "), "--uidmap=0:"+strconv.Itoa(int(owner))+":65536") {
		t.Errorf("host owner %d is not the base of the rendered --uidmap", owner)
	}
}
