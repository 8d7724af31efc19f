package config

import (
	"fmt"
	"github.com/nixcage/nixcage/internal/harness"
	"net"
	"net/url"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/hcl/v2"
	"github.com/miekg/dns"

	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/policy"
)

// Agent names are at most 24 characters so that "nixcage-"+name is a valid
// 32-character user name for DynamicUser=.
// Names become unit instance names, directory names and D-Bus object path
// elements, so they are held to the intersection of what all three accept,
// minus anything systemd would escape ("-" is fine in an instance name, but a
// leading one reads as an option on command lines).
var (
	agentNameRE   = regexp.MustCompile(`^[a-z][a-z0-9-]{0,23}$`)
	policyNameRE  = regexp.MustCompile(`^[a-z][a-z0-9_-]{0,63}$`)
	secretNameRE  = regexp.MustCompile(`^[a-z][a-z0-9_-]{0,63}$`)
	envNameRE     = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
	unixNameRE    = regexp.MustCompile(`^[a-z_][a-z0-9_-]{0,31}\$?$`)
	channelRE     = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,63}$`)
	hostIDRE      = regexp.MustCompile(`^[a-z0-9]([a-z0-9.-]{0,62}[a-z0-9])?$`)
	headerRE      = regexp.MustCompile(`^[A-Za-z0-9!#$%&'*+.^_` + "`" + `|~-]+$`)
	memoryRE      = regexp.MustCompile(`^(infinity|[0-9]+[KMGT]?|[0-9]{1,3}%)$`)
	cpuRE         = regexp.MustCompile(`^[0-9]{1,5}%$`)
	placeholderRE = regexp.MustCompile(`[$%]`)
)

// reservedEnv are variables the cage sets itself; an agent cannot override
// them (overriding the proxy would only break the agent, overriding the CA
// bundle could make it trust something other than its gateway).
var reservedEnv = map[string]bool{
	"HTTP_PROXY": true, "HTTPS_PROXY": true, "ALL_PROXY": true, "NO_PROXY": true,
	"http_proxy": true, "https_proxy": true, "all_proxy": true, "no_proxy": true,
	"SSL_CERT_FILE": true, "NODE_EXTRA_CA_CERTS": true, "REQUESTS_CA_BUNDLE": true,
	"GIT_SSL_CAINFO": true, "CURL_CA_BUNDLE": true, "HOME": true, "PATH": true,
	"NIXCAGE_AGENT": true, "LD_PRELOAD": true, "LD_LIBRARY_PATH": true,
}

// Defaults of the agent and store model, in one place so docs/config.md can
// quote them. The egress policy's defaults live with its model, in package
// policy (policy.DefaultMaxTunnels, ...).
const (
	DefaultMemory = "2G"
	// DefaultTurnTimeout bounds one turn of an agent (cagectl say, a chat
	// message); MaxTurnTimeout is the most turn_timeout may be.
	DefaultTurnTimeout  = 10 * time.Minute
	MaxTurnTimeout      = 24 * time.Hour
	DefaultTasks        = 512
	DefaultPort         = 443
	DefaultGenerations  = 3
	DefaultPolicy       = "none"
	DefaultSecretHeader = "Authorization"
	// DefaultExpiryWarning: a current generation whose release expires
	// within this is reported as expiring (store verify, status, D-Bus).
	DefaultExpiryWarning = 7 * 24 * time.Hour
	// DefaultMetricsListen is where a metrics block without listen serves:
	// loopback only, on a port of its own (Prometheus' exporter registry
	// has no nixcage entry; 9477 is unassigned there).
	DefaultMetricsListen = "127.0.0.1:9477"
	// MetricsSocketDir is where a unix-socket metrics endpoint must live:
	// caged's RuntimeDirectory=, the one place its unit may create it.
	MetricsSocketDir = "/run/nixcage/"
	// DefaultChannelInterval is how often caged polls its channel; a
	// fleet of hosts polling a static server every 5 minutes is cheap
	// (one index of a few hundred bytes each), and a release reaches
	// every host within one interval (plus jitter).
	DefaultChannelInterval = 5 * time.Minute
	// MinChannelInterval is the shortest interval accepted.
	MinChannelInterval = time.Second
)

type validator struct {
	loader *Loader
	diags  hcl.Diagnostics

	policies map[string]*resolvedPolicy
	named    map[string]*namedPolicy
}

type resolvedPolicy struct {
	p           policy.Policy
	credentials map[string]credentialV1
}

func (v *validator) errorf(rng hcl.Range, summary, detail string, args ...any) {
	v.diag(hcl.DiagError, rng, summary, fmt.Sprintf(detail, args...))
}

// warnf notes something valid the operator may not expect.
func (v *validator) warnf(rng hcl.Range, summary, detail string, args ...any) {
	v.diag(hcl.DiagWarning, rng, summary, fmt.Sprintf(detail, args...))
}

func (v *validator) diag(sev hcl.DiagnosticSeverity, rng hcl.Range, summary, detail string) {
	r := rng
	v.diags = append(v.diags, &hcl.Diagnostic{Severity: sev, Summary: summary, Detail: detail, Subject: &r})
}

// denyBelowNotes explains the deny rule where a policy would have been read
// otherwise before it: an exact deny entry covers every name below it
// (policy.Covers), so names an allow wildcard or an allowed subdomain let
// through under the old reading are refused now. A warning, not an error:
// the config is valid and stricter than before.
func (v *validator) denyBelowNotes(name string, body hcl.Body, allow, deny []string) {
	for _, d := range deny {
		if strings.HasPrefix(d, "*.") {
			continue // a wildcard always meant its subdomains
		}
		for _, a := range allow {
			below := "x." + d
			switch {
			case a != d && policy.Covers(d, a) && !strings.HasPrefix(a, "*."):
				v.warnf(at(body, "deny"), "Deny covers an allowed name", "egress_policy %q: deny %q also refuses every name below it, so allow %q is refused (CONNECT, HTTP and DNS). Remove %q from allow, or narrow the deny entry.", name, d, a, a)
			case policy.Match(a, below):
				v.warnf(at(body, "deny"), "Deny covers the names below it", "egress_policy %q: deny %q refuses %s and every name below it (e.g. %s), which allow %q would otherwise let through (CONNECT, HTTP and DNS). A deny entry stands for whoever runs that name, and they run the names below it too.", name, d, d, below, a)
			}
		}
	}
}

// at returns the source range of attribute name in body, or of the block
// itself when the attribute is absent.
func at(body hcl.Body, name string) hcl.Range {
	if body == nil {
		return hcl.Range{}
	}
	c, _, _ := body.PartialContent(&hcl.BodySchema{Attributes: []hcl.AttributeSchema{{Name: name}}})
	if c != nil {
		if a, ok := c.Attributes[name]; ok {
			return a.Expr.Range()
		}
	}
	return body.MissingItemRange()
}

func block(body hcl.Body) hcl.Range {
	if body == nil {
		return hcl.Range{}
	}
	return body.MissingItemRange()
}

