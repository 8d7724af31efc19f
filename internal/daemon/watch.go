package daemon

import (
	"context"
	"time"

	"github.com/nixcage/nixcage/internal/events"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/policy"
)

// cageWatch is how often caged looks at what the cages' prepare steps and
// gateways leave in their runtime directories (learn windows, pending
// approvals): a stat and a small read per cage, no inotify (a gateway's directories are its own
// dynamic user's, made and removed by systemd).
const cageWatch = 500 * time.Millisecond

// learnSeen is what caged last announced of a cage's learn window.
type learnSeen struct {
	started int64
	ended   bool
}

// watchCages announces learn windows opening and ending (journal events
// learn-started, learn-ended: the gateway's audit carries the same) and
// requests waiting for approval (approvals.go), until ctx ends.
func (d *Daemon) watchCages(ctx context.Context) {
	seen := map[string]*learnSeen{}
	pending := map[string]map[string]bool{}
	t := time.NewTicker(cageWatch)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		now := time.Now()
		d.watchLearn(seen, now)
		d.watchApprovals(pending, now)
	}
}

// cageNames are the declared agents and the running throw-away cages.
func (d *Daemon) cageNames() []string {
	var names []string
	for _, a := range d.config().Agents {
		names = append(names, a.Name)
	}
	d.mu.RLock()
	for n := range d.runs {
		names = append(names, n)
	}
	d.mu.RUnlock()
	return names
}

func (d *Daemon) watchLearn(seen map[string]*learnSeen, now time.Time) {
	for _, name := range d.cageNames() {
		w, err := policy.LoadLearnWindow(d.qdirs.Host(paths.LearnFile(name)), name)
		if err != nil {
			delete(seen, name)
			continue
		}
		s := seen[name]
		until := w.Until().UTC().Format(time.RFC3339)
		if s == nil || s.started != w.StartedUnix {
			s = &learnSeen{started: w.StartedUnix}
			seen[name] = s
			if w.Active(now) {
				d.log.Warn("LEARN MODE", "agent", name, "until", until)
				d.journal(events.LearnStarted, events.LearnStarted.FieldsOf(name, until))
			} else {
				s.ended = true // over before caged saw it: nothing to announce
			}
		}
		if !s.ended && !w.Active(now) {
			s.ended = true
			d.log.Warn("learn mode ended", "agent", name, "until", until)
			d.journal(events.LearnEnded, events.LearnEnded.FieldsOf(name, until))
		}
	}
}
