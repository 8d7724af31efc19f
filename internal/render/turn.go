package render

import (
	"fmt"
	"path/filepath"
	"strconv"
	"time"

	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
)

// Turn is how one turn of a declared agent (docs/relay.md) differs from the
// agent's own unit: another command (the agent's turn command, its text on
// stdin), run once, in a unit and a container of its own name so that it
// runs next to the agent without touching it. Everything else — backend,
// hardening, user and id range, network namespace, gateway sockets,
// placeholders, binds, workspace — is rendered by the same code as the
// agent's unit, so a turn has exactly the agent's walls.
type Turn struct {
	// Timeout is the agent's turn_timeout. caged stops the turn then; the
	// unit's RuntimeMaxSec= (a little later) is the backstop should caged
	// itself be gone.
	Timeout time.Duration
}

// TurnBackstop is how much longer than the timeout systemd lets a turn run.
const TurnBackstop = time.Minute

// service is what the turn unit adds to the agent's [Service].
func (t *Turn) service() []string {
	return []string{
		"Restart", "no",
		// The unit stays loaded after the command ended, so caged reads
		// its exit status before it stops (and so unloads) the unit.
		"RemainAfterExit", "yes",
		"RuntimeMaxSec", strconv.FormatInt(int64((t.Timeout+TurnBackstop)/time.Second), 10),
	}
}

// agentUnit is the unit a cage of a runs as.
func (r *renderer) agentUnit(a *config.Agent) string {
	if r.turn != nil {
		return paths.Instance(paths.TurnTemplate, a.Name)
	}
	return paths.Instance(paths.AgentTemplate, a.Name)
}

// cageName names the nspawn machine or podman container of a: a turn's is
// its own, so that it never replaces (podman --replace) or shares the
// runtime state (nspawn) of the agent's running one.
func (r *renderer) cageName(a *config.Agent) string {
	if r.turn != nil {
		return "nixcage-" + a.Name + "-turn"
	}
	return "nixcage-" + a.Name
}

// TurnDropIn is the path (relative to "/") of the drop-in that is the whole
// configuration of agent's transient turn unit.
func TurnDropIn(agent string) string {
	return filepath.Join("run/systemd/system", paths.Instance(paths.TurnTemplate, agent)+".d", "50-cage.conf")
}

// RenderTurn returns the drop-in of one turn of the declared agent named
// agent in cfg, with o the options the agent's units were rendered with
// (so the paths it references are the installed ones). The turn runs
// argv, the agent's TurnArgv.
func RenderTurn(cfg *config.Config, agent string, o Options, argv []string) (File, error) {
	a := cfg.Agent(agent)
	if a == nil {
		return File{}, fmt.Errorf("render turn: no agent %q", agent)
	}
	if len(argv) == 0 || !filepath.IsAbs(argv[0]) {
		return File{}, fmt.Errorf("render turn: agent %s: the turn command must start with an absolute path", agent)
	}
	ta := *a
	ta.Command = argv
	// A turn's stdio are caged's descriptors, never a terminal.
	ta.Interactive = false
	t := &Turn{Timeout: a.TurnTimeout}
	if t.Timeout <= 0 {
		t.Timeout = config.DefaultTurnTimeout
	}
	r := &renderer{cfg: cfg, o: o, turn: t}
	if err := r.agent(&ta); err != nil {
		return File{}, fmt.Errorf("render turn: agent %s: %w", agent, err)
	}
	unit := filepath.Join("systemd/system", paths.Instance(paths.AgentTemplate, agent))
	for _, f := range r.files {
		if f.Path == unit {
			f.Path = TurnDropIn(agent)
			return f, nil
		}
	}
	return File{}, fmt.Errorf("render turn: agent %s: no unit rendered", agent)
}
