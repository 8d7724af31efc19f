package nixeval

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/nixcage/nixcage/internal/testenv"
)

// DefaultLib is where a machine keeps a checkout of nix-community/nixpkgs.lib
// when NIXPKGS_LIB is not set (CI's network cannot fetch it, so the copy is
// made once by hand, see docs/nixos.md and docs/testing.md).
const DefaultLib = "/var/cache/nixcage/nixpkgs-lib"

// repoRoot is the module root, two levels up from this package.
var repoRoot = func() string {
	wd, err := os.Getwd()
	if err != nil {
		panic(err)
	}
	return filepath.Clean(filepath.Join(wd, "..", ".."))
}()

// nixpkgsLib returns the nixpkgs lib checkout. Without one the tests skip,
// whatever tier is on: no install script can provide it on a machine
// without GitHub access. A NIXPKGS_LIB that names something else is a
// mistake of the caller and fails.
func nixpkgsLib(t *testing.T) string {
	t.Helper()
	dir := os.Getenv("NIXPKGS_LIB")
	if dir == "" {
		if _, err := os.Stat(filepath.Join(DefaultLib, "lib", "default.nix")); err != nil {
			testenv.MachineLacks(t, "a nixpkgs lib checkout (NIXPKGS_LIB is unset and "+DefaultLib+" has no lib/default.nix)",
				"set NIXPKGS_LIB to a checkout of github:nix-community/nixpkgs.lib (or of nixpkgs), or put one at "+DefaultLib+", to evaluate the NixOS module")
		}
		dir = DefaultLib
	}
	if _, err := os.Stat(filepath.Join(dir, "lib", "default.nix")); err != nil {
		t.Fatalf("NIXPKGS_LIB=%s has no lib/default.nix: point it at a checkout of nix-community/nixpkgs.lib, or unset it to skip these tests", dir)
	}
	// Debian's single-user Nix sets up /nix/var/nix/profiles/per-user on
	// every evaluation, which only root may do there.
	if os.Geteuid() != 0 && syscall.Access("/nix/var/nix/profiles/per-user", 2 /* W_OK */) != nil {
		testenv.RequireRoot(t, "nix-instantiate needs to write /nix/var/nix/profiles/per-user, which Debian's single-user Nix (nix-bin) lets only root do")
	}
	return dir
}

// result is what eval.nix returns for one module.
type result struct {
	Enable          bool            `json:"enable"`
	Model           json.RawMessage `json:"model"`
	Failed          []failure       `json:"failed"`
	CheckIDs        []string        `json:"checkIds"`
	NixOSAssertions int             `json:"nixosAssertions"`
	ConfigFile      *string         `json:"configFile"`
	Glue            struct {
		Script           string                     `json:"script"`
		SystemdPackages  []string                   `json:"systemdPackages"`
		TmpfilesPackages []string                   `json:"tmpfilesPackages"`
		DBusPackages     []string                   `json:"dbusPackages"`
		Etc              map[string]string          `json:"etc"`
		Targets          map[string]json.RawMessage `json:"targets"`
	} `json:"glue"`
}

type failure struct {
	ID      string `json:"id"`
	Message string `json:"message"`
}

func nixEval(t *testing.T, expr string) []byte {
	t.Helper()
	ni := testenv.LookPath(t, "nix-instantiate")
	cmd := exec.Command(ni, "--eval", "--strict", "--json", "--expr", expr)
	cmd.Dir = repoRoot
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("nix-instantiate --eval %s: %v\n%s", expr, err, stderr.String())
	}
	return out
}

// evalModule evaluates services.nixcage with file (relative to the repo) as
// the user's configuration.
func evalModule(t *testing.T, lib, file string) result {
	t.Helper()
	expr := fmt.Sprintf("import ./checks/nixeval/eval.nix { lib = import %s/lib; module = ./%s; }", lib, file)
	var r result
	if err := json.Unmarshal(nixEval(t, expr), &r); err != nil {
		t.Fatalf("eval %s: %v", file, err)
	}
	return r
}

var (
	buildOnce sync.Once
	binDir    string
	buildErr  error
)