func (v *validator) build(files []*fileV1) *Config {
	cfg := &Config{}
	v.named = map[string]*namedPolicy{}
	v.policies = map[string]*resolvedPolicy{}

	for _, f := range files {
		if f.Version != nil && *f.Version != 1 {
			v.errorf(at(f.Body, "version"), "Unsupported config version", "version = %d; this nixcage reads version 1. Set version = 1 or upgrade nixcage.", *f.Version)
		}
		for i := range f.Policies {
			p := &f.Policies[i]
			rng := block(p.Remain)
			if !policyNameRE.MatchString(p.Name) {
				v.errorf(rng, "Invalid policy name", "egress_policy %q: names are 1-64 characters of a-z, 0-9, '_' and '-', starting with a letter. Rename it.", p.Name)
				continue
			}
			if prev, dup := v.named[p.Name]; dup {
				v.errorf(rng, "Duplicate egress policy", "egress_policy %q is already declared at %s. Rename or remove one of them.", p.Name, block(prev.Remain))
				continue
			}
			v.named[p.Name] = p
		}
	}
	// Resolve every declared policy, even unused ones: a broken policy in
	// a file is an error whether or not an agent uses it yet.
	names := make([]string, 0, len(v.named))
	for n := range v.named {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		v.policies[n] = v.resolvePolicy(n, &v.named[n].policy)
		if rp := v.policies[n]; rp != nil {
			cfg.Policies = append(cfg.Policies, rp.p)
		}
	}

	seenAgent := map[string]hcl.Range{}
	workspaces := map[string]string{}
	for _, f := range files {
		for i := range f.Agents {
			a := &f.Agents[i]
			rng := block(a.Body)
			if !agentNameRE.MatchString(a.Name) {
				v.errorf(rng, "Invalid agent name", "agent %q: names become unit names and paths, so they are 1-24 characters of a-z, 0-9 and '-', starting with a letter. Rename it, e.g. %q.", a.Name, suggestName(a.Name))
				continue
			}
			if prev, dup := seenAgent[a.Name]; dup {
				v.errorf(rng, "Duplicate agent", "agent %q is already declared at %s. Rename or remove one of them.", a.Name, prev)
				continue
			}
			seenAgent[a.Name] = rng
			if ag := v.agent(a); ag != nil {
				if other, clash := workspaces[ag.Workspace]; clash {
					v.errorf(at(a.Body, "workspace"), "Shared workspace", "agent %q uses workspace %s, which agent %q uses too. Cages must not share a workspace: give each its own directory.", a.Name, ag.Workspace, other)
				}
				workspaces[ag.Workspace] = a.Name
				cfg.Agents = append(cfg.Agents, ag)
			}
		}
	}
	sort.Slice(cfg.Agents, func(i, j int) bool { return cfg.Agents[i].Name < cfg.Agents[j].Name })

	seenAcct := map[string]bool{}
	for _, f := range files {
		for i := range f.Accounts {
			a := &f.Accounts[i]
			if seenAcct[a.Name] {
				v.errorf(block(a.Body), "Duplicate account", "account %q is declared twice. Rename or remove one of them.", a.Name)
				continue
			}
			seenAcct[a.Name] = true
			if acc := v.account(a, seenAgent); acc != nil {
				cfg.Accounts = append(cfg.Accounts, acc)
			}
		}
	}

	storeBody := onlyBlock(v, files, "store", func(f *fileV1) []storeV1 { return f.Store }, func(s *storeV1) hcl.Body { return s.Body },
		func(s *storeV1) { cfg.Store = v.store(s) })
	onlyBlock(v, files, "evidence", func(f *fileV1) []evidenceV1 { return f.Evidence }, func(e *evidenceV1) hcl.Body { return e.Body },
		func(e *evidenceV1) { cfg.Evidence = v.evidence(e) })
	onlyBlock(v, files, "metrics", func(f *fileV1) []metricsV1 { return f.Metrics }, func(m *metricsV1) hcl.Body { return m.Body },
		func(m *metricsV1) { cfg.Metrics = v.metrics(m) })
	onlyBlock(v, files, "control", func(f *fileV1) []controlV1 { return f.Control }, func(c *controlV1) hcl.Body { return c.Body },
		func(c *controlV1) { cfg.Control = v.control(c) })
	onlyBlock(v, files, "relay", func(f *fileV1) []relayV1 { return f.Relay }, func(r *relayV1) hcl.Body { return r.Body },
		func(r *relayV1) { cfg.Relay = v.relay(r, cfg) })
	chanBody := onlyBlock(v, files, "channel", func(f *fileV1) []channelV1 { return f.Channel }, func(c *channelV1) hcl.Body { return c.Body },
		func(c *channelV1) { cfg.Channel = v.channel(c) })
	if cfg.Channel != nil && cfg.Store == nil {
		v.errorf(block(chanBody), "Channel without a store", "a channel block needs a store block: the store's channel, keys and threshold decide which releases from the channel are accepted. Add store { channel = ..., keys = [...] }.")
	}
	if cfg.Store != nil {
		for _, a := range cfg.Agents {
			if within(a.Workspace, cfg.Store.Root) {
				v.errorf(block(storeBody), "Workspace inside the store", "agent %q's workspace %s is inside the store root %s, which cages see read-only. Move the workspace.", a.Name, a.Workspace, cfg.Store.Root)
			}
		}
	}
	return cfg
}

func suggestName(s string) string {
	var b strings.Builder
	for _, c := range strings.ToLower(s) {
		switch {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9':
			b.WriteRune(c)
		default:
			b.WriteByte('-')
		}
	}
	out := strings.Trim(b.String(), "-")
	if out == "" || out[0] < 'a' || out[0] > 'z' {
		out = "agent-" + out
	}
	if len(out) > 24 {
		out = out[:24]
	}
	return strings.TrimRight(out, "-")
}

func within(p, root string) bool {
	rel, err := filepath.Rel(root, p)
	return err == nil && rel != ".." && !strings.HasPrefix(rel, "../")
}

func (v *validator) checkAbsPath(rng hcl.Range, what, p string) bool {
	if !filepath.IsAbs(p) || filepath.Clean(p) != p || strings.ContainsAny(p, "\n\"'\\ ") || placeholderRE.MatchString(p) {
		v.errorf(rng, "Invalid path", "%s %q must be a clean absolute path without spaces, quotes, '%%' or '$' (systemd would expand them), e.g. \"/var/lib/nixcage/agents/NAME\".", what, p)
		return false
	}
	return true
}

