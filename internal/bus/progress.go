package bus

import (
	"context"
	"sync"
	"time"

	"github.com/godbus/dbus/v5"
	"github.com/godbus/dbus/v5/introspect"
)

// SignalApplyProgress reports how far an apply is: (s phase, t done,
// t total, x bytes, x total_bytes). It is addressed to the caller of Apply
// or ApplyDir only, never broadcast, at most every 100ms (and once at the
// end of each phase).
const SignalApplyProgress = "ApplyProgress"

// ApplyProgress is one report.
type ApplyProgress struct {
	Phase             string
	Done, Total       uint64
	Bytes, TotalBytes int64
}

// ProgressFunc receives an apply's progress.
type ProgressFunc func(ApplyProgress)

type progressKey struct{}

// ProgressFrom returns the progress receiver the server put in ctx for an
// apply, or nil.
func ProgressFrom(ctx context.Context) ProgressFunc {
	f, _ := ctx.Value(progressKey{}).(ProgressFunc)
	return f
}

func init() {
	managerSignals = append(managerSignals, introspect.Signal{Name: SignalApplyProgress, Args: []introspect.Arg{
		{Name: "phase", Type: "s"}, {Name: "done", Type: "t"}, {Name: "total", Type: "t"}, {Name: "bytes", Type: "x"}, {Name: "total_bytes", Type: "x"}}})
}

// progressTo is a context whose ProgressFrom sends addressed signals to
// dest, rate-limited.
func (s *Server) progressTo(ctx context.Context, dest dbus.Sender) context.Context {
	var mu sync.Mutex
	var last time.Time
	lastPhase := ""
	f := ProgressFunc(func(p ApplyProgress) {
		mu.Lock()
		defer mu.Unlock()
		if p.Phase == lastPhase && p.Done != p.Total && time.Since(last) < 100*time.Millisecond {
			return
		}
		last, lastPhase = time.Now(), p.Phase
		msg := &dbus.Message{Type: dbus.TypeSignal, Headers: map[dbus.HeaderField]dbus.Variant{
			dbus.FieldPath:        dbus.MakeVariant(Path),
			dbus.FieldInterface:   dbus.MakeVariant(ManagerIface),
			dbus.FieldMember:      dbus.MakeVariant(SignalApplyProgress),
			dbus.FieldDestination: dbus.MakeVariant(string(dest)),
			dbus.FieldSignature:   dbus.MakeVariant(dbus.SignatureOf(p.Phase, p.Done, p.Total, p.Bytes, p.TotalBytes)),
		}, Body: []any{p.Phase, p.Done, p.Total, p.Bytes, p.TotalBytes}}
		s.conn.Send(msg, nil)
	})
	return context.WithValue(ctx, progressKey{}, f)
}

// WatchApplyProgress calls f for every ApplyProgress caged addresses to this
// connection, until stop is called.
func (c *Client) WatchApplyProgress(f ProgressFunc) (stop func()) {
	ch := make(chan *dbus.Signal, 64)
	c.conn.Signal(ch)
	done := make(chan struct{})
	finished := make(chan struct{})
	handle := func(sig *dbus.Signal) {
		if sig.Name != ManagerIface+"."+SignalApplyProgress || len(sig.Body) != 5 {
			return
		}
		var p ApplyProgress
		var ok [5]bool
		p.Phase, ok[0] = sig.Body[0].(string)
		p.Done, ok[1] = sig.Body[1].(uint64)
		p.Total, ok[2] = sig.Body[2].(uint64)
		p.Bytes, ok[3] = sig.Body[3].(int64)
		p.TotalBytes, ok[4] = sig.Body[4].(int64)
		if ok == [5]bool{true, true, true, true, true} {
			f(p)
		}
	}
	go func() {
		defer close(finished)
		for {
			select {
			case sig := <-ch:
				handle(sig)
			case <-done:
				// godbus queued every signal caged sent before its reply
				// into ch before the reply returned: hand those over too.
				// (select picks at random between ready cases, so without
				// this drain stop() lost the last phases: TestCagedOnSystemd
				// saw `apply -v` print only "verify".)
				for {
					select {
					case sig := <-ch:
						handle(sig)
					default:
						return
					}
				}
			}
		}
	}()
	return func() {
		c.conn.RemoveSignal(ch)
		close(done)
		<-finished
	}
}
