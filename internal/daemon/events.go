package daemon

import (
	"time"

	"github.com/nixcage/nixcage/internal/events"
)

// emit signals an event on the bus and writes it to the journal (package
// events): one call, so the two can never tell different stories.
func (d *Daemon) emit(signal string, args ...any) {
	if d.srv != nil {
		d.srv.Emit(signal, args...)
	}
	if k, ok := events.ForSignal(signal); ok {
		d.journal(k, k.FieldsOf(args...))
	}
}

// journal writes an event that has no bus signal of its own (or the
// journal half of one).
func (d *Daemon) journal(k events.Kind, f map[string]string) {
	if err := events.Send(k, f); err != nil {
		d.log.Warn("write event to the journal", "event", k.Name, "err", err)
	}
}

// noteApplied records when a generation was last made current (apply or
// rollback), for the metrics.
func (d *Daemon) noteApplied() {
	d.mu.Lock()
	d.lastApply = time.Now()
	d.mu.Unlock()
}
