package systest

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/nixcage/nixcage/internal/paths"
)

// Binaries maps an installed name (in /usr/local/bin of the machine) to the
// host path of a built binary.
type Binaries map[string]string

// Where nixcage is installed in a machine: the renderer's defaults.
const (
	BinDir        = "/usr/local/bin"
	ConfigInstall = "/etc/nixcage/config.hcl"
	SecretsDir    = "/etc/nixcage/secrets"
)

// InstallNixcage installs binaries, renders a configuration inside the
// machine with its own cagectl (`cagectl render CONFIG --out /etc`), writes
// secret files, creates the tmpfiles and reloads systemd. It starts nothing.
// secrets maps a machine path (a secret's source) to its real value.
func InstallNixcage(ctx context.Context, m *Machine, bins Binaries, configHost string, secrets map[string]string) error {
	if bins["cage-seal"] == "" {
		// Every nspawn and podman cage execs its agent through cage-seal.
		dir, err := os.MkdirTemp("", "nixcage-systest-seal-")
		if err != nil {
			return fmt.Errorf("install nixcage: %w", err)
		}
		defer os.RemoveAll(dir)
		p, err := Build(ctx, "./cmd/cage-seal", dir)
		if err != nil {
			return fmt.Errorf("install nixcage: %w", err)
		}
		bins = copyBins(bins)
		bins["cage-seal"] = p
	}
	for name, p := range bins {
		if err := m.CopyIn(p, filepath.Join(BinDir, name), 0o755); err != nil {
			return err
		}
	}
	if err := m.CopyIn(configHost, ConfigInstall, 0o644); err != nil {
		return err
	}
	for p, v := range secrets {
		if err := m.WriteFile(p, []byte(v), 0o600); err != nil {
			return err
		}
		if err := chmodIn(m, p, 0o600); err != nil {
			return err
		}
	}
	// podman --userns=auto takes ranges from the "containers" entries; Debian
	// does not create them. An operator has to do the same (docs).
	script := `
grep -q '^containers:' /etc/subuid || echo 'containers:2147483647:2147483648' >> /etc/subuid
grep -q '^containers:' /etc/subgid || echo 'containers:2147483647:2147483648' >> /etc/subgid
cagectl render ` + ConfigInstall + ` --out /etc --bindir ` + BinDir + `
systemd-tmpfiles --create /etc/tmpfiles.d/nixcage.conf
systemctl daemon-reload
`
	if _, err := m.Shell(ctx, script); err != nil {
		return fmt.Errorf("install nixcage: %w", err)
	}
	return nil
}

func copyBins(b Binaries) Binaries {
	c := Binaries{}
	for k, v := range b {
		c[k] = v
	}
	return c
}

// UnitState is a unit's ActiveState/SubState/Result.
type UnitState struct{ Active, Sub, Result string }

// UnitState reads a unit's state.
func (m *Machine) UnitState(ctx context.Context, unit string) (UnitState, error) {
	out, err := m.Run(ctx, "systemctl", "show", "-P", "ActiveState", unit)
	if err != nil {
		return UnitState{}, err
	}
	sub, _ := m.Run(ctx, "systemctl", "show", "-P", "SubState", unit)
	res, _ := m.Run(ctx, "systemctl", "show", "-P", "Result", unit)
	return UnitState{strings.TrimSpace(out), strings.TrimSpace(sub), strings.TrimSpace(res)}, nil
}

// WaitInactive waits until a unit has finished (inactive or failed, or
// failed and waiting to be restarted) and returns its state.
func (m *Machine) WaitInactive(ctx context.Context, unit string) (UnitState, error) {
	for {
		st, err := m.UnitState(ctx, unit)
		if err != nil {
			return st, err
		}
		if st.Active == "inactive" || st.Active == "failed" || st.Sub == "auto-restart" {
			return st, nil
		}
		select {
		case <-ctx.Done():
			return st, fmt.Errorf("%s still %s/%s: %w", unit, st.Active, st.Sub, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Journal returns a unit's messages of this boot (message text only).
func (m *Machine) Journal(ctx context.Context, unit string) (string, error) {
	return m.Run(ctx, "journalctl", "--no-pager", "-b", "-o", "cat", "-u", unit)
}

// AgentUnit and friends name the units the renderer produces for an agent.
func AgentUnit(agent string) string  { return paths.Instance(paths.AgentTemplate, agent) }
func EgressUnit(agent string) string { return paths.Instance(paths.EgressTemplate, agent) }
func ProxySocket(agent string) string {
	return paths.Instance(paths.ProxySocketTpl, agent)
}
func DNSSocket(agent string) string { return paths.Instance(paths.DNSSocketTpl, agent) }

// AuditLog is the gateway's JSONL audit file for an agent.
func AuditLog(agent string) string { return filepath.Join(paths.AuditDir(agent), "audit.jsonl") }

// BootInstalled is what a benchmark's machine needs: it builds each of
// pkgs (name -> Go package) into dir beside the prebuilt bins, writes
// config there, boots tree with its console in dir, and installs nixcage
// from that config. The caller closes the machine.
func BootInstalled(ctx context.Context, tree, dir string, bins Binaries, pkgs map[string]string, config string, log io.Writer) (*Machine, error) {
	for name, pkg := range pkgs {
		p, err := Build(ctx, pkg, dir)
		if err != nil {
			return nil, err
		}
		bins[name] = p
	}
	cfg := filepath.Join(dir, "bench.hcl")
	if err := os.WriteFile(cfg, []byte(config), 0o644); err != nil {
		return nil, err
	}
	m, err := Boot(ctx, Options{Root: tree, Console: filepath.Join(dir, "console.log"), Log: log})
	if err != nil {
		return nil, err
	}
	if err := InstallNixcage(ctx, m, bins, cfg, nil); err != nil {
		m.Close()
		return nil, err
	}
	return m, nil
}
