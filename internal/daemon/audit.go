package daemon

import (
	"context"
	"encoding/json"
	"os"
	"sync"
	"time"

	"github.com/nixcage/nixcage/internal/auditlog"
	"github.com/nixcage/nixcage/internal/bus"
)

// auditTail follows every agent's gateway audit log: it counts decisions
// since caged started and signals the ones worth attention (flagged,
// blocked). It only reads; the gateway owns the files.
type auditTail struct {
	d        *Daemon
	interval time.Duration

	mu    sync.Mutex
	files map[string]*tailState
}

type tailState struct {
	offset                    int64
	allowed, flagged, blocked uint64
	bytesOut, bytesIn         uint64
}

// maxSignalsPerPoll bounds the signals one agent can cause per poll, so a
// cage hammering blocked hosts cannot flood the bus; counters stay exact.
const maxSignalsPerPoll = 20

func newAuditTail(d *Daemon, interval time.Duration) *auditTail {
	t := &auditTail{d: d, interval: interval, files: map[string]*tailState{}}
	// Counters start now: existing records are history, not events.
	for _, a := range d.config().Agents {
		st := &tailState{}
		if fi, err := os.Stat(d.qdirs.AuditFile(a.Name)); err == nil {
			st.offset = fi.Size()
		}
		t.files[a.Name] = st
	}
	return t
}

// startAt counts agent's decisions afresh from offset on: a throw-away
// cage's name may have had earlier runs, whose records are not its own.
func (t *auditTail) startAt(agent string, offset int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.files[agent] = &tailState{offset: offset}
}

func (t *auditTail) counts(agent string) (allowed, flagged, blocked uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if st := t.files[agent]; st != nil {
		return st.allowed, st.flagged, st.blocked
	}
	return 0, 0, 0
}

// traffic is the bytes agent's gateway moved since caged started (from
// the request and tunnel-close records).
func (t *auditTail) traffic(agent string) (out, in uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if st := t.files[agent]; st != nil {
		return st.bytesOut, st.bytesIn
	}
	return 0, 0
}

func (t *auditTail) run(ctx context.Context) {
	tk := time.NewTicker(t.interval)
	defer tk.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tk.C:
			t.poll()
		}
	}
}

func (t *auditTail) poll() {
	var names []string
	for _, a := range t.d.config().Agents {
		names = append(names, a.Name)
	}
	for _, r := range t.d.runStatuses() {
		names = append(names, r.Name)
	}
	for _, name := range names {
		a := struct{ Name string }{name}
		t.mu.Lock()
		st := t.files[a.Name]
		if st == nil {
			st = &tailState{}
			t.files[a.Name] = st
		}
		offset := st.offset
		t.mu.Unlock()
		// A stat per agent and poll; the file is opened only when it grew
		// (or shrank: rotated).
		// Lstat: a link planted by the gateway is not followed, not even for
		// its size (auditlog.Open refuses it when read).
		fi, err := os.Lstat(t.d.qdirs.AuditFile(a.Name))
		if err != nil || fi.Size() == offset {
			continue
		}
		lines, next, err := auditlog.Read(t.d.qdirs.AuditFile(a.Name), offset, 10000)
		if err != nil || next == offset {
			continue
		}
		var allowed, flagged, blocked, bytesOut, bytesIn uint64
		type notice struct {
			rec  auditlog.Record
			line string
		}
		var notable []notice
		for _, l := range lines {
			var r auditlog.Record
			if json.Unmarshal([]byte(l), &r) != nil {
				continue
			}
			// Bytes count on every record: a tunnel's are on its close.
			if r.BytesOut > 0 {
				bytesOut += uint64(r.BytesOut)
			}
			if r.BytesIn > 0 {
				bytesIn += uint64(r.BytesIn)
			}
			n := r.Decisions()
			if n == 0 {
				continue // a tunnel's close record; its open record counted
			}
			switch r.Decision {
			case auditlog.Allowed:
				allowed += n
			case auditlog.Flagged:
				flagged += n
			case auditlog.Blocked:
				blocked += n
			default:
				continue
			}
			if r.Decision != auditlog.Allowed && len(notable) < maxSignalsPerPoll {
				notable = append(notable, notice{r, l})
			}
		}
		t.mu.Lock()
		st.offset = next
		st.allowed += allowed
		st.flagged += flagged
		st.blocked += blocked
		st.bytesOut += bytesOut
		st.bytesIn += bytesIn
		t.mu.Unlock()
		for _, n := range notable {
			t.d.srv.Emit(bus.SignalEgressDecision, a.Name, n.rec.Decision, n.rec.Host, n.rec.Reason, n.line)
		}
		if allowed+flagged+blocked > 0 {
			t.d.refresh(context.Background(), a.Name)
		}
	}
}
