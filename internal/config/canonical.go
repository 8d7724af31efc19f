package config

import (
	"encoding/json"
	"fmt"
	"sort"

	"github.com/nixcage/nixcage/internal/policy"
)

// Canonical writes cfg as HCL's JSON syntax with every default spelled out.
// Loading the result gives back an equal Config: it is what caged reads, and
// what the NixOS module's JSON must look like. encoding/json sorts map keys,
// so the output is deterministic.
func Canonical(cfg *Config) ([]byte, error) {
	doc := map[string]any{"version": 1}
	agents := map[string]any{}
	policies := map[string]any{}
	for _, a := range cfg.Agents {
		m := map[string]any{
			"backend":   a.Backend,
			"command":   a.Command,
			"workspace": a.Workspace,
			"autostart": a.Autostart,
			"resources": canonResources(a.Resources),
		}
		if len(a.Environment) > 0 {
			m["environment"] = a.Environment
		}
		if a.Interactive {
			m["interactive"] = true
		}
		if a.Learn != nil {
			m["learn"] = true
			m["learn_for"] = a.Learn.For.String()
		}
		if a.Approval != nil {
			m["approval"] = map[string]any{"wait": a.Approval.Wait.String(), "max_pending": a.Approval.MaxPending}
		}
		if a.TurnCommand != nil {
			m["turn_command"] = a.TurnCommand
		}
		if a.TurnTimeout != DefaultTurnTimeout && a.TurnTimeout != 0 {
			m["turn_timeout"] = a.TurnTimeout.String()
		}
		if a.Tools != "" {
			m["tools"] = a.Tools
		}
		if a.Image != "" {
			m["image"] = a.Image
		}
		if a.Harness != "" {
			m["harness"] = a.Harness
		}
		if a.InlinePolicy {
			m["egress_policy"] = canonPolicy(a.Policy)
		} else {
			m["egress"] = a.Policy.Name
			// A named policy is resolved once by the loader and shared by
			// every agent naming it, so the first copy stands for all.
			if _, ok := policies[a.Policy.Name]; !ok {
				policies[a.Policy.Name] = canonPolicy(a.Policy)
			}
		}
		if len(a.Secrets) > 0 {
			secrets := map[string]any{}
			for _, s := range a.Secrets {
				secrets[s.Name] = map[string]any{"source": s.Source, "env": s.Env, "hosts": s.Hosts, "header": s.Header}
			}
			m["secret"] = secrets
		}
		agents[a.Name] = m
	}
	if len(agents) > 0 {
		doc["agent"] = agents
	}
	// Declared but unused policies stay available to caged (cagectl run).
	for _, p := range cfg.Policies {
		if _, ok := policies[p.Name]; !ok {
			policies[p.Name] = canonPolicy(p)
		}
	}
	if len(policies) > 0 {
		doc["egress_policy"] = policies
	}
	if len(cfg.Accounts) > 0 {
		accts := map[string]any{}
		for _, a := range cfg.Accounts {
			m := map[string]any{"role": a.Role}
			if a.User != "" {
				m["user"] = a.User
			} else {
				m["group"] = a.Group
			}
			if len(a.Agents) > 0 {
				ags := append([]string(nil), a.Agents...)
				sort.Strings(ags)
				m["agents"] = ags
			}
			accts[a.Name] = m
		}
		doc["account"] = accts
	}
	if s := cfg.Store; s != nil {
		m := map[string]any{
			"root": s.Root, "channel": s.Channel, "keys": s.Keys,
			"threshold": s.Threshold, "generations": s.Generations,
			"expiry_warning": s.ExpiryWarning.String(),
		}
		if len(s.NixKeys) > 0 {
			m["nix_keys"] = s.NixKeys
		}
		if len(s.RootKeys) > 0 {
			m["root_keys"], m["root_threshold"] = s.RootKeys, s.RootThreshold
		}
		doc["store"] = m
	}
	if e := cfg.Evidence; e != (Evidence{}) {
		m := map[string]any{}
		if e.MaxBytes > 0 {
			m["max_bytes"] = e.MaxBytes
		}
		if e.MaxEntries > 0 {
			m["max_entries"] = e.MaxEntries
		}
		if e.MaxDuration > 0 {
			m["max_duration"] = e.MaxDuration.String()
		}
		doc["evidence"] = m
	}
	if cfg.Metrics != nil {
		doc["metrics"] = map[string]any{"listen": cfg.Metrics.Listen}
	}
	if c := cfg.Control; c != nil {
		m := map[string]any{"keys": c.Keys, "threshold": c.Threshold}
		if c.HostID != "" {
			m["host_id"] = c.HostID
		}
		if c.AckURL != "" {
			m["ack_url"] = c.AckURL
		}
		doc["control"] = m
	}
	if r := cfg.Relay; r != nil {
		doc["relay"] = canonRelay(r)
	}
	if c := cfg.Channel; c != nil {
		m := map[string]any{"url": c.URL, "interval": c.Interval.String()}
		if c.CAFile != "" {
			m["ca_file"] = c.CAFile
		}
		doc["channel"] = m
	}
	b, err := json.MarshalIndent(doc, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}

func canonResources(r Resources) map[string]any {
	m := map[string]any{"memory": r.Memory, "tasks": r.Tasks}
	if r.CPU != "" {
		m["cpu"] = r.CPU
	}
	return m
}

func canonPolicy(p policy.Policy) map[string]any {
	inspectors := map[string]any{}
	for _, in := range p.Inspectors {
		m := map[string]any{"action": in.Action}
		if in.Threshold != 0 {
			m["threshold"] = in.Threshold
		}
		if in.MaxBytes != 0 {
			m["max_bytes"] = in.MaxBytes
		}
		if in.MinLength != 0 {
			m["min_length"] = in.MinLength
		}
		inspectors[in.Name] = m
	}
	m := map[string]any{
		"websocket":  p.WebSocket,
		"allow":      p.Allow,
		"deny":       p.Deny,
		"ports":      p.Ports,
		"inspect":    p.Inspect,
		"rate_limit": map[string]any{"per_second": p.RateLimit.PerSecond, "burst": p.RateLimit.Burst},
		"inspector":  inspectors,
		"limits": map[string]any{
			"max_tunnels":      p.Limits.MaxTunnels,
			"max_header_bytes": p.Limits.MaxHeaderBytes,
			"max_body_bytes":   p.Limits.MaxBodyBytes,
			"idle_timeout":     fmt.Sprintf("%ds", p.Limits.IdleTimeoutSeconds),
		},
		"dns": map[string]any{
			"enabled":          p.DNS.Enabled,
			"allow_types":      p.DNS.AllowTypes,
			"deny_types":       p.DNS.DenyTypes,
			"max_label_length": p.DNS.MaxLabelLength,
		},
		"unsafe_allow_loopback_upstreams": p.UnsafeAllowLoopbackUpstreams,
		"unsafe_allow_private_upstreams":  p.UnsafeAllowPrivateUpstreams,
	}
	if len(p.HTTPRules) > 0 {
		rules := map[string]any{}
		for _, r := range p.HTTPRules {
			rm := map[string]any{"hosts": r.Hosts, "action": r.Action}
			if len(r.Methods) > 0 {
				rm["methods"] = r.Methods
			}
			if len(r.Paths) > 0 {
				rm["paths"] = r.Paths
			}
			rules[r.Name] = rm
		}
		m["http_rule"] = rules
	}
	return m
}
