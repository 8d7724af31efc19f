package bus

import (
	"fmt"
	"os/user"
	"slices"
	"strconv"

	"github.com/nixcage/nixcage/internal/config"
)

// Action is what a call needs the caller to be allowed.
type Action int

const (
	// ActRead: appliance and agent status. Anyone on the host.
	ActRead Action = iota
	// ActView: an agent's audit records. viewer or above, agent in scope.
	ActView
	// ActOperate: start, stop, restart, kill, quarantine, release. operator
	// or above, agent in scope.
	ActOperate
	// ActAdmin: apply, rollback, reload. admin over every agent.
	ActAdmin
	// ActRun: start a throw-away cage (cagectl run). operator or above
	// over every agent: a run is a new cage, which no per-agent scope names.
	ActRun
	// ActShell: a shell inside a running cage (cagectl shell). admin,
	// agent in scope: it acts as the agent, past the audit of its egress.
	ActShell
)

func (a Action) role() string {
	switch a {
	case ActView:
		return config.RoleViewer
	case ActOperate, ActRun:
		return config.RoleOperator
	case ActAdmin, ActShell:
		return config.RoleAdmin
	}
	return ""
}

func rank(role string) int {
	switch role {
	case config.RoleViewer:
		return 1
	case config.RoleOperator:
		return 2
	case config.RoleAdmin:
		return 3
	}
	return 0
}

// Identity is a caller as the server sees it: the uid comes from the bus
// (SO_PEERCRED of the caller's connection), names from the user database.
type Identity struct {
	UID    uint32
	User   string   // "" if the uid has no passwd entry
	Groups []string // group names and numeric gids, primary group included
}

func (id Identity) String() string {
	if id.User == "" {
		return fmt.Sprintf("uid %d", id.UID)
	}
	return fmt.Sprintf("%s (uid %d)", id.User, id.UID)
}

// UserDB resolves uids to identities.
type UserDB interface {
	Lookup(uid uint32) Identity
}

// SystemUsers reads the host's user database (os/user).
type SystemUsers struct{}

// Lookup never fails: an unknown uid is an identity with no name and no
// groups, which matches only accounts declared by numeric uid.
func (SystemUsers) Lookup(uid uint32) Identity {
	id := Identity{UID: uid}
	u, err := user.LookupId(strconv.FormatUint(uint64(uid), 10))
	if err != nil {
		return id
	}
	id.User = u.Username
	gids, _ := u.GroupIds()
	if !slices.Contains(gids, u.Gid) {
		gids = append(gids, u.Gid)
	}
	for _, g := range gids {
		id.Groups = append(id.Groups, g)
		if gr, err := user.LookupGroupId(g); err == nil {
			id.Groups = append(id.Groups, gr.Name)
		}
	}
	return id
}

func (id Identity) matches(a *config.Account) bool {
	if a.User != "" {
		return a.User == id.User || a.User == strconv.FormatUint(uint64(id.UID), 10)
	}
	return a.Group != "" && slices.Contains(id.Groups, a.Group)
}

// Authorize decides whether id may perform act on agent ("" for actions on
// the appliance). root may do everything; everyone may read status. The
// error explains what role the caller lacks and how to grant it.
func Authorize(accounts []*config.Account, id Identity, act Action, agent string) error {
	if act == ActRead || id.UID == 0 {
		return nil
	}
	need := rank(act.role())
	for _, a := range accounts {
		if !id.matches(a) || rank(a.Role) < need {
			continue
		}
		if agent == "" {
			// Appliance-wide actions need an account that covers every agent.
			if len(a.Agents) == 0 {
				return nil
			}
			continue
		}
		if a.Covers(agent) {
			return nil
		}
	}
	what := map[Action]string{
		ActView:    "read the audit of agent " + agent,
		ActOperate: "control agent " + agent,
		ActAdmin:   "apply, roll back or reload (admin actions)",
		ActRun:     "start a throw-away cage (cagectl run)",
		ActShell:   "open a shell in agent " + agent + " (cagectl shell)",
	}[act]
	scope := "covering agent " + agent
	if agent == "" {
		scope = "covering all agents"
	}
	return fmt.Errorf("access denied: %s may not %s; it needs role %q or higher %s (declare an account for this user or one of its groups in the nixcage config)",
		id, what, act.role(), scope)
}