func (v *validator) agent(a *agentV1) *Agent {
	ag := &Agent{
		Name:        a.Name,
		Backend:     a.Backend,
		Command:     a.Command,
		Environment: a.Environment,
		Workspace:   paths.DefaultWorkspace(a.Name),
		Autostart:   true,
		Resources:   Resources{Memory: DefaultMemory, Tasks: DefaultTasks},
		TurnTimeout: DefaultTurnTimeout,
	}
	if ag.Environment == nil {
		ag.Environment = map[string]string{}
	}
	if ag.Backend == "" {
		ag.Backend = DefaultBackend
	}
	switch ag.Backend {
	case BackendService, BackendNspawn, BackendPodman:
	default:
		v.errorf(at(a.Body, "backend"), "Unknown backend", "agent %q: backend %q is not one of \"service\", \"nspawn\", \"podman\".", a.Name, a.Backend)
	}
	if len(a.Command) == 0 || a.Command[0] == "" {
		v.errorf(at(a.Body, "command"), "Empty command", "agent %q: command must name the program to run, e.g. [\"/bin/sh\", \"-c\", \"...\"].", a.Name)
	} else if !filepath.IsAbs(a.Command[0]) {
		v.errorf(at(a.Body, "command"), "Relative command", "agent %q: command[0] %q must be an absolute path inside the cage (there is no PATH lookup), e.g. \"/bin/sh\" or \"%s/bin/claude\".", a.Name, a.Command[0], paths.CageTools)
	}
	for _, arg := range a.Command {
		if strings.ContainsRune(arg, 0) {
			v.errorf(at(a.Body, "command"), "Invalid command argument", "agent %q: command arguments cannot contain NUL bytes.", a.Name)
			break
		}
	}
	keys := make([]string, 0, len(ag.Environment))
	for k := range ag.Environment {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if !envNameRE.MatchString(k) {
			v.errorf(at(a.Body, "environment"), "Invalid environment variable", "agent %q: %q is not a variable name (letters, digits, '_').", a.Name, k)
		} else if reservedEnv[k] {
			v.errorf(at(a.Body, "environment"), "Reserved environment variable", "agent %q: %s is set by the cage itself and cannot be overridden. Remove it.", a.Name, k)
		}
		if strings.ContainsAny(ag.Environment[k], "\n\x00") {
			v.errorf(at(a.Body, "environment"), "Invalid environment value", "agent %q: the value of %s contains a newline or NUL byte.", a.Name, k)
		}
	}
	var h *harness.Harness
	if a.Harness != nil {
		if hv, ok := harness.Lookup(*a.Harness); ok {
			h = &hv
			ag.Harness = hv.Name
			// The scaffold's environment goes under the agent's own.
			for k, val := range hv.Environment {
				if _, set := ag.Environment[k]; !set {
					ag.Environment[k] = val
				}
			}
		} else {
			v.errorf(at(a.Body, "harness"), "Unknown harness", "agent %q: harness = %q is not a shipped harness; use one of: %s (docs/harnesses.md).", a.Name, *a.Harness, strings.Join(harness.Names(), ", "))
		}
	}
	if a.Workspace != nil {
		if v.checkAbsPath(at(a.Body, "workspace"), "workspace", *a.Workspace) {
			ag.Workspace = *a.Workspace
			// Workspaces are StateDirectory= of the agent unit so that systemd
			// owns them for the agent's dynamic user, which requires /var/lib.
			if !strings.HasPrefix(ag.Workspace, "/var/lib/") {
				v.errorf(at(a.Body, "workspace"), "Workspace outside /var/lib", "agent %q: workspace %s must be below /var/lib/ (systemd hands it to the cage's dynamic user there), e.g. %s.", a.Name, ag.Workspace, paths.DefaultWorkspace(a.Name))
			}
			for _, bad := range []string{"/", "/etc", "/usr", "/nix", "/run", "/var", "/var/lib", "/home", "/root", "/proc", "/sys", "/dev", "/tmp", "/boot"} {
				if ag.Workspace == bad {
					v.errorf(at(a.Body, "workspace"), "Unsafe workspace", "agent %q: workspace %s is a system directory; the agent would own it. Use a directory of its own such as %s.", a.Name, bad, paths.DefaultWorkspace(a.Name))
				}
			}
		}
	}
	if a.Tools != nil {
		if !channelRE.MatchString(*a.Tools) {
			v.errorf(at(a.Body, "tools"), "Invalid tool profile", "agent %q: tools = %q must be a profile name (a-z, 0-9, '.', '_', '-').", a.Name, *a.Tools)
		}
		ag.Tools = *a.Tools
	}
	if a.Image != nil {
		if a.Backend != BackendPodman {
			v.errorf(at(a.Body, "image"), "Image without podman", "agent %q: image is only used by backend = \"podman\". Remove it or change the backend.", a.Name)
		}
		if *a.Image == "" || strings.ContainsAny(*a.Image, " \n\"'%$") {
			v.errorf(at(a.Body, "image"), "Invalid image", "agent %q: image %q must be an image reference such as \"docker.io/library/debian:bookworm\".", a.Name, *a.Image)
		}
		ag.Image = *a.Image
	}
	if a.Autostart != nil {
		ag.Autostart = *a.Autostart
	}
	if a.Interactive != nil && *a.Interactive {
		if a.Backend == BackendPodman {
			v.errorf(at(a.Body, "interactive"), "Interactive podman agent", "agent %q: interactive = true needs backend \"service\" or \"nspawn\" (caged hands the agent a terminal). Change the backend or remove interactive.", a.Name)
		}
		ag.Interactive = true
	}
	ag.Learn = v.learn(a)
	ag.Approval = v.approval(a)
	v.turn(a, ag)
	if len(a.Resources) > 1 {
		v.errorf(block(a.Resources[1].Body), "Duplicate resources block", "agent %q has more than one resources block. Merge them.", a.Name)
	}
	if len(a.Resources) > 0 {
		r := a.Resources[0]
		if r.Memory != nil {
			if !memoryRE.MatchString(*r.Memory) {
				v.errorf(at(r.Body, "memory"), "Invalid memory limit", "agent %q: memory = %q; write bytes with an optional K, M, G or T suffix (\"2G\"), a percentage (\"50%%\") or \"infinity\".", a.Name, *r.Memory)
			}
			ag.Resources.Memory = *r.Memory
		}
		if r.CPU != nil {
			if !cpuRE.MatchString(*r.CPU) || *r.CPU == "0%" {
				v.errorf(at(r.Body, "cpu"), "Invalid CPU limit", "agent %q: cpu = %q; write a share of one CPU as a percentage, e.g. \"150%%\" for one and a half CPUs.", a.Name, *r.CPU)
			}
			ag.Resources.CPU = *r.CPU
		}
		if r.Tasks != nil {
			if *r.Tasks < 1 || *r.Tasks > 1<<22 {
				v.errorf(at(r.Body, "tasks"), "Invalid task limit", "agent %q: tasks = %d; use a number of processes and threads between 1 and 4194304.", a.Name, *r.Tasks)
			}
			ag.Resources.Tasks = *r.Tasks
		}
	}

	// Egress: by name, inline, or the deny-all default.
	var rp *resolvedPolicy
	switch {
	case a.Egress != nil && len(a.Inline) > 0:
		v.errorf(at(a.Body, "egress"), "Two egress policies", "agent %q sets both egress = %q and an inline egress_policy block. Keep one.", a.Name, *a.Egress)
		return nil
	case len(a.Inline) > 1:
		v.errorf(block(a.Inline[1].Body), "Duplicate egress_policy block", "agent %q has more than one inline egress_policy block. Merge them.", a.Name)
		return nil
	case len(a.Inline) == 1:
		rp = v.resolvePolicy("agent-"+a.Name, &a.Inline[0])
	default:
		name := DefaultPolicy
		if a.Egress != nil {
			name = *a.Egress
		} else if h != nil {
			name = h.Policy
		}
		rp = v.lookupPolicy(at(a.Body, "egress"), a.Name, name)
	}
	if rp == nil {
		return nil
	}
	ag.Policy = rp.p
	ag.InlinePolicy = len(a.Inline) == 1

	envs := map[string]string{}
	for k := range ag.Environment {
		envs[k] = "environment"
	}
	seenSecret := map[string]bool{}
	for i := range a.Secrets {
		if s := v.secret(a.Name, &a.Secrets[i], rp, h, envs, seenSecret); s != nil {
			ag.Secrets = append(ag.Secrets, *s)
		}
	}
	if h != nil && !seenSecret[h.Secret] {
		v.errorf(at(a.Body, "harness"), "Harness without its key", "agent %q: harness %q needs its API key, held by the gateway: add secret %q { source = \"/run/secrets/%s\" } (the cage sees a placeholder in %s).", a.Name, h.Name, h.Secret, h.Secret, h.Env)
	}
	return ag
}

