package bus

import (
	"context"
	"testing"
	"time"

	"github.com/godbus/dbus/v5"

	"github.com/nixcage/nixcage/internal/bus/bustest"
	"github.com/nixcage/nixcage/internal/testenv"
)

// Every ApplyProgress caged sent before its reply reaches the watcher by
// the time stop returns: cagectl apply -v stops the watch right after
// the reply and prints the phases it saw (a CI run printed only the
// first phase when stop raced the buffered signals).
func TestWatchApplyProgressKeepsEverySignalBeforeStop(t *testing.T) {
	testenv.RequirePrivileged(t)
	b := bustest.Start(t, bustest.Options{Permissive: true})
	sender := b.Conn(t)
	const rounds, perRound = 30, 20
	for r := 0; r < rounds; r++ {
		cl := &Client{conn: b.Conn(t)}
		got := 0
		// A receiver slower than the sender (a terminal line per report)
		// leaves reports queued when the reply comes.
		stop := cl.WatchApplyProgress(func(ApplyProgress) { got++; time.Sleep(time.Millisecond) })
		for i := 0; i < perRound; i++ {
			p := ApplyProgress{Phase: "unpack", Done: uint64(i), Total: perRound}
			msg := &dbus.Message{Type: dbus.TypeSignal, Headers: map[dbus.HeaderField]dbus.Variant{
				dbus.FieldPath:        dbus.MakeVariant(Path),
				dbus.FieldInterface:   dbus.MakeVariant(ManagerIface),
				dbus.FieldMember:      dbus.MakeVariant(SignalApplyProgress),
				dbus.FieldDestination: dbus.MakeVariant(cl.conn.Names()[0]),
				dbus.FieldSignature:   dbus.MakeVariant(dbus.SignatureOf(p.Phase, p.Done, p.Total, p.Bytes, p.TotalBytes)),
			}, Body: []any{p.Phase, p.Done, p.Total, p.Bytes, p.TotalBytes}}
			if call := sender.Send(msg, nil); call.Err != nil {
				t.Fatal(call.Err)
			}
		}
		// The sender answers Peer.Ping after the signals it sent before:
		// once this returns they are all in the watcher's queue, as they
		// are when caged's Apply reply arrives.
		if err := cl.conn.Object(sender.Names()[0], "/").CallWithContext(context.Background(), "org.freedesktop.DBus.Peer.Ping", 0).Err; err != nil {
			t.Fatal(err)
		}
		stop()
		if got != perRound {
			t.Fatalf("round %d: the watcher handed over %d of %d progress signals sent before stop", r, got, perRound)
		}
	}
}
