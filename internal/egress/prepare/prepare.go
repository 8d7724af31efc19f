// Package prepare makes what a cage's gateway and agent need before either
// starts: the cage CA (with name constraints from the policy), the secrets'
// placeholders and the agent's env file, resolv.conf and the learn window.
// `cage-egress prepare` runs it for declared agents (the prepare step's
// sandboxed unit); caged runs it itself for throw-away cages (docs/run.md).
package prepare

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/nixcage/nixcage/internal/egress/ca"
	"github.com/nixcage/nixcage/internal/egress/secrets"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/policy"
)

// ResolvConfText is the cage's /etc/resolv.conf: the gateway's DNS filter.
const ResolvConfText = "nameserver 127.0.0.1\noptions edns0 trust-ad\n"

// InterceptHosts are the host patterns the CA must be able to vouch for:
// the inspect list plus every secret's hosts (injection needs interception).
func InterceptHosts(rt *policy.Runtime) []string {
	hosts := append([]string{}, rt.Policy.Inspect...)
	for _, s := range rt.Secrets {
		hosts = append(hosts, s.Hosts...)
	}
	slices.Sort(hosts)
	return slices.Compact(hosts)
}

// Result says what Prepare did, for the operator.
type Result struct {
	CACreated    bool
	Placeholders []string // secret names
	// LearnUntil is the end of the learn window (zero: no learn mode).
	LearnUntil time.Time
}

// Prepare runs as root before the gateway and the agent start: it makes the
// cage CA, the placeholders, the agent's env file and resolv.conf. It is
// idempotent: an existing CA with the right constraints is kept, and an
// existing placeholder that still fits its secret is reused, so re-running
// it does not invalidate what a running agent holds.
func Prepare(rt *policy.Runtime, credDir string) (*Result, error) {
	res := &Result{}
	if rt.CADir == "" {
		return nil, fmt.Errorf("prepare: egress config has no ca_dir; re-render it with cagectl")
	}
	created, err := ca.Ensure(rt.CADir, "nixcage "+rt.Agent+" egress CA", ca.Constraints(InterceptHosts(rt)))
	if err != nil {
		return nil, fmt.Errorf("prepare: %w", err)
	}
	res.CACreated = created
	if len(rt.Secrets) > 0 && (rt.PlaceholderFile == "" || rt.AgentEnvFile == "") {
		return nil, fmt.Errorf("prepare: egress config has secrets but no placeholder_file or agent_env_file; re-render it with cagectl")
	}
	var old *secrets.File
	if rt.PlaceholderFile != "" {
		old, _ = secrets.LoadFile(rt.PlaceholderFile) // absent or stale: make new ones
	}
	pf := secrets.File{Schema: secrets.FileSchema, Secrets: map[string]secrets.Entry{}}
	var env strings.Builder
	for _, s := range rt.Secrets {
		if s.Env == "" || strings.ContainsAny(s.Env, "=\n ") {
			return nil, fmt.Errorf("prepare: secret %s: env %q is not a variable name", s.Name, s.Env)
		}
		real, err := secrets.ReadReal(credDir, s.Name)
		if err != nil {
			return nil, fmt.Errorf("prepare: %w", err)
		}
		ph := ""
		if old != nil {
			if e, ok := old.Secrets[s.Name]; ok && len(e.Placeholder) == len(real) && e.Placeholder != real &&
				secrets.KnownPrefix(e.Placeholder) == secrets.KnownPrefix(real) && !strings.ContainsAny(e.Placeholder, "\n\r\"'\\ ") {
				ph = e.Placeholder
			}
		}
		if ph == "" {
			if ph, err = secrets.NewPlaceholder(real); err != nil {
				return nil, fmt.Errorf("prepare: secret %s: %w", s.Name, err)
			}
		}
		pf.Secrets[s.Name] = secrets.Entry{Env: s.Env, Placeholder: ph}
		fmt.Fprintf(&env, "%s=%s\n", s.Env, ph)
		res.Placeholders = append(res.Placeholders, s.Name)
	}
	if rt.PlaceholderFile != "" {
		b, err := json.MarshalIndent(pf, "", "  ")
		if err != nil {
			return nil, fmt.Errorf("prepare: %w", err)
		}
		if err := writeFile(rt.PlaceholderFile, append(b, '\n'), 0o644); err != nil {
			return nil, err
		}
	}
	if rt.AgentEnvFile != "" {
		if err := writeFile(rt.AgentEnvFile, []byte(env.String()), 0o600); err != nil {
			return nil, err
		}
	}
	if err := writeBundle(rt.CADir); err != nil {
		return nil, err
	}
	if rt.ResolvConf != "" {
		if err := writeFile(rt.ResolvConf, []byte(ResolvConfText), 0o644); err != nil {
			return nil, err
		}
	}
	if rt.Learn != nil {
		w, err := stampLearnWindow(rt, time.Now())
		if err != nil {
			return nil, err
		}
		res.LearnUntil = w.Until()
	}
	return res, nil
}

// stampLearnWindow opens the learn window: prepare runs (as root) once per
// start of the cage's units, before the gateway, so each start of the cage
// opens one window; a gateway restart (crash, Restart=on-failure) keeps it,
// and nothing the agent can do runs prepare again.
func stampLearnWindow(rt *policy.Runtime, now time.Time) (*policy.LearnWindow, error) {
	w := &policy.LearnWindow{Schema: policy.LearnSchema, Agent: rt.Agent, StartedUnix: now.Unix(), UntilUnix: now.Unix() + rt.Learn.ForSeconds}
	b, err := json.Marshal(w)
	if err != nil {
		return nil, err
	}
	if err := writeFile(rt.Learn.File, append(b, '\n'), 0o644); err != nil {
		return nil, err
	}
	return w, nil
}

func writeFile(path string, data []byte, mode os.FileMode) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("prepare: %w", err)
	}
	if err := ca.WriteAtomic(path, data, mode); err != nil {
		return fmt.Errorf("prepare: %w", err)
	}
	return nil
}

// writeBundle writes the host's root bundle followed by the cage CA: tools
// that take one CA file (SSL_CERT_FILE, GIT_SSL_CAINFO, ...) must trust real
// servers behind tunnels and the gateway's leaves for inspected hosts alike.
// A host without a root bundle gets the cage CA alone (only inspected hosts
// will then verify), which is said in the file so an operator can tell.
func writeBundle(dir string) error {
	cert, err := os.ReadFile(filepath.Join(dir, paths.CACertFile))
	if err != nil {
		return fmt.Errorf("prepare: %w", err)
	}
	var b []byte
	for _, p := range paths.HostCABundles {
		if roots, err := os.ReadFile(p); err == nil {
			b = append(roots, '\n')
			break
		}
	}
	if b == nil {
		b = []byte("# no host root bundle found; only the cage CA is trusted\n")
	}
	b = append(b, cert...)
	return writeFile(filepath.Join(dir, paths.CABundleFile), b, 0o644)
}