func (v *validator) lookupPolicy(rng hcl.Range, agent, name string) *resolvedPolicy {
	if rp, ok := v.policies[name]; ok {
		return rp
	}
	if !policyNameRE.MatchString(name) {
		v.errorf(rng, "Invalid policy name", "agent %q: egress = %q is not a policy name.", agent, name)
		return nil
	}
	np, diags := v.loader.builtinPolicy(name)
	v.diags = append(v.diags, diags...)
	if np == nil {
		known := make([]string, 0, len(v.policies))
		for n := range v.policies {
			known = append(known, n)
		}
		known = append(known, v.loader.BuiltinPolicyNames()...)
		sort.Strings(known)
		v.errorf(rng, "Unknown egress policy", "agent %q: no egress_policy %q is declared or shipped. Declare egress_policy %q { ... } or use one of: %s.", agent, name, name, strings.Join(known, ", "))
		return nil
	}
	rp := v.resolvePolicy(name, &np.policy)
	v.policies[name] = rp
	return rp
}

func (v *validator) secret(agent string, s *secretV1, rp *resolvedPolicy, h *harness.Harness, envs map[string]string, seen map[string]bool) *Secret {
	rng := block(s.Body)
	if !secretNameRE.MatchString(s.Name) {
		v.errorf(rng, "Invalid secret name", "agent %q: secret %q: names are 1-64 characters of a-z, 0-9, '_' and '-', starting with a letter.", agent, s.Name)
		return nil
	}
	if seen[s.Name] {
		v.errorf(rng, "Duplicate secret", "agent %q declares secret %q twice. Rename one.", agent, s.Name)
		return nil
	}
	seen[s.Name] = true
	out := &Secret{Name: s.Name, Source: s.Source, Hosts: s.Hosts, Header: DefaultSecretHeader}
	switch {
	case s.Env != nil:
		out.Env = *s.Env
	case h != nil && h.Secret == s.Name:
		out.Env = h.Env // the variable the harness's CLI really reads
	default:
		hint := ""
		if h != nil {
			hint = fmt.Sprintf(" (harness %q fills it in only for its own secret %q)", h.Name, h.Secret)
		}
		v.errorf(block(s.Body), "Secret without a variable", "agent %q: secret %q: add env = \"API_KEY\", the variable in which the cage sees the placeholder%s.", agent, s.Name, hint)
		return nil
	}
	v.checkAbsPath(at(s.Body, "source"), "secret source", s.Source)
	if !envNameRE.MatchString(out.Env) {
		v.errorf(at(s.Body, "env"), "Invalid environment variable", "agent %q: secret %q: env = %q is not a variable name.", agent, s.Name, out.Env)
	} else if reservedEnv[out.Env] {
		v.errorf(at(s.Body, "env"), "Reserved environment variable", "agent %q: secret %q: %s is set by the cage itself. Pick another variable.", agent, s.Name, out.Env)
	} else if where, clash := envs[out.Env]; clash {
		v.errorf(at(s.Body, "env"), "Environment variable set twice", "agent %q: secret %q sets %s, which %s sets too. Remove one.", agent, s.Name, out.Env, where)
	}
	envs[out.Env] = fmt.Sprintf("secret %q", s.Name)

	binding, bound := rp.credentials[s.Name]
	if len(out.Hosts) == 0 && bound {
		out.Hosts = binding.Hosts
	}
	if s.Header != nil {
		out.Header = *s.Header
	} else if bound && binding.Header != nil {
		out.Header = *binding.Header
	}
	if !headerRE.MatchString(out.Header) {
		v.errorf(at(s.Body, "header"), "Invalid header name", "agent %q: secret %q: header = %q is not an HTTP header name.", agent, s.Name, out.Header)
	}
	if len(out.Hosts) == 0 {
		v.errorf(rng, "Secret bound to no host", "agent %q: secret %q names no hosts, and policy %q has no credential %q block. Add hosts = [\"api.example.com\"] so the gateway knows where the real value may go.", agent, s.Name, rp.p.Name, s.Name)
	}
	for _, h := range out.Hosts {
		hr := at(s.Body, "hosts")
		if strings.HasPrefix(h, "*") {
			v.errorf(hr, "Wildcard credential host", "agent %q: secret %q: %q is a wildcard; a credential is only ever sent to exact host names. List each host.", agent, s.Name, h)
			continue
		}
		if err := policy.CheckPattern(h); err != nil {
			v.errorf(hr, "Invalid host", "agent %q: secret %q: %v.", agent, s.Name, err)
			continue
		}
		if policy.MatchDeny(rp.p.Deny, h) != "" || policy.MatchAny(rp.p.Allow, h) == "" {
			v.errorf(hr, "Credential host not allowed", "agent %q: secret %q is bound to %s, which policy %q does not allow. Add it to allow, or remove it from the secret's hosts.", agent, s.Name, h, rp.p.Name)
		} else if policy.MatchAny(rp.p.Inspect, h) == "" {
			v.errorf(hr, "Credential host not inspected", "agent %q: secret %q is bound to %s, but policy %q does not inspect it; the gateway can only inject a credential into requests it has inspected. Add %q to inspect.", agent, s.Name, h, rp.p.Name, h)
		}
	}
	return out
}

