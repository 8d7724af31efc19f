// Package fakesd is a fake systemd manager for tests: it owns
// org.freedesktop.systemd1 on a bus the test controls and implements the
// handful of org.freedesktop.systemd1.Manager methods nixcage calls, so the
// real go-systemd client and nixcage's reconcile code run unchanged against
// it. It records every call in order, reads unit files from the directories
// it is given (Requires= pulls dependencies, ConditionPathExists= is
// honoured), emits JobRemoved and PropertiesChanged like systemd does, and
// keeps unit state in memory.
package fakesd

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	sdbus "github.com/coreos/go-systemd/v22/dbus"
	"github.com/godbus/dbus/v5"
)

const (
	busName  = "org.freedesktop.systemd1"
	objPath  = dbus.ObjectPath("/org/freedesktop/systemd1")
	mgrIface = "org.freedesktop.systemd1.Manager"
)

// Systemd is the fake manager.
type Systemd struct {
	conn *dbus.Conn
	// Dirs are searched in order for unit files (like /etc/systemd/system
	// before /run/systemd/system).
	Dirs []string
	// Root is prepended to paths in ConditionPathExists=.
	Root string
	// NoFreeze makes FreezeUnit fail as on cgroup v1 hosts.
	NoFreeze bool

	mu     sync.Mutex
	calls  []string
	units  map[string]*unitState
	loaded map[string][]byte // unit file bytes as of the last Reload
	jobID  uint32
	// transient units by name (StartTransientUnit)
	transient map[string]*Transient
	// startDelay holds StartTransientUnit's answers back (DelayStartReply).
	startDelay time.Duration
}

// DelayStartReply holds every StartTransientUnit answer back by d after the
// unit has started, as a loaded systemd's can be: a caller that gives up
// meanwhile has started a unit without knowing it.
func (s *Systemd) DelayStartReply(d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.startDelay = d
}

type unitState struct{ active, sub string }

// UnitStatus mirrors the ListUnitsByNames struct (ssssssouso).
type UnitStatus struct {
	Name, Description, LoadState, ActiveState, SubState, Followed string
	Path                                                          dbus.ObjectPath
	JobID                                                         uint32
	JobType                                                       string
	JobPath                                                       dbus.ObjectPath
}

// Export serves a fake systemd on conn and claims its bus name.
func Export(conn *dbus.Conn, dirs []string, root string) (*Systemd, error) {
	s := &Systemd{conn: conn, Dirs: dirs, Root: root, units: map[string]*unitState{}, loaded: map[string][]byte{}}
	s.reload()
	if err := conn.Export(manager{s}, objPath, mgrIface); err != nil {
		return nil, err
	}
	r, err := conn.RequestName(busName, dbus.NameFlagDoNotQueue)
	if err != nil {
		return nil, fmt.Errorf("fakesd: request name: %w", err)
	}
	if r != dbus.RequestNameReplyPrimaryOwner {
		return nil, fmt.Errorf("fakesd: %s already owned", busName)
	}
	return s, nil
}

// Calls returns the recorded calls, e.g. "StartUnit nixcage-agent@a.service".
func (s *Systemd) Calls() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.calls...)
}

// Reset forgets the recorded calls.
func (s *Systemd) Reset() {
	s.mu.Lock()
	s.calls = nil
	s.mu.Unlock()
}

// State returns a unit's active and sub state.
func (s *Systemd) State(name string) (active, sub string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.state(name)
	return st.active, st.sub
}

// SetState forces a unit's state (a crash, an exit) and signals the change.
func (s *Systemd) SetState(name, active, sub string) {
	s.mu.Lock()
	s.set(name, active, sub)
	s.mu.Unlock()
}

func (s *Systemd) state(name string) *unitState {
	st, ok := s.units[name]
	if !ok {
		st = &unitState{active: "inactive", sub: "dead"}
		s.units[name] = st
	}
	return st
}

func (s *Systemd) set(name, active, sub string) {
	st := s.state(name)
	if st.active == active && st.sub == sub {
		return
	}
	st.active, st.sub = active, sub
	_ = s.conn.Emit(unitPath(name), "org.freedesktop.DBus.Properties.PropertiesChanged",
		"org.freedesktop.systemd1.Unit",
		map[string]dbus.Variant{"ActiveState": dbus.MakeVariant(active), "SubState": dbus.MakeVariant(sub)},
		[]string{})
}

