package bus

import (
	"context"
	"fmt"
	"os"
	"strings"

	"github.com/godbus/dbus/v5"
)

// ConfigSource is one configuration file as cagectl read it: caged gets the
// bytes, never a path, so its own sandbox (ProtectHome=, PrivateTmp=) does
// not decide which files an admin may install. Wire type (say).
type ConfigSource struct {
	Name string // for diagnostics; ".json" selects HCL's JSON syntax
	Data []byte
}

// ConfigPlan is what ApplyConfig did (or, for a dry run, would do). Wire
// order: (asasasasasasasasb).
type ConfigPlan struct {
	Added   []string `json:"agents_added"`
	Changed []string `json:"agents_changed"`
	Removed []string `json:"agents_removed"`
	Write   []string `json:"files_written"`
	Remove  []string `json:"files_removed"`
	Stop    []string `json:"units_stopped"`
	Restart []string `json:"units_restarted"`
	Start   []string `json:"units_started"`
	Applied bool     `json:"applied"` // false for a dry run
}

// ConfigBackend is the part of Backend that changes the declared
// configuration and the secrets behind it.
type ConfigBackend interface {
	// ApplyConfig validates sources as the new configuration and installs it
	// (unless dryRun): units written and pruned, systemd reloaded, exactly
	// the changed units restarted.
	ApplyConfig(ctx context.Context, sources []ConfigSource, dryRun bool, by string) (*ConfigPlan, error)
	// RotateSecret makes the agent's gateway re-read secret name (all when
	// ""), with a new placeholder if asked or needed. It says what it did.
	RotateSecret(ctx context.Context, agent, name string, newPlaceholder bool, by string) (string, error)
}

// LogsBackend serves an agent's journal to viewers who cannot read the
// journal themselves.
type LogsBackend interface {
	// ReadLogs returns journal lines of the agent's units: the newest lines
	// when cursor is "", else those after cursor; and the cursor to follow
	// from.
	ReadLogs(ctx context.Context, agent string, lines uint32, cursor string) ([]string, string, error)
}

func init() {
	argNames["ReadLogs"] = []string{"name", "lines", "cursor", "entries", "next_cursor"}
	argNames["ApplyConfig"] = []string{"files", "dry_run", "plan"}
	argNames["RotateSecret"] = []string{"name", "secret", "new_placeholder", "result"}
	argNames["ApplyDir"] = []string{"dir", "result"}
}

// ApplyDir applies the release in a directory the caller opened and passes
// as a descriptor: caged reads it through that descriptor, so a release
// under /root, /home or /tmp (which caged's ProtectHome= and PrivateTmp=
// hide from it) works, and nothing the caller could not read is read.
func (m *manager) ApplyDir(sender dbus.Sender, dir dbus.UnixFD) (ApplyResult, *dbus.Error) {
	f := os.NewFile(uintptr(dir), "release")
	defer f.Close()
	id, derr := m.s.authorize(sender, ActAdmin, "ApplyDir")
	if derr != nil {
		return ApplyResult{}, derr
	}
	if st, err := f.Stat(); err != nil || !st.IsDir() {
		return ApplyResult{}, newError(ErrorInvalid, "ApplyDir needs a descriptor of a release directory")
	}
	// The magic link reaches the directory whatever caged's mount
	// namespace shows at its path.
	res, err := m.s.be.Apply(m.s.progressTo(context.Background(), sender), fmt.Sprintf("/proc/self/fd/%d", f.Fd()), id.String())
	if err != nil {
		return ApplyResult{}, fail(err)
	}
	return *res, nil
}

// ApplyDir applies the release in the open directory dir.
func (c *Client) ApplyDir(ctx context.Context, dir *os.File) (*ApplyResult, error) {
	var r ApplyResult
	if err := c.call(ctx, "ApplyDir", []any{&r}, dbus.UnixFD(dir.Fd())); err != nil {
		return nil, err
	}
	return &r, nil
}

func (m *manager) ApplyConfig(sender dbus.Sender, files []ConfigSource, dryRun bool) (ConfigPlan, *dbus.Error) {
	id, derr := m.s.authorize(sender, ActAdmin, "ApplyConfig")
	if derr != nil {
		return ConfigPlan{}, derr
	}
	if len(files) == 0 {
		return ConfigPlan{}, newError(ErrorInvalid, "apply-config needs at least one configuration file")
	}
	p, err := m.s.be.ApplyConfig(context.Background(), files, dryRun, id.String())
	if err != nil {
		return ConfigPlan{}, fail(err)
	}
	return nonNilPlan(*p), nil
}

func (m *manager) RotateSecret(sender dbus.Sender, agent, secret string, newPlaceholder bool) (string, *dbus.Error) {
	id, derr := m.s.authorizeAgent(sender, ActOperate, agent, "RotateSecret")
	if derr != nil {
		return "", derr
	}
	if strings.ContainsAny(secret, "/\x00") {
		return "", newError(ErrorInvalid, "%q is not a secret name", secret)
	}
	msg, err := m.s.be.RotateSecret(context.Background(), agent, secret, newPlaceholder, id.String())
	return msg, fail(err)
}

// nonNilPlan: D-Bus has no null; empty arrays marshal the same either way,
// but JSON output stays [] rather than null.
func nonNilPlan(p ConfigPlan) ConfigPlan {
	for _, s := range []*[]string{&p.Added, &p.Changed, &p.Removed, &p.Write, &p.Remove, &p.Stop, &p.Restart, &p.Start} {
		if *s == nil {
			*s = []string{}
		}
	}
	return p
}

// ApplyConfig sends configuration files to caged to validate, plan and
// (unless dryRun) install.
func (c *Client) ApplyConfig(ctx context.Context, files []ConfigSource, dryRun bool) (*ConfigPlan, error) {
	var p ConfigPlan
	if err := c.call(ctx, "ApplyConfig", []any{&p}, files, dryRun); err != nil {
		return nil, err
	}
	p = nonNilPlan(p)
	return &p, nil
}

// RotateSecret has an agent's gateway re-read a secret's source.
func (c *Client) RotateSecret(ctx context.Context, agent, secret string, newPlaceholder bool) (string, error) {
	var msg string
	err := c.call(ctx, "RotateSecret", []any{&msg}, agent, secret, newPlaceholder)
	return msg, err
}

func (m *manager) ReadLogs(sender dbus.Sender, agent string, lines uint32, cursor string) ([]string, string, *dbus.Error) {
	if _, derr := m.s.authorizeAgent(sender, ActView, agent, "ReadLogs"); derr != nil {
		return nil, "", derr
	}
	if lines == 0 || lines > 10000 {
		lines = 10000
	}
	out, next, err := m.s.be.ReadLogs(context.Background(), agent, lines, cursor)
	if out == nil {
		out = []string{}
	}
	return out, next, fail(err)
}

// ReadLogs reads an agent's journal through caged (viewer role).
func (c *Client) ReadLogs(ctx context.Context, agent string, lines uint32, cursor string) ([]string, string, error) {
	var out []string
	var next string
	err := c.call(ctx, "ReadLogs", []any{&out, &next}, agent, lines, cursor)
	return out, next, err
}