func (v *validator) resolvePolicy(name string, p *policyV1) *resolvedPolicy {
	out := policy.Policy{
		Name:    name,
		Allow:   nonNil(p.Allow),
		Deny:    nonNil(p.Deny),
		Ports:   p.Ports,
		Inspect: nonNil(p.Inspect),
		RateLimit: policy.RateLimit{
			PerSecond: policy.DefaultRatePerSecond,
			Burst:     policy.DefaultRateBurst,
		},
		Limits: policy.Limits{
			MaxTunnels:         policy.DefaultMaxTunnels,
			MaxHeaderBytes:     policy.DefaultMaxHeaderBytes,
			MaxBodyBytes:       policy.DefaultMaxBodyBytes,
			IdleTimeoutSeconds: policy.DefaultIdleTimeoutSeconds,
		},
		DNS: policy.DNS{Enabled: true, AllowTypes: append([]string(nil), policy.DefaultDNSAllowTypes...), DenyTypes: append([]string(nil), policy.DefaultDNSDenyTypes...), MaxLabelLength: policy.DefaultMaxLabelLength},
	}
	if len(out.Ports) == 0 {
		out.Ports = []int{DefaultPort}
	}
	for _, port := range out.Ports {
		if port < 1 || port > 65535 {
			v.errorf(at(p.Body, "ports"), "Invalid port", "egress_policy %q: port %d is outside 1-65535.", name, port)
		}
	}
	checkList := func(attr string, list []string) {
		seen := map[string]bool{}
		for _, h := range list {
			if err := policy.CheckPattern(h); err != nil {
				v.errorf(at(p.Body, attr), "Invalid host pattern", "egress_policy %q: %s: %v.", name, attr, err)
			}
			if seen[h] {
				v.errorf(at(p.Body, attr), "Duplicate host pattern", "egress_policy %q: %s lists %q twice. Remove one.", name, attr, h)
			}
			seen[h] = true
		}
	}
	checkList("allow", out.Allow)
	checkList("deny", out.Deny)
	checkList("inspect", out.Inspect)
	for _, h := range out.Allow {
		if policy.MatchAny(out.Deny, h) == h {
			v.errorf(at(p.Body, "deny"), "Conflicting host rules", "egress_policy %q: %q is in both allow and deny. Deny always wins; remove it from one list to say what you mean.", name, h)
		}
	}
	v.denyBelowNotes(name, p.Body, out.Allow, out.Deny)
	out.WebSocket = DefaultWebSocket
	if p.WebSocket != nil {
		out.WebSocket = *p.WebSocket
	}
	out.HTTPRules = v.httpRules(name, p.HTTPRules, out.Inspect)
	for _, h := range out.Inspect {
		// An inspect pattern must be covered by allow: "*.x" needs "*.x",
		// an exact name needs a pattern matching it.
		probe := strings.TrimPrefix(h, "*.")
		covered := policy.MatchAny(out.Allow, probe) != "" || (strings.HasPrefix(h, "*.") && contains(out.Allow, h))
		if strings.HasPrefix(h, "*.") {
			covered = contains(out.Allow, h) || policy.MatchAny(out.Allow, "x."+probe) != ""
		}
		if !covered {
			v.errorf(at(p.Body, "inspect"), "Inspected host not allowed", "egress_policy %q: inspect lists %q, which allow does not cover. Add it to allow or remove it from inspect.", name, h)
		}
	}
	if len(p.RateLimit) > 1 {
		v.errorf(block(p.RateLimit[1].Body), "Duplicate rate_limit block", "egress_policy %q has more than one rate_limit block. Merge them.", name)
	}
	if len(p.RateLimit) > 0 {
		r := p.RateLimit[0]
		if r.PerSecond <= 0 {
			v.errorf(at(r.Body, "per_second"), "Invalid rate limit", "egress_policy %q: per_second must be above 0 (requests per second per host).", name)
		}
		out.RateLimit.PerSecond = r.PerSecond
		out.RateLimit.Burst = max(1, int(r.PerSecond))
		if r.Burst != nil {
			if *r.Burst < 1 {
				v.errorf(at(r.Body, "burst"), "Invalid burst", "egress_policy %q: burst must be at least 1.", name)
			}
			out.RateLimit.Burst = *r.Burst
		}
	}
	if len(p.Limits) > 1 {
		v.errorf(block(p.Limits[1].Body), "Duplicate limits block", "egress_policy %q has more than one limits block. Merge them.", name)
	}
	if len(p.Limits) > 0 {
		l := p.Limits[0]
		positive := func(attr string, n int64) bool {
			if n < 1 {
				v.errorf(at(l.Body, attr), "Invalid limit", "egress_policy %q: %s must be at least 1.", name, attr)
				return false
			}
			return true
		}
		if l.MaxTunnels != nil && positive("max_tunnels", int64(*l.MaxTunnels)) {
			out.Limits.MaxTunnels = *l.MaxTunnels
		}
		if l.MaxHeaderBytes != nil && positive("max_header_bytes", int64(*l.MaxHeaderBytes)) {
			out.Limits.MaxHeaderBytes = *l.MaxHeaderBytes
		}
		if l.MaxBodyBytes != nil && positive("max_body_bytes", *l.MaxBodyBytes) {
			out.Limits.MaxBodyBytes = *l.MaxBodyBytes
		}
		if l.IdleTimeout != nil {
			d, err := time.ParseDuration(*l.IdleTimeout)
			if err != nil || d < time.Second {
				v.errorf(at(l.Body, "idle_timeout"), "Invalid idle timeout", "egress_policy %q: idle_timeout = %q; write a duration of at least one second such as \"90s\" or \"5m\".", name, *l.IdleTimeout)
			} else {
				out.Limits.IdleTimeoutSeconds = int(d / time.Second)
			}
		}
	}
	out.Inspectors = v.inspectors(name, p, out.Limits.MaxBodyBytes)
	if len(p.DNS) > 1 {
		v.errorf(block(p.DNS[1].Body), "Duplicate dns block", "egress_policy %q has more than one dns block. Merge them.", name)
	}
	if len(p.DNS) > 0 {
		d := p.DNS[0]
		if d.Enabled != nil {
			out.DNS.Enabled = *d.Enabled
		}
		if d.AllowTypes != nil {
			out.DNS.AllowTypes = v.dnsTypes(name, d.Body, "allow_types", d.AllowTypes)
		}
		if d.DenyTypes != nil {
			out.DNS.DenyTypes = v.dnsTypes(name, d.Body, "deny_types", d.DenyTypes)
		}
		if d.MaxLabelLength != nil {
			if *d.MaxLabelLength < 1 || *d.MaxLabelLength > 63 {
				v.errorf(at(d.Body, "max_label_length"), "Invalid label length", "egress_policy %q: max_label_length must be between 1 and 63.", name)
			}
			out.DNS.MaxLabelLength = *d.MaxLabelLength
		}
	}
	if p.UnsafeAllowLoopbackUpstreams != nil {
		out.UnsafeAllowLoopbackUpstreams = *p.UnsafeAllowLoopbackUpstreams
	}
	if p.UnsafeAllowPrivateUpstreams != nil {
		out.UnsafeAllowPrivateUpstreams = *p.UnsafeAllowPrivateUpstreams
	}
	if p.UnsafeBenchIPLiterals != nil {
		v.errorf(at(p.Body, "unsafe_bench_ip_literals"), "Bench-only setting", "egress_policy %q: unsafe_bench_ip_literals is not a policy setting: IP-literal destinations exist only as cage-egress --unsafe-bench-ip-literals for bench/egress/run.sh, which the rendered units never pass and which refuses to run under systemd. Remove it; allow the host's name instead.", name)
	}
	creds := map[string]credentialV1{}
	for _, c := range p.Credentials {
		if _, dup := creds[c.Name]; dup {
			v.errorf(block(c.Body), "Duplicate credential", "egress_policy %q declares credential %q twice.", name, c.Name)
		}
		creds[c.Name] = c
	}
	return &resolvedPolicy{p: out, credentials: creds}
}