func (s *Systemd) record(format string, args ...any) {
	s.calls = append(s.calls, fmt.Sprintf(format, args...))
}

// reload snapshots every unit file, as daemon-reload does.
func (s *Systemd) reload() {
	s.loaded = map[string][]byte{}
	for i := len(s.Dirs) - 1; i >= 0; i-- {
		ents, _ := os.ReadDir(s.Dirs[i])
		for _, e := range ents {
			if e.IsDir() {
				continue
			}
			if b, err := os.ReadFile(filepath.Join(s.Dirs[i], e.Name())); err == nil {
				s.loaded[e.Name()] = b
			}
		}
	}
}

// file returns the loaded unit file for name, falling back to its template
// with %i substituted.
func (s *Systemd) file(name string) ([]byte, bool) {
	if b, ok := s.loaded[name]; ok {
		return b, true
	}
	if at := strings.IndexByte(name, '@'); at >= 0 {
		dot := strings.LastIndexByte(name, '.')
		if dot > at {
			tpl := name[:at+1] + name[dot:]
			if b, ok := s.loaded[tpl]; ok {
				return bytes.ReplaceAll(b, []byte("%i"), []byte(name[at+1:dot])), true
			}
		}
	}
	return nil, false
}

func directives(b []byte, key string) []string {
	var out []string
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if v, ok := strings.CutPrefix(strings.TrimSpace(sc.Text()), key+"="); ok {
			out = append(out, strings.Fields(v)...)
		}
	}
	return out
}

func (s *Systemd) noSuchUnit(name string) *dbus.Error {
	return &dbus.Error{Name: "org.freedesktop.systemd1.NoSuchUnit", Body: []any{fmt.Sprintf("Unit %s not found.", name)}}
}

// start activates name and what it Requires=, unless a condition fails.
func (s *Systemd) start(name string, seen map[string]bool) *dbus.Error {
	if seen[name] {
		return nil
	}
	seen[name] = true
	b, ok := s.file(name)
	if !ok {
		return s.noSuchUnit(name)
	}
	for _, c := range directives(b, "ConditionPathExists") {
		neg := strings.HasPrefix(c, "!")
		p := filepath.Join(s.Root, strings.TrimPrefix(c, "!"))
		_, err := os.Stat(p)
		if exists := err == nil; exists == neg {
			// Condition failed: the job succeeds, the unit stays down.
			return nil
		}
	}
	for _, dep := range directives(b, "Requires") {
		if err := s.start(dep, seen); err != nil {
			return err
		}
	}
	s.set(name, "active", "running")
	return nil
}

// stop deactivates name and every active unit that Requires= it.
func (s *Systemd) stop(name string) {
	s.set(name, "inactive", "dead")
	if t := s.transient[name]; t != nil {
		t.closeStdio()
	}
	for other, st := range s.units {
		if st.active != "active" {
			continue
		}
		b, ok := s.file(other)
		if !ok {
			continue
		}
		for _, dep := range directives(b, "Requires") {
			if dep == name {
				s.stop(other)
			}
		}
	}
}

func (s *Systemd) job(name, result string) dbus.ObjectPath {
	s.jobID++
	id := s.jobID
	p := dbus.ObjectPath(fmt.Sprintf("/org/freedesktop/systemd1/job/%d", id))
	// After the reply: go-systemd holds its job lock across the call, so the
	// signal is matched to the job whichever arrives first.
	go func() {
		_ = s.conn.Emit(objPath, mgrIface+".JobRemoved", id, p, name, result)
	}()
	return p
}

func unitPath(name string) dbus.ObjectPath {
	return dbus.ObjectPath("/org/freedesktop/systemd1/unit/" + sdbus.PathBusEscape(name))
}

// manager carries only the exported D-Bus methods.
type manager struct{ s *Systemd }

func (m manager) StartUnit(name, mode string) (dbus.ObjectPath, *dbus.Error) {
	s := m.s
	s.mu.Lock()
	defer s.mu.Unlock()
	s.record("StartUnit %s", name)
	if err := s.start(name, map[string]bool{}); err != nil {
		return "", err
	}
	return s.job(name, "done"), nil
}

