// Package reconcile turns nixcage's desired state (a validated config) into
// systemd units and running cages: it renders the units, installs exactly the
// bytes that changed, asks systemd to reload, and starts, stops or restarts
// exactly the units those bytes belong to. It talks to systemd only through
// the Systemd interface, which go-systemd's *dbus.Conn satisfies; tests run it
// against a fake systemd exported on a private bus (package fakesd).
package reconcile

import (
	"context"
	"errors"
	"fmt"

	sdbus "github.com/coreos/go-systemd/v22/dbus"
	"github.com/godbus/dbus/v5"
)

// Systemd is the part of org.freedesktop.systemd1.Manager nixcage uses.
// *sdbus.Conn implements it.
type Systemd interface {
	ReloadContext(ctx context.Context) error
	StartUnitContext(ctx context.Context, name, mode string, ch chan<- string) (int, error)
	StopUnitContext(ctx context.Context, name, mode string, ch chan<- string) (int, error)
	RestartUnitContext(ctx context.Context, name, mode string, ch chan<- string) (int, error)
	KillUnitWithTarget(ctx context.Context, name string, target sdbus.Who, signal int32) error
	ListUnitsByNamesContext(ctx context.Context, names []string) ([]sdbus.UnitStatus, error)
	ListUnitsByPatternsContext(ctx context.Context, states, patterns []string) ([]sdbus.UnitStatus, error)
	FreezeUnit(ctx context.Context, unit string) error
	ThawUnit(ctx context.Context, unit string) error
	ResetFailedUnitContext(ctx context.Context, name string) error
}

var _ Systemd = (*sdbus.Conn)(nil)

// Units wraps a Systemd with job handling: every job call waits for the
// job's result, so callers see "failed" or "dependency" as an error instead
// of a job id.
type Units struct {
	SD Systemd
}

// JobError is a systemd job that finished with a result other than "done".
type JobError struct {
	Op, Unit, Result string
}

func (e *JobError) Error() string {
	return fmt.Sprintf("%s %s: job %s", e.Op, e.Unit, e.Result)
}

type jobFunc func(ctx context.Context, name, mode string, ch chan<- string) (int, error)

func (u Units) job(ctx context.Context, op string, f jobFunc, name string) error {
	// Buffered: go-systemd delivers the result from its signal loop and must
	// never block on a caller that gave up waiting.
	ch := make(chan string, 1)
	if _, err := f(ctx, name, "replace", ch); err != nil {
		return fmt.Errorf("%s %s: %w", op, name, err)
	}
	select {
	case res := <-ch:
		if res != "done" {
			return &JobError{Op: op, Unit: name, Result: res}
		}
		return nil
	case <-ctx.Done():
		return fmt.Errorf("%s %s: waiting for job: %w", op, name, ctx.Err())
	}
}

// Start starts name and waits for the job.
func (u Units) Start(ctx context.Context, name string) error {
	return u.job(ctx, "start", u.SD.StartUnitContext, name)
}

// Stop stops name and waits for the job.
func (u Units) Stop(ctx context.Context, name string) error {
	return u.job(ctx, "stop", u.SD.StopUnitContext, name)
}

// Restart restarts name and waits for the job.
func (u Units) Restart(ctx context.Context, name string) error {
	return u.job(ctx, "restart", u.SD.RestartUnitContext, name)
}

// Kill sends signal to every process in the unit's cgroup.
func (u Units) Kill(ctx context.Context, name string, signal int32) error {
	if err := u.SD.KillUnitWithTarget(ctx, name, sdbus.All, signal); err != nil {
		return fmt.Errorf("kill %s: %w", name, err)
	}
	return nil
}

// Freeze freezes the unit's cgroup (cgroup v2 only).
func (u Units) Freeze(ctx context.Context, name string) error {
	if err := u.SD.FreezeUnit(ctx, name); err != nil {
		return fmt.Errorf("freeze %s: %w", name, err)
	}
	return nil
}

// Thaw thaws a frozen unit's cgroup.
func (u Units) Thaw(ctx context.Context, name string) error {
	if err := u.SD.ThawUnit(ctx, name); err != nil {
		return fmt.Errorf("thaw %s: %w", name, err)
	}
	return nil
}

// State is the part of a unit's status nixcage reports.
type State struct {
	Load, Active, Sub string
}

// Running reports whether the unit is running or on its way there.
func (s State) Running() bool {
	return s.Active == "active" || s.Active == "activating" || s.Active == "reloading"
}

// States returns the state of each named unit, in one call.
func (u Units) States(ctx context.Context, names []string) (map[string]State, error) {
	out := make(map[string]State, len(names))
	if len(names) == 0 {
		return out, nil
	}
	sts, err := u.SD.ListUnitsByNamesContext(ctx, names)
	if err != nil {
		return nil, fmt.Errorf("list units: %w", err)
	}
	for _, s := range sts {
		out[s.Name] = State{Load: s.LoadState, Active: s.ActiveState, Sub: s.SubState}
	}
	return out, nil
}

// IsNoSuchUnit reports whether err says a unit does not exist (stopping a
// unit systemd never loaded is not a failure when removing it).
func IsNoSuchUnit(err error) bool {
	var de dbus.Error
	if errors.As(err, &de) {
		return de.Name == "org.freedesktop.systemd1.NoSuchUnit"
	}
	var dp *dbus.Error
	if errors.As(err, &dp) {
		return dp.Name == "org.freedesktop.systemd1.NoSuchUnit"
	}
	return false
}