// dnsTypes checks and upper-cases a list of DNS record type names.
func (v *validator) dnsTypes(name string, body hcl.Body, attr string, list []string) []string {
	out := []string{}
	for _, t := range list {
		up := strings.ToUpper(t)
		if _, ok := dns.StringToType[up]; !ok {
			v.errorf(at(body, attr), "Unknown DNS record type", "egress_policy %q: %s: %q is not a DNS record type; write names such as \"TXT\" or \"ANY\".", name, attr, t)
		}
		out = append(out, up)
	}
	return out
}

func (v *validator) inspectors(name string, p *policyV1, maxBody int64) []policy.Inspector {
	byName := map[string]policy.Inspector{
		policy.InspectRealValues:     {Name: policy.InspectRealValues, Action: policy.ActionBlock},
		policy.InspectSecretPatterns: {Name: policy.InspectSecretPatterns, Action: policy.ActionBlock},
		policy.InspectBodySize:       {Name: policy.InspectBodySize, Action: policy.ActionBlock, MaxBytes: maxBody},
		policy.InspectEntropy:        {Name: policy.InspectEntropy, Action: policy.ActionFlag, Threshold: policy.DefaultEntropyBits},
		policy.InspectEncodedBlobs:   {Name: policy.InspectEncodedBlobs, Action: policy.ActionFlag, MinLength: policy.DefaultBlobMinLength},
	}
	seen := map[string]bool{}
	for _, in := range p.Inspectors {
		base, known := byName[in.Name]
		rng := block(in.Body)
		if !known {
			v.errorf(rng, "Unknown inspector", "egress_policy %q: inspector %q does not exist; use one of %s.", name, in.Name, strings.Join(policy.InspectorNames, ", "))
			continue
		}
		if seen[in.Name] {
			v.errorf(rng, "Duplicate inspector", "egress_policy %q configures inspector %q twice.", name, in.Name)
		}
		seen[in.Name] = true
		switch in.Action {
		case policy.ActionFlag, policy.ActionBlock:
		default:
			v.errorf(at(in.Body, "action"), "Unknown inspector action", "egress_policy %q: inspector %q: action = %q; use \"flag\" or \"block\".", name, in.Name, in.Action)
		}
		if in.Name == policy.InspectRealValues && in.Action != policy.ActionBlock {
			v.errorf(at(in.Body, "action"), "Real credential values are always blocked", "egress_policy %q: a real credential value leaving the cage is never only flagged. Remove this inspector block or set action = \"block\".", name)
		}
		base.Action = in.Action
		if in.Threshold != nil {
			if *in.Threshold <= 0 || *in.Threshold > 8 {
				v.errorf(at(in.Body, "threshold"), "Invalid threshold", "egress_policy %q: inspector %q: threshold is in bits per byte, between 0 and 8.", name, in.Name)
			}
			base.Threshold = *in.Threshold
		}
		if in.MaxBytes != nil {
			if *in.MaxBytes < 1 {
				v.errorf(at(in.Body, "max_bytes"), "Invalid size", "egress_policy %q: inspector %q: max_bytes must be at least 1.", name, in.Name)
			}
			base.MaxBytes = *in.MaxBytes
		}
		if in.MinLength != nil {
			if *in.MinLength < 16 {
				v.errorf(at(in.Body, "min_length"), "Invalid length", "egress_policy %q: inspector %q: min_length below 16 would flag ordinary words.", name, in.Name)
			}
			base.MinLength = *in.MinLength
		}
		byName[in.Name] = base
	}
	out := make([]policy.Inspector, 0, len(policy.InspectorNames))
	for _, n := range policy.InspectorNames {
		out = append(out, byName[n])
	}
	return out
}

func (v *validator) account(a *accountV1, agents map[string]hcl.Range) *Account {
	rng := block(a.Body)
	out := &Account{Name: a.Name, Role: a.Role, Agents: a.Agents}
	if !policyNameRE.MatchString(a.Name) {
		v.errorf(rng, "Invalid account name", "account %q: names are 1-64 characters of a-z, 0-9, '_' and '-'.", a.Name)
	}
	switch {
	case a.User != nil && a.Group != nil:
		v.errorf(rng, "Account with user and group", "account %q sets both user and group. Declare one account per user or group.", a.Name)
	case a.User == nil && a.Group == nil:
		v.errorf(rng, "Account without user or group", "account %q needs user = \"name\" or group = \"name\".", a.Name)
	case a.User != nil:
		out.User = *a.User
		if !unixNameRE.MatchString(out.User) && !isUID(out.User) {
			v.errorf(at(a.Body, "user"), "Invalid user name", "account %q: user = %q is not a Unix user name or numeric uid.", a.Name, out.User)
		}
	default:
		out.Group = *a.Group
		if !unixNameRE.MatchString(out.Group) && !isUID(out.Group) {
			v.errorf(at(a.Body, "group"), "Invalid group name", "account %q: group = %q is not a Unix group name or numeric gid.", a.Name, out.Group)
		}
	}
	switch a.Role {
	case RoleViewer, RoleOperator, RoleAdmin:
	default:
		v.errorf(at(a.Body, "role"), "Unknown role", "account %q: role = %q; use \"viewer\" (read status), \"operator\" (start, stop, kill, quarantine) or \"admin\" (also apply and roll back releases).", a.Name, a.Role)
	}
	for _, n := range a.Agents {
		if _, ok := agents[n]; !ok {
			v.errorf(at(a.Body, "agents"), "Unknown agent", "account %q covers agent %q, which is not declared. Declare it or remove it from agents (leave agents out to cover every agent).", a.Name, n)
		}
	}
	return out
}

func isUID(s string) bool {
	n, err := strconv.Atoi(s)
	return err == nil && n >= 0
}

