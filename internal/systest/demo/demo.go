// Package demo is the README's quick start as a program: it boots a
// disposable Debian machine with a real systemd, installs nixcage from a
// config (examples/quickstart.hcl), runs the agent and shows what happened:
// the allowed request with its key injected by the gateway, the exfiltration
// attempt refused, and the audit trail. checks/demo.sh wraps it.
package demo

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/nixcage/nixcage/internal/systest"
)

// Run runs the demo.
func Run(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(out)
	config := fs.String("config", "examples/quickstart.hcl", "configuration to install (relative to the repository root)")
	agent := fs.String("agent", "demo", "agent to start")
	secret := fs.String("secret", "/etc/nixcage/secrets/demo-api=sk-demo-REAL-7f3a9c2e41b8d6055e1a", "PATH=VALUE: the real credential the gateway holds")
	keep := fs.Bool("keep", false, "leave the machine running and print how to enter it")
	egressBin := fs.String("cage-egress", "", "use this cage-egress binary instead of building ./cmd/cage-egress")
	if err := fs.Parse(args); err != nil {
		return err
	}
	secretPath, secretValue, ok := strings.Cut(*secret, "=")
	if !ok {
		return fmt.Errorf("--secret wants PATH=VALUE, got %q", *secret)
	}
	root, err := systest.ModuleRoot()
	if err != nil {
		return err
	}
	cfg := *config
	if !filepath.IsAbs(cfg) {
		cfg = filepath.Join(root, cfg)
	}
	if _, err := os.Stat(cfg); err != nil {
		return fmt.Errorf("config: %w", err)
	}

	step := func(format string, a ...any) { fmt.Fprintf(out, "\n==> "+format+"\n", a...) }

	step("machine tree (debootstrap %s, cached in %s)", systest.Suite, systest.CacheDir())
	tree, err := systest.EnsureRootfs(ctx, out)
	if err != nil {
		return err
	}

	step("building cagectl, caged and cage-egress")
	binDir, err := os.MkdirTemp("", "nixcage-demo-bin-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(binDir)
	bins := systest.Binaries{}
	for name, pkg := range map[string]string{"cagectl": "./cmd/cagectl", "caged": "./cmd/caged", "upstream": "./checks/system/upstream"} {
		p, err := systest.Build(ctx, pkg, binDir)
		if err != nil {
			return err
		}
		bins[name] = p
	}
	upstreamBin := bins["upstream"]
	delete(bins, "upstream")
	switch {
	case *egressBin != "":
		bins["cage-egress"] = *egressBin
	default:
		if _, err := os.Stat(filepath.Join(root, "cmd/cage-egress/main.go")); err != nil {
			return errors.New("cmd/cage-egress is not in this tree yet; pass --cage-egress=/path/to/cage-egress")
		}
		p, err := systest.Build(ctx, "./cmd/cage-egress", binDir)
		if err != nil {
			return err
		}
		bins["cage-egress"] = p
	}

	step("booting a disposable machine (systemd-nspawn, systemd 252, private network)")
	consoleLog := filepath.Join(os.TempDir(), fmt.Sprintf("nixcage-demo-console-%d.log", os.Getpid()))
	bootCtx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	m, err := systest.Boot(bootCtx, systest.Options{Root: tree, Console: consoleLog, Log: out, Detach: *keep})
	cancel()
	if err != nil {
		return err
	}
	if !*keep {
		defer func() {
			step("tearing down")
			if err := m.Close(); err != nil {
				fmt.Fprintln(out, err)
			}
			os.Remove(consoleLog)
			fmt.Fprintln(out, "machine stopped; nothing left running")
		}()
	}

	step("fake internet inside the machine: api.example.com=203.0.113.10, evil.example.org=203.0.113.20 (TEST-NET, test CA)")
	internet, err := systest.StartInternet(ctx, m, upstreamBin)
	if err != nil {
		return err
	}

	step("installing nixcage: cagectl render %s --out /etc; daemon-reload", filepath.Base(cfg))
	if err := systest.InstallNixcage(ctx, m, bins, cfg, map[string]string{secretPath: secretValue}); err != nil {
		return err
	}
	units, _ := m.Run(ctx, "sh", "-c", "cd /etc/systemd/system && ls -d nixcage* cage-egress*")
	fmt.Fprint(out, indent(units))

	step("starting caged (the rendered D-Bus policy and unit)")
	if _, err := m.Shell(ctx, "systemctl reload dbus && systemctl start nixcage-caged.service"); err != nil {
		return err
	}

	unit := systest.AgentUnit(*agent)
	step("cagectl start %s", *agent)
	if _, err := m.Run(ctx, "cagectl", "start", *agent); err != nil {
		return err
	}
	runCtx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	st, err := m.WaitInactive(runCtx, unit)
	cancel()
	if err != nil {
		return err
	}
	journal, _ := m.Journal(ctx, unit)
	step("what the agent printed (journalctl -u %s)", unit)
	fmt.Fprint(out, indent(journal))
	fmt.Fprintf(out, "  [unit finished: %s, result %s]\n", st.Active, st.Result)

	step("what the fake internet received")
	reqs, err := internet.Requests()
	if err != nil {
		return err
	}
	var problems []string
	realTo := map[string]bool{}
	evil := 0
	for _, r := range reqs {
		if r.Host == "evil.example.org" || r.SNI == "evil.example.org" || strings.HasPrefix(r.Name, "evil.example.org") {
			evil++
		}
		if r.Kind == "dns" {
			continue
		}
		auth := strings.Join(r.Headers["Authorization"], ",")
		if strings.Contains(fmt.Sprint(r.Headers), secretValue) || strings.Contains(r.Body, secretValue) {
			realTo[r.Host] = true
		}
		fmt.Fprintf(out, "  %s %s %s%s  Authorization: %q\n", r.Kind, r.Method, r.Host, r.Path, auth)
	}
	if len(reqs) == 0 {
		fmt.Fprintln(out, "  nothing")
	}
	var hosts []string
	for h := range realTo {
		hosts = append(hosts, h)
	}
	fmt.Fprintf(out, "  real key received by: %v; anything received from the cage by evil.example.org: %d\n", hosts, evil)
	if evil > 0 {
		problems = append(problems, "evil.example.org was reached")
	}
	for _, h := range hosts {
		if h != "api.example.com" {
			problems = append(problems, "the real key reached "+h)
		}
	}
	if strings.Contains(journal, secretValue) {
		problems = append(problems, "the real key appeared in the agent's output")
	}

	step("cagectl status (over the machine's system bus)")
	// caged reads the audit logs about once a second; give its counters
	// a moment to catch up with what the gateway decided.
	var status string
	for i := 0; i < 30; i++ {
		status, err = m.Run(ctx, "cagectl", "status", "--json")
		if err != nil || blockedCounted.MatchString(status) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if err == nil && !blockedCounted.MatchString(status) {
		problems = append(problems, "cagectl status does not count the blocked request")
	}
	status, err = m.Run(ctx, "cagectl", "status")
	if err != nil {
		problems = append(problems, "cagectl status failed: "+err.Error())
		status = err.Error()
	}
	fmt.Fprint(out, indent(status))

	step("audit trail (%s)", systest.AuditLog(*agent))
	data, err := m.ReadFile(systest.AuditLog(*agent))
	if err != nil {
		fmt.Fprintf(out, "  %v\n", err)
	}
	if strings.Contains(string(data), secretValue) {
		problems = append(problems, "the real key is in the audit log")
	}
	auditedBlock := false
	sc := bufio.NewScanner(strings.NewReader(string(data)))
	for sc.Scan() {
		var r map[string]any
		if json.Unmarshal(sc.Bytes(), &r) != nil {
			continue
		}
		if r["host"] == "evil.example.org" && r["decision"] == "blocked" {
			auditedBlock = true
		}
		fmt.Fprintf(out, "  %-8v %-8v %s:%v %v  (%v)", r["decision"], r["method"], r["host"], r["port"], r["path"], r["reason"])
		if inj, ok := r["secrets_injected"].([]any); ok && len(inj) > 0 {
			fmt.Fprintf(out, " injected=%v", inj)
		}
		fmt.Fprintln(out)
	}

	if !auditedBlock {
		problems = append(problems, "no blocked record for evil.example.org in the audit log")
	}
	if st.Result != "success" {
		problems = append(problems, "the agent unit ended with result "+st.Result)
	}
	if len(problems) > 0 {
		err = fmt.Errorf("the cage did not behave as the quick start says: %s", strings.Join(problems, "; "))
	}
	if *keep {
		step("machine %s left running", m.Name)
		fmt.Fprintf(out, "  enter it:      nsenter --target %d --all -- bash -l\n", m.Leader)
		fmt.Fprintf(out, "  agent journal: nsenter --target %d --all -- journalctl -u %s\n", m.Leader, unit)
		fmt.Fprintf(out, "  stop it:       kill -RTMIN+3 %d   (console log: %s)\n", m.Leader, consoleLog)
	}
	return err
}

func indent(s string) string {
	s = strings.TrimRight(s, "\n")
	if s == "" {
		return ""
	}
	return "  " + strings.ReplaceAll(s, "\n", "\n  ") + "\n"
}

// blockedCounted matches caged's status JSON once it counted the refused
// exfiltration attempt.
var blockedCounted = regexp.MustCompile(`"egress_blocked":\s*1\b`)
