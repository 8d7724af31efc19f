package cli

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// completionEnv writes the generated script and a stand-in cagectl on PATH
// that answers `status --names` as caged would, so agent names complete.
func completionEnv(t *testing.T, shell string) (script string, env []string) {
	t.Helper()
	code, out, errs := run(t, "completion", shell)
	if code != ExitOK {
		t.Fatalf("completion %s: exit %d: %s", shell, code, errs)
	}
	dir := t.TempDir()
	script = filepath.Join(dir, "cagectl."+shell)
	os.WriteFile(script, []byte(out), 0o644)
	os.WriteFile(filepath.Join(dir, "cagectl"), []byte("#!/bin/sh\n[ \"$1 $2\" = 'status --names' ] && printf 'alpha\\nbeta\\n'\n"), 0o755)
	return script, append(os.Environ(), "PATH="+dir+":"+os.Getenv("PATH"))
}

// completionCases are what a user types and what must be offered.
var completionCases = []struct{ line, want, not string }{
	{"cagectl apply-c", "apply-config", ""},
	{"cagectl apply-config --d", "--dry-run", ""},
	{"cagectl key ", "generate", ""},
	{"cagectl key generate --", "--out", "--json"},
	{"cagectl store gc --", "--keep", "--channel"},
	{"cagectl rollback --", "--to", "--jobs"},
	{"cagectl completion ", "zsh", ""},
	{"cagectl start ", "alpha", ""},
	{"cagectl secret rotate ", "beta", ""},
	{"cagectl release ", "create", ""},
	{"cagectl audit -", "--follow", ""},
}

func TestBashCompletion(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("bash not installed")
	}
	script, env := completionEnv(t, "bash")
	for _, c := range completionCases {
		cmd := exec.Command(bash, "-c", `source "$0"; read -ra COMP_WORDS <<< "$1"; [[ "$1" == *" " ]] && COMP_WORDS+=(""); COMP_CWORD=$((${#COMP_WORDS[@]}-1)); _cagectl; printf '%s\n' "${COMPREPLY[@]}"`, script, c.line)
		cmd.Env = env
		out, err := cmd.CombinedOutput()
		checkCompletion(t, "bash", c.line, string(out), err, c.want, c.not)
	}
}

func TestFishCompletion(t *testing.T) {
	fish, err := exec.LookPath("fish")
	if err != nil {
		t.Skip("fish not installed (checks/deps.sh installs it)")
	}
	script, env := completionEnv(t, "fish")
	for _, c := range completionCases {
		cmd := exec.Command(fish, "--no-config", "-c", `source $argv[1]; complete -C $argv[2]`, script, c.line)
		cmd.Env = env
		out, err := cmd.CombinedOutput()
		checkCompletion(t, "fish", c.line, string(out), err, c.want, c.not)
	}
}

func TestZshCompletionParses(t *testing.T) {
	zsh, err := exec.LookPath("zsh")
	if err != nil {
		t.Skip("zsh not installed (checks/deps.sh installs it)")
	}
	script, _ := completionEnv(t, "zsh")
	if out, err := exec.Command(zsh, "-n", script).CombinedOutput(); err != nil {
		t.Fatalf("zsh -n: %v\n%s", err, out)
	}
	// Loaded into a real compsys, it registers itself for cagectl.
	out, err := exec.Command(zsh, "-f", "-c", `autoload -U compinit && compinit -u -D && source $1 && print ${_comps[cagectl]}`, "zsh", script).CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != "_cagectl" {
		t.Fatalf("zsh: compdef did not register _cagectl: %v\n%s", err, out)
	}
}

func checkCompletion(t *testing.T, shell, line, out string, err error, want, not string) {
	t.Helper()
	words := map[string]bool{}
	for _, l := range strings.Split(out, "\n") {
		w, _, _ := strings.Cut(l, "\t") // fish: word<TAB>description
		words[strings.TrimSpace(w)] = true
	}
	if err != nil || !words[want] || (not != "" && words[not]) {
		t.Errorf("%s: %q offers %q (err %v); want %q, not %q", shell, line, out, err, want, not)
	}
}

// The man page holds every command and renders without groff warnings.
func TestManPage(t *testing.T) {
	code, out, errs := run(t, "man")
	if code != ExitOK {
		t.Fatalf("man: exit %d: %s", code, errs)
	}
	for _, n := range commandNames() {
		if !strings.Contains(out, ".SS \""+roff("cagectl "+n)) {
			t.Errorf("man page lacks a section for %s", n)
		}
	}
	groff, err := exec.LookPath("groff")
	if err != nil {
		t.Skip("groff not installed (checks/deps.sh installs groff-base)")
	}
	cmd := exec.Command(groff, "-man", "-Tutf8", "-ww", "-z")
	cmd.Stdin = strings.NewReader(out)
	if b, err := cmd.CombinedOutput(); err != nil || len(b) > 0 {
		t.Errorf("groff warnings: %v\n%s", err, b)
	}
}