func (v *validator) store(s *storeV1) *Store {
	out := &Store{Root: paths.DefaultStoreRoot, Channel: s.Channel, Keys: s.Keys, NixKeys: s.NixKeys, Threshold: 1, Generations: DefaultGenerations, ExpiryWarning: DefaultExpiryWarning}
	if s.Root != nil && v.checkAbsPath(at(s.Body, "root"), "store root", *s.Root) {
		out.Root = *s.Root
	}
	if !channelRE.MatchString(s.Channel) {
		v.errorf(at(s.Body, "channel"), "Invalid channel", "store: channel = %q; use a short name such as \"stable\" (a-z, 0-9, '.', '_', '-').", s.Channel)
	}
	if len(s.Keys) == 0 {
		v.errorf(at(s.Body, "keys"), "No trusted keys", "store: keys is empty, so no release could ever be accepted. List the PEM public key files releases are signed with (cagectl key generate makes a pair).")
	}
	out.Threshold = v.keyRole("store", s.Body, "keys", "threshold", s.Keys, s.Threshold)
	for _, k := range s.NixKeys {
		name, key, ok := strings.Cut(k, ":")
		if !ok || name == "" || key == "" {
			v.errorf(at(s.Body, "nix_keys"), "Invalid Nix public key", "store: %q is not a Nix public key; write \"name:base64\" as `nix key convert-secret-to-public` prints it.", k)
		}
	}
	if s.ExpiryWarning != nil {
		d, err := ParseDays(*s.ExpiryWarning)
		if err != nil || d < 0 {
			v.errorf(at(s.Body, "expiry_warning"), "Invalid expiry warning", "store: expiry_warning = %q; write days (\"7d\") or a duration (\"36h\"), or \"0\" to report only expired generations.", *s.ExpiryWarning)
		}
		out.ExpiryWarning = d
	}
	out.RootKeys = s.RootKeys
	out.RootThreshold = v.keyRole("store", s.Body, "root_keys", "root_threshold", s.RootKeys, s.RootThreshold)
	if s.Generations != nil {
		out.Generations = *s.Generations
		if *s.Generations < 2 {
			v.errorf(at(s.Body, "generations"), "Too few generations", "store: generations = %d; keep at least 2 so there is something to roll back to.", *s.Generations)
		}
	}
	return out
}

// onlyBlock hands the first block of a kind that may appear once per
// configuration (across all files) to use, refuses the others, and returns
// the first one's body (nil if there is none).
func onlyBlock[T any](v *validator, files []*fileV1, kind string, blocks func(*fileV1) []T, body func(*T) hcl.Body, use func(*T)) hcl.Body {
	var first hcl.Body
	for _, f := range files {
		bs := blocks(f)
		for i := range bs {
			b := &bs[i]
			if first != nil {
				v.errorf(block(body(b)), "Duplicate "+kind+" block", "a %s block is already declared at %s. Keep one %s block per configuration.", kind, block(first), kind)
				continue
			}
			first = body(b)
			use(b)
		}
	}
	return first
}

// metrics checks where caged serves metrics: loopback or a socket in its
// runtime directory. Anything wider would publish per-agent activity to the
// network; a remote Prometheus scrapes through a proxy the operator runs
// (docs/fleet.md).
func (v *validator) metrics(m *metricsV1) *Metrics {
	out := &Metrics{Listen: DefaultMetricsListen}
	if m.Listen == nil {
		return out
	}
	out.Listen = *m.Listen
	rng := at(m.Body, "listen")
	if p, ok := strings.CutPrefix(*m.Listen, "unix:"); ok {
		if !strings.HasPrefix(p, MetricsSocketDir) || path.Clean(p) != p || len(p) == len(MetricsSocketDir) {
			v.errorf(rng, "Invalid metrics socket", "metrics: listen = %q; a socket must be a file under %s (caged's runtime directory), such as \"unix:%smetrics.sock\".", *m.Listen, MetricsSocketDir, MetricsSocketDir)
		}
		return out
	}
	host, port, err := net.SplitHostPort(*m.Listen)
	ip := net.ParseIP(host)
	n, perr := strconv.Atoi(port)
	switch {
	case err != nil || perr != nil || n < 1 || n > 65535 || ip == nil:
		v.errorf(rng, "Invalid metrics address", "metrics: listen = %q; write a loopback address and port such as %q, or a socket such as \"unix:%smetrics.sock\".", *m.Listen, DefaultMetricsListen, MetricsSocketDir)
	case !ip.IsLoopback():
		v.errorf(rng, "Metrics address not on loopback", "metrics: listen = %q; caged serves metrics on loopback (127.0.0.1, ::1) or a unix socket only. Scrape from another host through a proxy you run (docs/fleet.md).", *m.Listen)
	}
	return out
}

