package doctor

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/render"
)

const cfgSrc = `
agent "a" {
  command = ["/bin/true"]
  egress_policy {
    allow   = ["api.example.com"]
    inspect = ["api.example.com"]
  }
  secret "api" {
    source = "/etc/secrets/api"
    env    = "API_KEY"
    hosts  = ["api.example.com"]
  }
}
agent "b" {
  backend = "nspawn"
  command = ["/bin/true"]
}
`

func load(t *testing.T, src string) *config.Config {
	t.Helper()
	cfg, diags := config.NewLoader().Load(config.Source{Name: "t.hcl", Data: []byte(src)})
	if diags.HasErrors() {
		t.Fatal(diags.Error())
	}
	return cfg
}

func find(t *testing.T, fl []Finding, check string) Finding {
	t.Helper()
	for _, f := range fl {
		if f.Check == check {
			return f
		}
	}
	t.Fatalf("no finding %q in %+v", check, fl)
	return Finding{}
}

// Secret sources and backend programs, each named with its fix.
func TestConfigChecks(t *testing.T) {
	h := Host{Root: t.TempDir()}
	cfg := load(t, cfgSrc)
	o := render.DefaultOptions()
	fl := h.Config(cfg, o)
	if f := find(t, fl, "agent a: secret api"); f.Level != Fail || !strings.Contains(f.Detail, "/etc/secrets/api does not exist") || !strings.Contains(f.Fix, "create /etc/secrets/api") {
		t.Errorf("missing secret: %+v", f)
	}
	if f := find(t, fl, "agent b: backend nspawn"); f.Level != Fail || !strings.Contains(f.Fix, "systemd-container") {
		t.Errorf("missing nspawn: %+v", f)
	}
	os.MkdirAll(filepath.Join(h.Root, "etc/secrets"), 0o700)
	os.WriteFile(filepath.Join(h.Root, "etc/secrets/api"), nil, 0o600)
	if f := find(t, h.Config(cfg, o), "agent a: secret api"); f.Level != Fail || !strings.Contains(f.Detail, "empty") {
		t.Errorf("empty secret: %+v", f)
	}
	os.WriteFile(filepath.Join(h.Root, "etc/secrets/api"), []byte("sk-x\n"), 0o644)
	os.Chmod(filepath.Join(h.Root, "etc/secrets/api"), 0o644)
	if f := find(t, h.Config(cfg, o), "agent a: secret api"); f.Level != Warn || !strings.Contains(f.Fix, "chmod 0600") {
		t.Errorf("world-readable secret: %+v", f)
	}
	os.Chmod(filepath.Join(h.Root, "etc/secrets/api"), 0o600)
	if f := find(t, h.Config(cfg, o), "agent a: secret api"); f.Level != OK {
		t.Errorf("good secret: %+v", f)
	}
}

// Installed units against the config: all there, one changed, one of an
// agent no longer declared.
func TestUnitsInstalledVsDeclared(t *testing.T) {
	h := Host{Root: t.TempDir()}
	o := render.DefaultOptions()
	cfg := load(t, cfgSrc)
	if f := h.Units(cfg, o); f.Level != Fail || !strings.Contains(f.Detail, "missing or different") {
		t.Errorf("nothing installed: %+v", f)
	}
	files, _ := render.Render(cfg, o)
	etc := filepath.Join(h.Root, "etc")
	render.Write(etc, files)
	if f := h.Units(cfg, o); f.Level != OK {
		t.Errorf("installed as rendered: %+v", f)
	}
	less := load(t, strings.SplitN(cfgSrc, `agent "b"`, 2)[0])
	if f := h.Units(less, o); f.Level != Fail || !strings.Contains(f.Detail, "of undeclared agents (") || !strings.Contains(f.Detail, "nixcage-agent@b.service") || !strings.Contains(f.Fix, "apply-config") {
		t.Errorf("an undeclared agent's units left: %+v", f)
	}
}

func TestStorePermissions(t *testing.T) {
	h := Host{Root: t.TempDir()}
	cfg := load(t, `store {
  root    = "/var/lib/nixcage/store"
  channel = "stable"
  keys    = ["/etc/k.pub"]
}`)
	os.MkdirAll(filepath.Join(h.Root, "var/lib/nixcage/store"), 0o755)
	if f := h.Store(cfg); f.Level != OK && os.Geteuid() == 0 {
		t.Errorf("root-owned 0755 store: %+v", f)
	}
	os.Chmod(filepath.Join(h.Root, "var/lib/nixcage/store"), 0o777)
	if f := h.Store(cfg); f.Level != Fail || !strings.Contains(f.Fix, "chmod go-w") {
		t.Errorf("world-writable store: %+v", f)
	}
	if f := find(t, h.Config(cfg, render.DefaultOptions()), "store key /etc/k.pub"); f.Level != Fail {
		t.Errorf("missing store key: %+v", f)
	}
}

func TestBusPolicy(t *testing.T) {
	h := Host{Root: t.TempDir()}
	if f := h.BusPolicy(); f.Level != Fail || !strings.Contains(f.Fix, "systemctl reload dbus") {
		t.Errorf("no policy: %+v", f)
	}
	os.MkdirAll(filepath.Join(h.Root, "etc/dbus-1/system.d"), 0o755)
	os.WriteFile(filepath.Join(h.Root, "etc/dbus-1/system.d/org.nixcage.cage1.conf"), []byte("<busconfig/>"), 0o644)
	if f := h.BusPolicy(); f.Level != OK {
		t.Errorf("policy installed: %+v", f)
	}
	// NixOS: the policy lives in a store directory system.conf includes.
	h = Host{Root: t.TempDir()}
	store := "/nix/store/x-nixcage-rendered/etc/dbus-1/system.d"
	os.MkdirAll(filepath.Join(h.Root, store), 0o755)
	os.WriteFile(filepath.Join(h.Root, store, "org.nixcage.cage1.conf"), []byte("<busconfig/>"), 0o644)
	os.MkdirAll(filepath.Join(h.Root, "etc/dbus-1"), 0o755)
	os.WriteFile(filepath.Join(h.Root, "etc/dbus-1/system.conf"), []byte("<busconfig><includedir>"+store+"</includedir></busconfig>"), 0o644)
	if f := h.BusPolicy(); f.Level != OK || !strings.Contains(f.Detail, store) {
		t.Errorf("policy in an included directory: %+v", f)
	}
}
