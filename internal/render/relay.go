package render

import (
	"path/filepath"
	"sort"
	"strings"

	"github.com/nixcage/nixcage/internal/paths"
)

// The relay's resource ceiling: it holds a few messages and at most one
// file of max_file_bytes in flight per command (files stream to disk).
const (
	relayMemoryMax = "256M"
	relayTasksMax  = "64"
)

// relay renders the chat relay when one is declared: its unit, the system
// user it runs as, and its runtime document (docs/relay.md).
func (r *renderer) relay() error {
	rl := r.cfg.Relay
	if rl == nil {
		return nil
	}
	doc, err := marshal(rl.Doc())
	if err != nil {
		return err
	}
	r.add(paths.RelayConfig, 0o644, doc)
	// A fixed system user (paths.RelayUser says why); sysusers.d creates
	// it on any systemd host, the NixOS module declares it in users.users.
	r.add(paths.RelaySysusers, 0o644, []byte("# Rendered by cagectl render: the user cage-relay.service runs as (docs/relay.md).\n"+
		"u "+paths.RelayUser+" - \"nixcage chat relay\" - -\n"))

	svc := sec("Service",
		"Type", "exec",
		"ExecStart", join(r.bin("cage-relay"), "--config", filepath.Join(r.o.Prefix, paths.RelayConfig)),
		// DynamicUser= with a declared user uses that user and keeps the
		// rest of what DynamicUser= implies (no files of its own anywhere
		// it could write, IPC removed at stop).
		"DynamicUser", "yes",
		"User", paths.RelayUser,
		"Group", paths.RelayUser,
		// The token is all the relay holds: a credential, readable by this
		// unit alone, never in its environment or on its command line.
		"LoadCredential", paths.RelayTokenCredential+":"+rl.TokenFile,
		"Restart", "on-failure",
		"RestartSec", "5",
	)
	svc.add(baseHardening()...)
	// The Bot API over the network, caged over the system bus.
	svc.add(unprivilegedHardening()...)
	svc.add(
		"PrivateIPC", "yes",
		// Nothing of nixcage's state is the relay's business: it reaches
		// workspaces, evidence and the store only through caged. Hidden on
		// top of their modes, with every secret source and the token's own
		// source (systemd reads that for LoadCredential=, the relay never).
		"InaccessiblePaths", strings.Join(r.relayHidden(), " "),
		"MemoryMax", relayMemoryMax,
		"TasksMax", relayTasksMax,
	)
	r.unit(paths.RelayUnit,
		sec("Unit",
			"Description", "nixcage chat relay (Telegram)",
			"Documentation", "https://github.com/nixcage/nixcage/blob/main/docs/relay.md",
			"Wants", "network-online.target",
			"After", "network-online.target dbus.socket "+paths.CagedUnit,
		),
		svc,
		sec("Install", "WantedBy", "multi-user.target"),
	)
	return nil
}

// relayHidden are the paths the relay's unit cannot see at all ("-": a
// path that does not exist is no error).
func (r *renderer) relayHidden() []string {
	set := map[string]bool{
		"/var/lib/nixcage": true, paths.RuntimeRoot: true,
		r.cfg.Relay.TokenFile: true,
	}
	if r.cfg.Store != nil {
		set[r.cfg.Store.Root] = true
	}
	for _, a := range r.cfg.Agents {
		set[a.Workspace] = true
		for _, s := range a.Secrets {
			set[s.Source] = true
		}
	}
	var out []string
	for p := range set {
		if p != "/var/lib/nixcage" && p != paths.RuntimeRoot && (strings.HasPrefix(p, "/var/lib/nixcage/") || strings.HasPrefix(p, paths.RuntimeRoot+"/")) {
			continue // hidden with its parent
		}
		out = append(out, "-"+p)
	}
	sort.Strings(out)
	return out
}