// channel checks the polled channel: where, how often, which CAs.
func (v *validator) channel(c *channelV1) *Channel {
	out := &Channel{URL: c.URL, Interval: DefaultChannelInterval}
	rng := at(c.Body, "url")
	if strings.HasPrefix(c.URL, "/") {
		if path.Clean(c.URL) != c.URL {
			v.errorf(rng, "Invalid channel URL", "channel: url = %q; write a clean absolute directory (no .., no trailing /) or an http(s):// URL.", c.URL)
		}
	} else if u, err := url.Parse(c.URL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.Fragment != "" || u.Opaque != "" {
		v.errorf(rng, "Invalid channel URL", "channel: url = %q; write the channel's base such as \"https://releases.example.org/nixcage/stable/\" (http or https, no #fragment), or an absolute directory.", c.URL)
	}
	if c.Interval != nil {
		d, err := ParseDays(*c.Interval)
		if err != nil || d < MinChannelInterval {
			v.errorf(at(c.Body, "interval"), "Invalid channel interval", "channel: interval = %q; write a duration of at least %s such as \"5m\" (the default is %s).", *c.Interval, MinChannelInterval, DefaultChannelInterval)
		}
		out.Interval = d
	}
	if c.CAFile != nil {
		out.CAFile = *c.CAFile
		if v.checkAbsPath(at(c.Body, "ca_file"), "channel ca_file", *c.CAFile) && !strings.HasPrefix(c.URL, "https://") {
			v.errorf(at(c.Body, "ca_file"), "CA file without https", "channel: ca_file is set but url %q is not https://; a CA file verifies an https server. Use an https URL or drop ca_file.", c.URL)
		}
	}
	return out
}

// evidence checks the quarantine copy's bounds: each must be positive
// (leave it out for the default).
func (v *validator) evidence(e *evidenceV1) Evidence {
	var out Evidence
	if e.MaxBytes != nil {
		if *e.MaxBytes <= 0 {
			v.errorf(at(e.Body, "max_bytes"), "Invalid evidence cap", "evidence: max_bytes = %d; give a positive number of bytes (such as 1073741824), or leave it out for the default.", *e.MaxBytes)
		}
		out.MaxBytes = *e.MaxBytes
	}
	if e.MaxEntries != nil {
		if *e.MaxEntries <= 0 {
			v.errorf(at(e.Body, "max_entries"), "Invalid evidence cap", "evidence: max_entries = %d; give a positive number of workspace entries, or leave it out for the default.", *e.MaxEntries)
		}
		out.MaxEntries = *e.MaxEntries
	}
	if e.MaxDuration != nil {
		d, err := ParseDays(*e.MaxDuration)
		if err != nil || d <= 0 {
			v.errorf(at(e.Body, "max_duration"), "Invalid evidence time limit", "evidence: max_duration = %q; write a positive duration such as \"2m\", or leave it out for the default.", *e.MaxDuration)
		}
		out.MaxDuration = d
	}
	return out
}

// ParseDays parses a duration written as days ("7d") or as Go writes one
// ("36h", "0").
func ParseDays(s string) (time.Duration, error) {
	if d, ok := strings.CutSuffix(s, "d"); ok {
		n, err := strconv.Atoi(d)
		if err != nil {
			return 0, fmt.Errorf("duration %q: %w", s, err)
		}
		return time.Duration(n) * 24 * time.Hour, nil
	}
	return time.ParseDuration(s)
}

// keyRole checks a list of PEM key files and its threshold (default 1):
// store.keys/threshold and store.root_keys/root_threshold.
func (v *validator) keyRole(blockName string, body hcl.Body, keysAttr, thrAttr string, keys []string, threshold *int) int {
	seen := map[string]bool{}
	for _, k := range keys {
		v.checkAbsPath(at(body, keysAttr), "key file", k)
		if seen[k] {
			v.errorf(at(body, keysAttr), "Duplicate key", "%s: %s lists %s twice; a threshold counts distinct keys.", blockName, keysAttr, k)
		}
		seen[k] = true
	}
	if threshold == nil {
		return 1
	}
	if *threshold < 1 || *threshold > len(keys) {
		v.errorf(at(body, thrAttr), "Invalid signature threshold", "%s: %s = %d with %d key(s) in %s; it must be between 1 and the number of keys.", blockName, thrAttr, *threshold, len(keys), keysAttr)
	}
	return *threshold
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// turn validates turn_command and turn_timeout (docs/relay.md).
func (v *validator) turn(a *agentV1, ag *Agent) {
	if a.TurnCommand != nil {
		c := *a.TurnCommand
		switch {
		case len(c) == 0 || c[0] == "":
			v.errorf(at(a.Body, "turn_command"), "Empty turn_command", "agent %q: turn_command must name the program a turn runs (the text comes on its stdin), e.g. [\"/workspace/bin/turn\"]; or remove it.", a.Name)
		case !filepath.IsAbs(c[0]):
			v.errorf(at(a.Body, "turn_command"), "Relative turn_command", "agent %q: turn_command[0] %q must be an absolute path inside the cage (there is no PATH lookup), e.g. \"%s/bin/claude\".", a.Name, c[0], paths.CageTools)
		case slices.ContainsFunc(c, func(s string) bool { return strings.ContainsRune(s, 0) }):
			v.errorf(at(a.Body, "turn_command"), "Invalid turn_command argument", "agent %q: turn_command arguments cannot contain NUL bytes.", a.Name)
		default:
			ag.TurnCommand = c
		}
	}
	if a.TurnTimeout != nil {
		d, err := time.ParseDuration(*a.TurnTimeout)
		if err != nil || d < time.Second || d > MaxTurnTimeout {
			v.errorf(at(a.Body, "turn_timeout"), "Invalid turn_timeout", "agent %q: turn_timeout = %q; write a duration from 1s to %s, e.g. \"10m\", or leave it out for the default (%s).", a.Name, *a.TurnTimeout, MaxTurnTimeout, DefaultTurnTimeout)
			return
		}
		ag.TurnTimeout = d
	}
}

// control checks the signed control commands' trust (docs/fleet.md,
// "Control commands"): its own key files and threshold, never the store's,
// so a release key issues commands only where it is listed here too.
func (v *validator) control(c *controlV1) *Control {
	out := &Control{Keys: c.Keys}
	if c.HostID != nil {
		out.HostID = *c.HostID
		if !hostIDRE.MatchString(*c.HostID) {
			v.errorf(at(c.Body, "host_id"), "Invalid host id", "control: host_id = %q; use lower-case letters, digits, '.' and '-' (at most 64), such as \"web-01\". Leave it out to use the host name.", *c.HostID)
		}
	}
	if len(c.Keys) == 0 {
		v.errorf(at(c.Body, "keys"), "No control keys", "control: keys is empty, so no command could ever be accepted. List the PEM public keys commands are signed with (cagectl key generate makes a pair; keep them apart from the release keys).")
	}
	out.Threshold = v.keyRole("control", c.Body, "keys", "threshold", c.Keys, c.Threshold)
	if c.AckURL != nil {
		u, err := url.Parse(*c.AckURL)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.User != nil || u.RawQuery != "" || u.Fragment != "" {
			v.errorf(at(c.Body, "ack_url"), "Invalid ack URL", "control: ack_url = %q; write an http(s) URL without credentials, query or fragment, such as \"https://acks.example.com/fleet/\" (acks are PUT below it).", *c.AckURL)
		}
		out.AckURL = *c.AckURL
	}
	return out
}

// learn validates learn and learn_for.
func (v *validator) learn(a *agentV1) *Learn {
	on := a.Learn != nil && *a.Learn
	if a.LearnFor != nil && !on {
		v.errorf(at(a.Body, "learn_for"), "learn_for without learn", "agent %q: learn_for = %q has no effect without learn = true. Add learn = true or remove learn_for.", a.Name, *a.LearnFor)
		return nil
	}
	if !on {
		return nil
	}
	l := &Learn{For: policy.DefaultLearnDuration, Deny: v.loader.BuiltinDenies()}
	if a.LearnFor != nil {
		d, err := time.ParseDuration(*a.LearnFor)
		if err != nil || d < time.Minute || d > policy.MaxLearnDuration {
			v.errorf(at(a.Body, "learn_for"), "Invalid learn_for", "agent %q: learn_for = %q; write a duration from 1m to %s, e.g. \"30m\" (learn mode is for a first run, not a policy).", a.Name, *a.LearnFor, policy.MaxLearnDuration)
			return nil
		}
		l.For = d
	}
	return l
}

// approval validates the approval block.
func (v *validator) approval(a *agentV1) *Approval {
	if len(a.Approval) == 0 {
		return nil
	}
	if len(a.Approval) > 1 {
		v.errorf(block(a.Approval[1].Body), "Duplicate approval block", "agent %q has more than one approval block. Merge them.", a.Name)
		return nil
	}
	b := a.Approval[0]
	ap := &Approval{Wait: policy.DefaultApprovalWait, MaxPending: policy.DefaultMaxPending}
	if b.Wait != nil {
		d, err := time.ParseDuration(*b.Wait)
		if err != nil || d < time.Second || d > policy.MaxApprovalWait {
			v.errorf(at(b.Body, "wait"), "Invalid approval wait", "agent %q: approval wait = %q; write a duration from 1s to %s, e.g. \"30s\" (the agent's request is held open that long).", a.Name, *b.Wait, policy.MaxApprovalWait)
			return nil
		}
		ap.Wait = d
	}
	if b.MaxPending != nil {
		if *b.MaxPending < 1 || *b.MaxPending > policy.MaxMaxPending {
			v.errorf(at(b.Body, "max_pending"), "Invalid approval max_pending", "agent %q: approval max_pending = %d; use 1 to %d requests waiting at once.", a.Name, *b.MaxPending, policy.MaxMaxPending)
			return nil
		}
		ap.MaxPending = *b.MaxPending
	}
	return ap
}
