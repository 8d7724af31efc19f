package bus

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"reflect"
	"testing"

	"github.com/godbus/dbus/v5"

	"github.com/nixcage/nixcage/internal/policy"
)

func wire(t testing.TB, st Status) *dbus.Message {
	m := &dbus.Message{Type: dbus.TypeMethodReply, Headers: map[dbus.HeaderField]dbus.Variant{
		dbus.FieldReplySerial: dbus.MakeVariant(uint32(1)),
		dbus.FieldSignature:   dbus.MakeVariant(dbus.SignatureOf(st)),
	}, Body: []any{st}}
	var buf bytes.Buffer
	if err := m.EncodeTo(&buf, binary.LittleEndian); err != nil {
		t.Fatal(err)
	}
	out, err := dbus.DecodeMessage(&buf)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func sampleStatus(n int) Status {
	st := Status{Version: "v", Mode: "render", Config: "/c", Generation: 3, Channel: "stable", GenerationExpiresUnix: 9, Freshness: "expiring", FreshnessMessage: "m", StartedUnix: 5, ReconciledUnix: 6, ReconcileError: "e",
		ChannelPoll: ChannelStatus{URL: "https://c/", LastPollUnix: 7, LastSuccessUnix: 8, NextPollUnix: 10, Published: 4, Lag: 1, LastError: "x", Failures: 2}}
	for i := 0; i < n; i++ {
		st.Bans = append(st.Bans, policy.Ban{ID: fmt.Sprintf("b-%d", i), Host: "h.example.com", Agent: "*", CreatedUnix: int64(i), Command: "c", Reason: "r"})
		st.Agents = append(st.Agents, AgentStatus{Name: fmt.Sprintf("a%d", i), Backend: "service", Unit: "u", LoadState: "loaded",
			ActiveState: "active", SubState: "running", EgressState: "active", Autostart: i%2 == 0, Quarantined: i%3 == 0,
			QuarantineReason: "r", Generation: uint64(i), Allowed: 1, Flagged: 2, Blocked: uint64(i * 7), LearnUntilUnix: int64(i)})
	}
	return st
}

// The fast path must agree with dbus.Store field by field.
func TestDecodeStatusMatchesStore(t *testing.T) {
	for _, n := range []int{0, 1, 50} {
		m := wire(t, sampleStatus(n))
		var want Status
		if err := dbus.Store(m.Body, &want); err != nil {
			t.Fatal(err)
		}
		got, ok := decodeStatus(m.Body[0])
		if !ok {
			t.Fatalf("n=%d: fast path refused a valid reply", n)
		}
		if len(want.Agents) == 0 {
			want.Agents = []AgentStatus{}
		}
		if len(want.Bans) == 0 {
			want.Bans, got.Bans = nil, nil
		}
		if !reflect.DeepEqual(*got, want) {
			t.Errorf("n=%d: fast path %+v, Store %+v", n, *got, want)
		}
	}
	if _, ok := decodeStatus([]any{"too", "short"}); ok {
		t.Error("malformed reply accepted")
	}
}

func BenchmarkDecodeStatus(b *testing.B) {
	m := wire(b, sampleStatus(1000))
	b.Run("store", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			var st Status
			dbus.Store(m.Body, &st)
		}
	})
	b.Run("fast", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			decodeStatus(m.Body[0])
		}
	})
}