// cagectl builds cmd/cagectl once per test binary; it is the same program
// the NixOS build runs.
func cagectl(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		binDir, buildErr = os.MkdirTemp("", "nixeval-bin-")
		if buildErr != nil {
			return
		}
		cmd := exec.Command(goTool(), "build", "-o", filepath.Join(binDir, "cagectl"), "./cmd/cagectl")
		cmd.Dir = repoRoot
		if out, err := cmd.CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("go build ./cmd/cagectl: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return filepath.Join(binDir, "cagectl")
}

func TestMain(m *testing.M) {
	code := m.Run()
	if binDir != "" {
		os.RemoveAll(binDir)
	}
	os.Exit(code)
}

func goTool() string {
	if p, err := exec.LookPath("go"); err == nil {
		return p
	}
	return "/usr/local/go/bin/go"
}

// writeModel writes the module's JSON the way pkgs.formats.json does
// (indented), under the name the loader needs (.json).
func writeModel(t *testing.T, dir string, model json.RawMessage) string {
	t.Helper()
	var buf bytes.Buffer
	if err := json.Indent(&buf, model, "", "  "); err != nil {
		t.Fatalf("model is not JSON: %v", err)
	}
	p := filepath.Join(dir, "nixcage.json")
	if err := os.WriteFile(p, append(buf.Bytes(), '\n'), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func run(t *testing.T, name string, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(name, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.String(), err
}

// storeRef matches the stand-in store paths eval.nix hands the glue.
var storeRef = regexp.MustCompile(`/nix/store/0{32}-([a-z0-9.-]+)`)

// runGlue runs the render derivation's builder script as the Nix build
// would: fake store paths become real files, $out a temporary directory,
// cagectl the one just built. It returns $out.
func runGlue(t *testing.T, r result, source string) (string, string, error) {
	t.Helper()
	cagectl(t)
	out := t.TempDir()
	script := storeRef.ReplaceAllStringFunc(r.Glue.Script, func(m string) string {
		switch name := storeRef.FindStringSubmatch(m)[1]; name {
		case "nixcage.json":
			return source
		default:
			return "/nix/store/fake-" + name // paths written into units only
		}
	})
	cmd := exec.Command("bash", "-euo", "pipefail", "-c", script)
	cmd.Env = append(os.Environ(), "out="+out, "PATH="+binDir+":"+os.Getenv("PATH"))
	b, err := cmd.CombinedOutput()
	return out, string(b), err
}

// tree reads every file and symlink under dir, keyed by relative path.
func tree(t *testing.T, dir string) map[string]string {
	t.Helper()
	files := map[string]string{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		if d.Type()&fs.ModeSymlink != 0 {
			l, err := os.Readlink(p)
			files[rel] = "-> " + l
			return err
		}
		b, err := os.ReadFile(p)
		files[rel] = string(b)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return files
}

func diffTrees(t *testing.T, what string, got, want map[string]string) {
	t.Helper()
	var keys []string
	for k := range got {
		keys = append(keys, k)
	}
	for k := range want {
		if _, ok := got[k]; !ok {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	for _, k := range keys {
		g, gok := got[k]
		w, wok := want[k]
		switch {
		case !gok:
			t.Errorf("%s: %s missing", what, k)
		case !wok:
			t.Errorf("%s: %s unexpected", what, k)
		case g != w:
			t.Errorf("%s: %s differs:\n--- nix\n%s\n--- hcl\n%s", what, k, g, w)
		}
	}
}

func nixFiles(t *testing.T, dir string) []string {
	t.Helper()
	m, err := filepath.Glob(filepath.Join(repoRoot, dir, "*.nix"))
	if err != nil || len(m) == 0 {
		t.Fatalf("no .nix files in %s (%v)", dir, err)
	}
	for i := range m {
		m[i], _ = filepath.Rel(repoRoot, m[i])
	}
	return m
}

// The documented NixOS examples evaluate without failed assertions, their
// JSON passes cagectl validate, and where an HCL twin exists both render
// to byte-identical trees: the Nix front door adds no second meaning.
func TestExamples(t *testing.T) {
	lib := nixpkgsLib(t)
	// checks/nixeval/testdata/twins holds pairs that use every option.
	files := append(nixFiles(t, "examples/nixos"), nixFiles(t, "checks/nixeval/testdata/twins")...)
	for _, file := range files {
		name := strings.TrimSuffix(filepath.Base(file), ".nix")
		t.Run(name, func(t *testing.T) {
			r := evalModule(t, lib, file)
			if !r.Enable {
				t.Errorf("example does not set services.nixcage.enable")
			}
			for _, f := range r.Failed {
				t.Errorf("assertion %s fails: %s", f.ID, f.Message)
			}
			if r.NixOSAssertions == 0 {
				t.Errorf("no NixOS assertions were wired from services.nixcage.checks")
			}
			dir := t.TempDir()
			src := writeModel(t, dir, r.Model)
			if out, err := run(t, cagectl(t), "validate", src); err != nil {
				t.Fatalf("cagectl validate on the module's JSON: %v\n%s", err, out)
			}

			twin := ""
			for _, c := range []string{"examples/" + name + ".hcl", "docs/examples/" + name + ".hcl", strings.TrimSuffix(file, ".nix") + ".hcl"} {
				if _, err := os.Stat(filepath.Join(repoRoot, c)); err == nil {
					twin = filepath.Join(repoRoot, c)
				}
			}
			if twin == "" {
				t.Fatalf("no HCL twin examples/%s.hcl or docs/examples/%s.hcl to compare with", name, name)
			}
			render := func(in, out string) map[string]string {
				args := []string{"render", in, "--out", out, "--prefix", "/etc", "--bindir", "/nix/store/x-nixcage/bin"}
				if o, err := run(t, cagectl(t), args...); err != nil {
					t.Fatalf("cagectl render %s: %v\n%s", in, err, o)
				}
				return tree(t, out)
			}
			diffTrees(t, name, render(src, filepath.Join(dir, "nix")), render(twin, filepath.Join(dir, "hcl")))
		})
	}
}

// The glue's builder script, run for real: validate, render, and the
// reshaping NixOS needs (.wants/ into a drop-in, tmpfiles under lib/).
func TestRenderDerivation(t *testing.T) {
	lib := nixpkgsLib(t)
	r := evalModule(t, lib, "examples/nixos/reference.nix")
	src := writeModel(t, t.TempDir(), r.Model)
	out, log, err := runGlue(t, r, src)
	if err != nil {
		t.Fatalf("builder script failed: %v\n%s", err, log)
	}
	files := tree(t, out)
	for _, want := range []string{
		"etc/systemd/system/nixcage-caged.service",
		"etc/systemd/system/nixcage-agent@alice.service",
		"etc/systemd/system/cage-egress@alice.service.d/50-credentials.conf",
		"etc/nixcage/nixcage.json",
		"etc/nixcage/agents/alice/egress.json",
		"etc/dbus-1/system.d/org.nixcage.cage1.conf",
		"lib/tmpfiles.d/nixcage.conf",
	} {
		if _, ok := files[want]; !ok {
			t.Errorf("rendered tree lacks %s", want)
		}
	}
	for f := range files {
		if strings.Contains(f, ".wants/") || strings.HasPrefix(f, "etc/tmpfiles.d/") {
			t.Errorf("%s left in the tree; NixOS would ignore it", f)
		}
	}
	dropin := files["etc/systemd/system/nixcage.target.d/50-autostart.conf"]
	for _, a := range []string{"alice", "bob", "carol"} {
		if !strings.Contains(dropin, "Wants=nixcage-agent@"+a+".service\n") {
			t.Errorf("autostart drop-in does not want %s:\n%s", a, dropin)
		}
	}
	unit := files["etc/systemd/system/nixcage-agent@carol.service"]
	if !strings.Contains(unit, "/nix/store/fake-podman/bin/podman") {
		t.Errorf("carol's unit does not run virtualisation.podman.package's podman:\n%s", unit)
	}
	if !strings.Contains(files["etc/systemd/system/nixcage-netns@.service"], "/nix/store/fake-iproute2/bin/ip netns add") {
		t.Errorf("netns unit does not use pkgs.iproute2")
	}
	if !strings.Contains(files["etc/systemd/system/nixcage-caged.service"], "/nix/store/fake-nixcage/bin/caged") {
		t.Errorf("caged unit does not run the packaged caged")
	}

	for name, pkgs := range map[string][]string{"systemd.packages": r.Glue.SystemdPackages, "systemd.tmpfiles.packages": r.Glue.TmpfilesPackages, "services.dbus.packages": r.Glue.DBusPackages} {
		if len(pkgs) != 1 || pkgs[0] != "nixcage-rendered" {
			t.Errorf("%s = %v, want the rendered tree", name, pkgs)
		}
	}
	for etc, src := range r.Glue.Etc {
		rel := storeRef.ReplaceAllString(src, "")
		if _, ok := files[strings.TrimPrefix(rel, "/")]; !ok && !isDir(filepath.Join(out, rel)) {
			t.Errorf("environment.etc.%q points at %s, which the build does not produce", etc, rel)
		}
	}
	// The reference example declares a relay: its runtime document too;
	// every render records its options (turns, docs/relay.md).
	if _, ok := r.Glue.Etc["nixcage/relay.json"]; len(r.Glue.Etc) != 4 || !ok {
		t.Errorf("environment.etc = %v, want nixcage/nixcage.json, nixcage/agents, nixcage/render-options.json and nixcage/relay.json", r.Glue.Etc)
	}
	if string(r.Glue.Targets["nixcage"]) != `{"wantedBy":["multi-user.target"]}` {
		t.Errorf("systemd.targets.nixcage = %s, want wantedBy multi-user.target", r.Glue.Targets["nixcage"])
	}
}

func isDir(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.IsDir()
}

// configFile goes through the same derivation and renders what the
// declared reference does.
func TestConfigFile(t *testing.T) {
	lib := nixpkgsLib(t)
	r := evalModule(t, lib, "checks/nixeval/testdata/good/config-file.nix")
	if len(r.Failed) != 0 || r.ConfigFile == nil {
		t.Fatalf("config-file example: failed=%v configFile=%v", r.Failed, r.ConfigFile)
	}
	hcl := filepath.Join(repoRoot, "examples/reference.hcl")
	// Evaluation copied the file into the store; run the script on the
	// checkout's copy (same bytes).
	re := regexp.MustCompile(`/nix/store/[a-z0-9]{32}-reference\.hcl`)
	if !re.MatchString(r.Glue.Script) {
		t.Fatalf("script does not validate the configFile:\n%s", r.Glue.Script)
	}
	r.Glue.Script = re.ReplaceAllString(r.Glue.Script, hcl)
	fromFile, log, err := runGlue(t, r, "")
	if err != nil {
		t.Fatalf("builder script failed: %v\n%s", err, log)
	}
	decl := evalModule(t, lib, "examples/nixos/reference.nix")
	fromDecl, log, err := runGlue(t, decl, writeModel(t, t.TempDir(), decl.Model))
	if err != nil {
		t.Fatalf("builder script failed: %v\n%s", err, log)
	}
	diffTrees(t, "configFile vs options", tree(t, fromFile), tree(t, fromDecl))
}

// Declarations the Nix assertions let through but the Go schema rejects
// fail the build in the derivation, with the Go diagnostic.
func TestGoDiagnosticsFailTheBuild(t *testing.T) {
	lib := nixpkgsLib(t)
	for _, file := range nixFiles(t, "checks/nixeval/testdata/gobad") {
		name := strings.TrimSuffix(filepath.Base(file), ".nix")
		t.Run(name, func(t *testing.T) {
			want := wantLine(t, file)
			r := evalModule(t, lib, file)
			if len(r.Failed) != 0 {
				t.Fatalf("meant to pass the Nix assertions, but: %v", r.Failed)
			}
			src := writeModel(t, t.TempDir(), r.Model)
			_, log, err := runGlue(t, r, src)
			if err == nil {
				t.Fatalf("build succeeded; want it to fail with %q", want)
			}
			if !strings.Contains(log, want) || !strings.Contains(log, "nixcage.json line ") {
				t.Errorf("build log lacks %q with a file:line position:\n%s", want, log)
			}
		})
	}
}

// Valid declarations beyond the examples.
func TestGoodDeclarations(t *testing.T) {
	lib := nixpkgsLib(t)
	cases := map[string]func(t *testing.T, r result, model map[string]any){
		"settings": func(t *testing.T, r result, model map[string]any) {
			a := model["agent"].(map[string]any)["a"].(map[string]any)
			if a["autostart"] != false || a["tools"] != "claude-1.0" {
				t.Errorf("settings not merged over the options: %v", a)
			}
		},
		"empty": func(t *testing.T, r result, model map[string]any) {
			if len(model) != 1 || model["version"] != 1.0 {
				t.Errorf("empty declaration renders %v, want only version", model)
			}
		},
		"default-backend": func(t *testing.T, r result, model map[string]any) {
			if a := model["agent"].(map[string]any)["a"].(map[string]any); a["backend"] != nil {
				t.Errorf("an unset backend reaches the model as %v; the Go default must decide", a["backend"])
			}
		},
		"metrics-default": func(t *testing.T, r result, model map[string]any) {
			if m, ok := model["metrics"].([]any); !ok || len(m) != 1 || len(m[0].(map[string]any)) != 0 {
				t.Errorf("metrics = { } renders %v, want one empty block", model["metrics"])
			}
			dir := t.TempDir()
			src := writeModel(t, dir, r.Model)
			if o, err := run(t, cagectl(t), "render", src, "--out", filepath.Join(dir, "out")); err != nil {
				t.Fatalf("cagectl render: %v\n%s", err, o)
			}
			b, _ := os.ReadFile(filepath.Join(dir, "out", "nixcage", "nixcage.json"))
			if !strings.Contains(string(b), `"listen": "127.0.0.1:9477"`) {
				t.Errorf("the rendered config does not serve metrics on the default address:\n%s", b)
			}
		},
		"learn-approval": func(t *testing.T, r result, model map[string]any) {
			a := model["agent"].(map[string]any)["a"].(map[string]any)
			if ap, ok := a["approval"].([]any); !ok || len(ap) != 1 || a["learn"] != true || a["learn_for"] != "10m" {
				t.Errorf("learn and approval render %v", a)
			}
		},
		"turns": func(t *testing.T, r result, model map[string]any) {
			a := model["agent"].(map[string]any)["helper"].(map[string]any)
			if fmt.Sprint(a["turn_command"]) != "[/workspace/bin/turn --once]" || a["turn_timeout"] != "90s" {
				t.Errorf("turnCommand and turnTimeout render %v", a)
			}
		},
		"config-file":      func(t *testing.T, r result, model map[string]any) {},
		"wildcard-inspect": func(t *testing.T, r result, model map[string]any) {},
	}
	for _, file := range nixFiles(t, "checks/nixeval/testdata/good") {
		name := strings.TrimSuffix(filepath.Base(file), ".nix")
		check, ok := cases[name]
		if !ok {
			t.Errorf("%s has no case in TestGoodDeclarations", file)
			continue
		}
		t.Run(name, func(t *testing.T) {
			r := evalModule(t, lib, file)
			for _, f := range r.Failed {
				t.Errorf("assertion %s fails: %s", f.ID, f.Message)
			}
			var model map[string]any
			if err := json.Unmarshal(r.Model, &model); err != nil {
				t.Fatal(err)
			}
			check(t, r, model)
			if r.ConfigFile != nil {
				return
			}
			src := writeModel(t, t.TempDir(), r.Model)
			if out, err := run(t, cagectl(t), "validate", src); err != nil {
				t.Errorf("cagectl validate: %v\n%s", err, out)
			}
		})
	}
}

// assertIDs lists the ids asserts.nix declares.
func assertIDs(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot, "nixos-modules/asserts.nix"))
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, m := range regexp.MustCompile(`\bid = "([a-z-]+)";`).FindAllStringSubmatch(string(b), -1) {
		ids = append(ids, m[1])
	}
	if len(ids) == 0 {
		t.Fatal("no assertion ids found in nixos-modules/asserts.nix")
	}
	return ids
}

func wantLine(t *testing.T, file string) string {
	t.Helper()
	f, err := os.Open(filepath.Join(repoRoot, file))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if w, ok := strings.CutPrefix(s.Text(), "# want: "); ok {
			return w
		}
	}
	t.Fatalf("%s has no '# want: ' line", file)
	return ""
}

// Every assertion fires on the declaration written to trip it, and only
// that one, with a message naming the option and the fix.
func TestAssertionsTrip(t *testing.T) {
	lib := nixpkgsLib(t)
	ids := assertIDs(t)
	for _, id := range ids {
		t.Run(id, func(t *testing.T) {
			file := "checks/nixeval/testdata/trip/" + id + ".nix"
			if _, err := os.Stat(filepath.Join(repoRoot, file)); err != nil {
				t.Fatalf("assertion %q has no declaration that trips it: add %s", id, file)
			}
			want := wantLine(t, file)
			r := evalModule(t, lib, file)
			if len(r.Failed) != 1 || r.Failed[0].ID != id {
				t.Fatalf("failed assertions = %v, want exactly %q", r.Failed, id)
			}
			if msg := r.Failed[0].Message; !strings.Contains(msg, want) {
				t.Errorf("message %q\nlacks %q", msg, want)
			}
		})
	}
	// And no trip file outlives its assertion.
	for _, file := range nixFiles(t, "checks/nixeval/testdata/trip") {
		id := strings.TrimSuffix(filepath.Base(file), ".nix")
		found := false
		for _, x := range ids {
			found = found || x == id
		}
		if !found {
			t.Errorf("%s trips no assertion declared in asserts.nix", file)
		}
	}
}

// The flake, evaluated with a stand-in nixpkgs around the real lib: every
// checks/vm/*.nix and examples/nixos/*.nix becomes a check, and the package
// gets nix/vendor.json's vendorHash.
func TestFlakeOutputs(t *testing.T) {
	lib := nixpkgsLib(t)
	expr := fmt.Sprintf(`
let
  lib = import %s/lib;
  pkgs = {
    stdenv.hostPlatform.system = "x86_64-linux";
    callPackage = f: args: import f ({ inherit lib; buildGoModule = a: a // { type = "derivation"; }; installShellFiles = { }; } // args);
    testers.runNixOSTest = t: { type = "derivation"; name = t.name; };
  };
  nixpkgs = {
    lib = lib // { nixosSystem = _: throw "not evaluated here"; };
    legacyPackages = lib.genAttrs [ "x86_64-linux" "aarch64-linux" ] (_: pkgs);
  };
  flake = import ./flake.nix;
  self = flake.outputs { inherit self nixpkgs; };
  sys = "x86_64-linux";
in {
  inputs = flake.inputs.nixpkgs.url;
  checks = builtins.attrNames self.checks.${sys};
  vmNames = lib.mapAttrs (_: c: c.name) (lib.filterAttrs (n: _: lib.hasPrefix "vm-" n) self.checks.${sys});
  vendorHash = self.packages.${sys}.default.vendorHash;
  pname = self.packages.${sys}.default.pname;
  overlay = builtins.isFunction self.overlays.default;
  module = builtins.isFunction self.nixosModules.default;
  outputs = builtins.attrNames self;
}`, lib)
	var got struct {
		Inputs     string
		Checks     []string
		VMNames    map[string]string
		VendorHash string
		Pname      string
		Overlay    bool
		Module     bool
		Outputs    []string
	}
	if err := json.Unmarshal(nixEval(t, expr), &got); err != nil {
		t.Fatal(err)
	}
	for _, out := range []string{"checks", "devShells", "formatter", "nixosModules", "overlays", "packages"} {
		if !contains(got.Outputs, out) {
			t.Errorf("flake has no %s output (has %v)", out, got.Outputs)
		}
	}
	if !got.Overlay || !got.Module {
		t.Errorf("overlays.default function=%v, nixosModules.default function=%v", got.Overlay, got.Module)
	}
	var want []string
	want = append(want, "package")
	for _, f := range nixFiles(t, "checks/vm") {
		want = append(want, "vm-"+strings.TrimSuffix(filepath.Base(f), ".nix"))
	}
	for _, f := range nixFiles(t, "examples/nixos") {
		want = append(want, "example-"+strings.TrimSuffix(filepath.Base(f), ".nix"))
	}
	sort.Strings(want)
	if strings.Join(got.Checks, " ") != strings.Join(want, " ") {
		t.Errorf("checks = %v\nwant %v", got.Checks, want)
	}
	for check, name := range got.VMNames {
		if "vm-"+name != check {
			t.Errorf("%s: test name %q, want it to match its file name", check, name)
		}
	}
	var vendor struct{ VendorHash string }
	b, err := os.ReadFile(filepath.Join(repoRoot, "nix/vendor.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &vendor); err != nil {
		t.Fatal(err)
	}
	if got.VendorHash != vendor.VendorHash || got.Pname != "nixcage" {
		t.Errorf("package vendorHash=%q pname=%q, want %q nixcage", got.VendorHash, got.Pname, vendor.VendorHash)
	}
	if !strings.HasPrefix(got.Inputs, "github:NixOS/nixpkgs/nixos-") {
		t.Errorf("nixpkgs input %q is not a NixOS release branch", got.Inputs)
	}
}

// flake.lock pins the same branch flake.nix names, at a full revision with
// a NAR hash.
func TestFlakeLock(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(repoRoot, "flake.lock"))
	if errors.Is(err, fs.ErrNotExist) {
		// The package's own build (nix/package.nix) leaves the Nix files out.
		t.Skip("no flake.lock in this source tree")
	}
	if err != nil {
		t.Fatal(err)
	}
	var lock struct {
		Nodes map[string]struct {
			Locked   map[string]any
			Original map[string]any
		}
		Root string
	}
	if err := json.Unmarshal(b, &lock); err != nil {
		t.Fatal(err)
	}
	n := lock.Nodes["nixpkgs"]
	if !regexp.MustCompile(`^[0-9a-f]{40}$`).MatchString(fmt.Sprint(n.Locked["rev"])) ||
		!regexp.MustCompile(`^sha256-[A-Za-z0-9+/]{43}=$`).MatchString(fmt.Sprint(n.Locked["narHash"])) {
		t.Errorf("nixpkgs lock %v lacks a full rev or SRI narHash", n.Locked)
	}
	flake, err := os.ReadFile(filepath.Join(repoRoot, "flake.nix"))
	if err != nil {
		t.Fatal(err)
	}
	ref := fmt.Sprint(n.Original["ref"])
	if !bytes.Contains(flake, []byte(`"github:NixOS/nixpkgs/`+ref+`"`)) {
		t.Errorf("flake.lock pins ref %q, which flake.nix's nixpkgs input does not name", ref)
	}
}

// nix/vendor.json's vendorHash is the NAR hash of the vendor tree go.mod
// and go.sum produce now.
func TestVendorHash(t *testing.T) {
	nix := testenv.LookPath(t, "nix")
	b, err := os.ReadFile(filepath.Join(repoRoot, "nix/vendor.json"))
	if err != nil {
		t.Fatal(err)
	}
	var vendor struct{ VendorHash, GoSum string }
	if err := json.Unmarshal(b, &vendor); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "vendor")
	cmd := exec.Command(goTool(), "mod", "vendor", "-o", dir)
	cmd.Dir = repoRoot
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go mod vendor: %v\n%s", err, out)
	}
	out, err := exec.Command(nix, "--extra-experimental-features", "nix-command", "hash", "path", dir).Output()
	if err != nil {
		t.Fatalf("nix hash path: %v", err)
	}
	got := strings.TrimSpace(string(out))
	sum, err := exec.Command("sha256sum", filepath.Join(repoRoot, "go.sum")).Output()
	if err != nil {
		t.Fatal(err)
	}
	gotSum, _, _ := strings.Cut(string(sum), " ")
	if got != vendor.VendorHash || gotSum != vendor.GoSum {
		t.Errorf("nix/vendor.json is stale: vendorHash %s (tree hashes to %s), goSum %s (is %s); run: bash checks/vendor-hash.sh --update",
			vendor.VendorHash, got, vendor.GoSum, gotSum)
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// Evaluating the package warns when go.sum changed since vendorHash was
// computed, and is silent when it did not.
func TestGoSumWarning(t *testing.T) {
	lib := nixpkgsLib(t)
	ni := testenv.LookPath(t, "nix-instantiate")
	goSum, err := os.ReadFile(filepath.Join(repoRoot, "go.sum"))
	if err != nil {
		t.Fatal(err)
	}
	pkg, err := os.ReadFile(filepath.Join(repoRoot, "nix/package.nix"))
	if err != nil {
		t.Fatal(err)
	}
	vendor, err := os.ReadFile(filepath.Join(repoRoot, "nix/vendor.json"))
	if err != nil {
		t.Fatal(err)
	}
	for name, tc := range map[string]struct {
		goSum string
		warn  bool
	}{
		"unchanged": {string(goSum), false},
		"changed":   {string(goSum) + "example.com/new v1.0.0 h1:AAAA=\n", true},
	} {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			os.Mkdir(filepath.Join(dir, "nix"), 0o755)
			for p, b := range map[string][]byte{"go.sum": []byte(tc.goSum), "nix/package.nix": pkg, "nix/vendor.json": vendor} {
				if err := os.WriteFile(filepath.Join(dir, p), b, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			expr := fmt.Sprintf(`(import %s/nix/package.nix { lib = import %s/lib; buildGoModule = a: a; installShellFiles = { }; }).pname`, dir, lib)
			var stderr bytes.Buffer
			cmd := exec.Command(ni, "--eval", "--expr", expr)
			cmd.Stderr = &stderr
			if out, err := cmd.Output(); err != nil || strings.TrimSpace(string(out)) != `"nixcage"` {
				t.Fatalf("eval: %v %s\n%s", err, out, stderr.String())
			}
			warned := strings.Contains(stderr.String(), "run checks/vendor-hash.sh --update")
			if warned != tc.warn {
				t.Errorf("warned=%v, want %v; stderr:\n%s", warned, tc.warn, stderr.String())
			}
		})
	}
}

// The package's source filter keeps what Go needs (the tree builds from
// it) and leaves the Nix-only files out, so module edits do not rebuild it.
func TestPackageSource(t *testing.T) {
	lib := nixpkgsLib(t)
	ni := testenv.LookPath(t, "nix-instantiate")
	testenv.RequireRoot(t, "copying the source into /nix/store needs root with Debian's single-user Nix")
	expr := fmt.Sprintf(`let p = import ./nix/package.nix { lib = import %s/lib; buildGoModule = a: a; installShellFiles = { }; }; in "${p.src}"`, lib)
	cmd := exec.Command(ni, "--read-write-mode", "--eval", "--expr", expr)
	cmd.Dir = repoRoot
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("eval src: %v\n%s", err, stderr.String())
	}
	var src string
	if err := json.Unmarshal(out, &src); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"go.mod", "go.sum", "cmd/cagectl/main.go", "policies/claude-code.hcl", "examples/reference.hcl", "internal/render/testdata", "checks/nixeval/eval.nix"} {
		if _, err := os.Stat(filepath.Join(src, p)); err != nil {
			t.Errorf("package source lacks %s", p)
		}
	}
	for _, p := range []string{"flake.nix", "flake.lock", "nix", "nixos-modules", "checks/vm", ".git"} {
		if _, err := os.Lstat(filepath.Join(src, p)); err == nil {
			t.Errorf("package source contains %s, which only Nix reads", p)
		}
	}
	build := exec.Command(goTool(), "build", "-o", os.DevNull, "./cmd/cagectl")
	build.Dir = src
	if b, err := build.CombinedOutput(); err != nil {
		t.Errorf("go build in the package source: %v\n%s", err, b)
	}
}

// The VM tests cannot boot here, but what they declare can be checked:
// each evaluates, is named after its file, and every node running nixcage
// passes the assertions and cagectl validate.
func TestVMTestDeclarations(t *testing.T) {
	lib := nixpkgsLib(t)
	for _, file := range nixFiles(t, "checks/vm") {
		name := strings.TrimSuffix(filepath.Base(file), ".nix")
		t.Run(name, func(t *testing.T) {
			expr := fmt.Sprintf("import ./checks/nixeval/eval-vm.nix { lib = import %s/lib; file = ./%s; }", lib, file)
			var got struct {
				Name   string
				Script string
				Nodes  map[string]*struct {
					Model  json.RawMessage
					Failed []failure
				}
			}
			if err := json.Unmarshal(nixEval(t, expr), &got); err != nil {
				t.Fatal(err)
			}
			if got.Name != name {
				t.Errorf("test is named %q, want its file name %q", got.Name, name)
			}
			if !strings.Contains(got.Script, "machine.") {
				t.Errorf("test script drives no machine:\n%s", got.Script)
			}
			// The driver runs the script as Python; interpolating Nix strings
			// into it is an easy way to break its indentation.
			if py, err := exec.LookPath("python3"); err == nil {
				cmd := exec.Command(py, "-c", "import sys; compile(sys.stdin.read(), sys.argv[1], 'exec')", file)
				cmd.Stdin = strings.NewReader(got.Script)
				if out, err := cmd.CombinedOutput(); err != nil {
					t.Errorf("test script is not valid Python: %v\n%s\n%s", err, out, got.Script)
				}
			} else {
				t.Log("python3 not installed: test script syntax not checked")
			}
			caged := 0
			for node, n := range got.Nodes {
				if n == nil {
					continue
				}
				caged++
				for _, f := range n.Failed {
					t.Errorf("node %s: assertion %s fails: %s", node, f.ID, f.Message)
				}
				src := writeModel(t, t.TempDir(), n.Model)
				if out, err := run(t, cagectl(t), "validate", src); err != nil {
					t.Errorf("node %s: cagectl validate: %v\n%s", node, err, out)
				}
			}
			if caged == 0 {
				t.Errorf("no node enables services.nixcage")
			}
		})
	}
}