func (m manager) StopUnit(name, mode string) (dbus.ObjectPath, *dbus.Error) {
	s := m.s
	s.mu.Lock()
	defer s.mu.Unlock()
	s.record("StopUnit %s", name)
	if _, ok := s.file(name); !ok {
		if _, known := s.units[name]; !known {
			return "", s.noSuchUnit(name)
		}
	}
	s.stop(name)
	return s.job(name, "done"), nil
}

func (m manager) RestartUnit(name, mode string) (dbus.ObjectPath, *dbus.Error) {
	s := m.s
	s.mu.Lock()
	defer s.mu.Unlock()
	s.record("RestartUnit %s", name)
	if _, ok := s.file(name); !ok {
		return "", s.noSuchUnit(name)
	}
	// Like systemd, a restart propagates to active units that Require= it.
	var dependents []string
	for other, st := range s.units {
		if other == name || st.active != "active" {
			continue
		}
		if b, ok := s.file(other); ok {
			for _, dep := range directives(b, "Requires") {
				if dep == name {
					dependents = append(dependents, other)
				}
			}
		}
	}
	s.stop(name)
	if err := s.start(name, map[string]bool{}); err != nil {
		return "", err
	}
	for _, d := range dependents {
		_ = s.start(d, map[string]bool{})
	}
	return s.job(name, "done"), nil
}

func (m manager) Reload() *dbus.Error {
	s := m.s
	s.mu.Lock()
	defer s.mu.Unlock()
	s.record("Reload")
	s.reload()
	return nil
}

func (m manager) KillUnit(name, who string, signal int32) *dbus.Error {
	s := m.s
	s.mu.Lock()
	defer s.mu.Unlock()
	s.record("KillUnit %s %s %d", name, who, signal)
	if st := s.state(name); st.active != "active" {
		return &dbus.Error{Name: "org.freedesktop.DBus.Error.UnixProcessIdUnknown", Body: []any{"No main process to kill"}}
	}
	if signal == 9 {
		s.set(name, "failed", "failed")
	}
	return nil
}

func (m manager) ListUnitsByNames(names []string) ([]UnitStatus, *dbus.Error) {
	s := m.s
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]UnitStatus, 0, len(names))
	for _, n := range names {
		load := "loaded"
		if _, ok := s.file(n); !ok && s.transient[n] == nil {
			load = "not-found"
		}
		st := s.state(n)
		out = append(out, UnitStatus{Name: n, LoadState: load, ActiveState: st.active, SubState: st.sub, Path: unitPath(n), JobPath: "/"})
	}
	return out, nil
}

func (m manager) FreezeUnit(name string) *dbus.Error {
	s := m.s
	s.mu.Lock()
	defer s.mu.Unlock()
	s.record("FreezeUnit %s", name)
	if s.NoFreeze {
		return &dbus.Error{Name: "org.freedesktop.DBus.Error.NotSupported", Body: []any{"Unit does not support freeze"}}
	}
	st := s.state(name)
	if st.active != "active" {
		return unitInactive()
	}
	s.set(name, "active", "frozen")
	return nil
}

// unitInactive is systemd's refusal to freeze or thaw a unit that is not
// running (bus_unit_method_freezer_generic, -EHOSTDOWN).
func unitInactive() *dbus.Error {
	return &dbus.Error{Name: "org.freedesktop.systemd1.UnitInactive", Body: []any{"Unit is inactive."}}
}

func (m manager) ThawUnit(name string) *dbus.Error {
	s := m.s
	s.mu.Lock()
	defer s.mu.Unlock()
	s.record("ThawUnit %s", name)
	st := s.state(name)
	if st.active != "active" {
		return unitInactive()
	}
	if st.sub == "frozen" {
		s.set(name, "active", "running")
	}
	return nil
}

func (m manager) ResetFailedUnit(name string) *dbus.Error {
	s := m.s
	s.mu.Lock()
	defer s.mu.Unlock()
	s.record("ResetFailedUnit %s", name)
	if st := s.state(name); st.active == "failed" {
		s.set(name, "inactive", "dead")
	}
	return nil
}

func (m manager) Subscribe() *dbus.Error { return nil }

func (m manager) GetUnit(name string) (dbus.ObjectPath, *dbus.Error) {
	return unitPath(name), nil
}

// Transient is a unit started with StartTransientUnit: its properties and
// the stdio descriptors it was given (nil where none), which the test plays
// the unit's process with.
type Transient struct {
	Name  string
	Props map[string]any
	Stdio [3]*os.File

	code, status int32
	result       string
}

