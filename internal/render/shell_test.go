package render

import (
	"bytes"
	"strings"
	"testing"

	"github.com/coreos/go-systemd/v22/unit"

	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
)

// agentService renders agent name of the reference example and returns its
// unit's [Service] options, as caged reads them from systemd's files.
func agentService(t *testing.T, name string) (*config.Agent, []*unit.UnitOption) {
	t.Helper()
	cfg := loadExample(t, "reference.hcl")
	files, err := Render(cfg, DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		if f.Path == "systemd/system/"+paths.Instance(paths.AgentTemplate, name) {
			opts, err := unit.DeserializeOptions(bytes.NewReader(f.Data))
			if err != nil {
				t.Fatal(err)
			}
			return cfg.Agent(name), opts
		}
	}
	t.Fatalf("no unit for %s", name)
	return nil, nil
}

// A shell's drop-in carries the agent's walls and exactly one command, the
// shell's: nothing of how the agent is started survives, and a drop-in
// systemd did not apply leaves a unit with no ExecStart= at all.
func TestShellDropIn(t *testing.T) {
	for _, name := range []string{"alice", "bob"} {
		a, opts := agentService(t, name)
		t.Run(a.Backend, func(t *testing.T) {
			agentUnit := paths.Instance(paths.AgentTemplate, name)
			data, err := ShellDropIn(a, Shell{AgentUnit: agentUnit, AgentService: opts, Command: []string{"id", "-u"}, Term: "xterm", By: "root (uid 0)",
				ContainerPID: 4242, Nsenter: "/usr/bin/nsenter"})
			if err != nil {
				t.Fatal(err)
			}
			got, err := unit.DeserializeOptions(bytes.NewReader(data))
			if err != nil {
				t.Fatal(err)
			}
			values := map[string][]string{}
			for _, o := range got {
				values[o.Section+"."+o.Name] = append(values[o.Section+"."+o.Name], o.Value)
			}
			if e := values["Service.ExecStart"]; len(e) != 1 || !strings.HasSuffix(e[0], `/bin/sh -c "exec \"$$0\" \"$$@\"" id -u`) {
				t.Errorf("ExecStart = %q, want the shell's command only", e)
			}
			for _, k := range []string{"Service.Restart", "Service.RemainAfterExit", "Service.Type"} {
				if v := values[k]; len(v) != 1 {
					t.Errorf("%s = %q, want the shell's one value", k, v)
				}
			}
			if v := values["Unit.BindsTo"]; len(v) != 1 || v[0] != agentUnit {
				t.Errorf("BindsTo = %q, want the agent's unit", v)
			}
			switch a.Backend {
			case config.BackendService:
				for k, want := range map[string]string{"Service.User": "nixcage-" + name, "Service.DynamicUser": "yes", "Service.CapabilityBoundingSet": "",
					"Service.NetworkNamespacePath": paths.NetnsPath(name), "Service.PrivateUsers": "yes", "Unit.JoinsNamespaceOf": agentUnit} {
					if v := values[k]; len(v) != 1 || v[0] != want {
						t.Errorf("%s = %q, want %q (the agent's)", k, v, want)
					}
				}
				if len(values["Service.SystemCallFilter"]) == 0 || len(values["Service.BindReadOnlyPaths"]) == 0 {
					t.Error("the agent's filters and binds were not taken over")
				}
			case config.BackendNspawn:
				cmd := values["Service.ExecStart"][0]
				for _, want := range []string{"/usr/bin/nsenter --target=4242 --user --mount", "--root --wd -- " + paths.CageSeal + " --no-caps --chdir /workspace --"} {
					if !strings.Contains(cmd, want) {
						t.Errorf("ExecStart lacks %q: %s", want, cmd)
					}
				}
				for _, k := range []string{"Service.RestrictSUIDSGID", "Service.NoNewPrivileges", "Service.IPAddressDeny", "Service.EnvironmentFile"} {
					if len(values[k]) == 0 {
						t.Errorf("%s missing", k)
					}
				}
				if len(values["Service.Delegate"]) != 0 || len(values["Service.KillMode"]) != 0 {
					t.Error("the container manager's Delegate= or KillMode= reached the shell")
				}
			}
		})
	}
	a, opts := agentService(t, "alice")
	opts = append(opts, &unit.UnitOption{Section: "Service", Name: "BindPaths", Value: "/srv/%i:/data"})
	if _, err := ShellDropIn(a, Shell{AgentUnit: "x", AgentService: opts}); err == nil || !strings.Contains(err.Error(), "specifier") {
		t.Errorf("a specifier in the agent's unit: %v, want a refusal", err)
	}
	a.Backend = config.BackendPodman
	if _, err := ShellDropIn(a, Shell{AgentUnit: "x", AgentService: opts}); err == nil || !strings.Contains(err.Error(), "podman exec") {
		t.Errorf("podman: %v, want a refusal naming podman exec", err)
	}
}