type transientProp struct {
	Name  string
	Value dbus.Variant
}

type transientAux struct {
	Name  string
	Props []transientProp
}

// StartTransientUnit starts a unit with no file of its own (drop-ins, as
// systemd would read them, are not interpreted): it records the call and
// keeps the stdio descriptors for the test.
func (m manager) StartTransientUnit(name, mode string, props []transientProp, aux []transientAux) (dbus.ObjectPath, *dbus.Error) {
	job, err := m.startTransient(name, props)
	m.s.mu.Lock()
	delay := m.s.startDelay
	m.s.mu.Unlock()
	time.Sleep(delay)
	return job, err
}

func (m manager) startTransient(name string, props []transientProp) (dbus.ObjectPath, *dbus.Error) {
	s := m.s
	s.mu.Lock()
	defer s.mu.Unlock()
	s.record("StartTransientUnit %s", name)
	if st := s.state(name); st.active == "active" || st.active == "failed" {
		return "", &dbus.Error{Name: "org.freedesktop.systemd1.UnitExists", Body: []any{fmt.Sprintf("Unit %s was already loaded or has a fragment file.", name)}}
	}
	tr := &Transient{Name: name, Props: map[string]any{}}
	for _, p := range props {
		v := p.Value.Value()
		tr.Props[p.Name] = v
		if fd, ok := v.(dbus.UnixFD); ok {
			f := os.NewFile(uintptr(fd), name+" "+p.Name)
			switch p.Name {
			case "StandardInputFileDescriptor":
				tr.Stdio[0] = f
			case "StandardOutputFileDescriptor":
				tr.Stdio[1] = f
			case "StandardErrorFileDescriptor":
				tr.Stdio[2] = f
			default:
				f.Close()
			}
		}
	}
	if s.transient == nil {
		s.transient = map[string]*Transient{}
	}
	if old := s.transient[name]; old != nil {
		old.closeStdio()
	}
	s.transient[name] = tr
	_ = s.conn.Export(unitProps{s, name}, unitPath(name), "org.freedesktop.DBus.Properties")
	s.set(name, "active", "running")
	return s.job(name, "done"), nil
}

func (t *Transient) closeStdio() {
	for i, f := range t.Stdio {
		if f != nil {
			f.Close()
			t.Stdio[i] = nil
		}
	}
}

// Transient returns the last transient unit started under name, or nil.
func (s *Systemd) Transient(name string) *Transient {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.transient[name]
}

// Finish plays a transient unit's process ending: it writes stdout, closes
// its stdio and exits with status (the unit stays loaded, as with
// RemainAfterExit=yes: active/exited on 0, failed otherwise).
func (s *Systemd) Finish(name, stdout string, status int32) {
	s.mu.Lock()
	defer s.mu.Unlock()
	t := s.transient[name]
	if t == nil {
		return
	}
	if t.Stdio[1] != nil && stdout != "" {
		t.Stdio[1].WriteString(stdout)
	}
	t.closeStdio()
	t.code, t.status, t.result = 1, status, "success"
	if status != 0 {
		t.result = "exit-code"
		s.set(name, "failed", "failed")
		return
	}
	s.set(name, "active", "exited")
}

// unitProps serves org.freedesktop.DBus.Properties of a transient unit:
// the Service properties caged reads for an exit status.
type unitProps struct {
	s    *Systemd
	name string
}

func (u unitProps) GetAll(iface string) (map[string]dbus.Variant, *dbus.Error) {
	u.s.mu.Lock()
	defer u.s.mu.Unlock()
	out := map[string]dbus.Variant{}
	t := u.s.transient[u.name]
	if t == nil || iface != "org.freedesktop.systemd1.Service" {
		return out, nil
	}
	out["ExecMainCode"] = dbus.MakeVariant(t.code)
	out["ExecMainStatus"] = dbus.MakeVariant(t.status)
	out["Result"] = dbus.MakeVariant(t.result)
	return out, nil
}

func (u unitProps) Get(iface, prop string) (dbus.Variant, *dbus.Error) {
	all, err := u.GetAll(iface)
	if err != nil {
		return dbus.Variant{}, err
	}
	if v, ok := all[prop]; ok {
		return v, nil
	}
	return dbus.Variant{}, &dbus.Error{Name: "org.freedesktop.DBus.Error.UnknownProperty", Body: []any{prop}}
}
