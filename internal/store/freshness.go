package store

import (
	"fmt"
	"strings"
	"time"
)

// Freshness states of the current generation.
const (
	FreshNone     = "none"     // no current generation
	FreshOK       = "ok"       // expires after the warning window
	FreshExpiring = "expiring" // expires within Options.ExpiryWarning
	FreshExpired  = "expired"  // its release has expired: the channel is frozen
)

// Freshness is how close the current generation's release is to expiry.
// apply refuses an expired release, but nothing stops a mirror from serving
// the last good one for ever: then current stays, and ages past expires.
// This is how that freeze is noticed.
//
// The key set the store trusts (see Trust) expires too: past that no
// release is accepted at all, which freezes the channel just as surely, so
// State is the worse of the two.
type Freshness struct {
	Generation uint64    `json:"generation"`
	Expires    time.Time `json:"expires"`
	State      string    `json:"state"`
	// KeySetVersion and KeySetExpires describe the trusted key set when
	// key rotation is in use (zero otherwise); KeySetState is its own state.
	KeySetVersion uint64    `json:"key_set_version,omitempty"`
	KeySetExpires time.Time `json:"key_set_expires,omitzero"`
	KeySetState   string    `json:"key_set_state,omitempty"`
	// Unvouched is set when the trusted key set does not vouch for the
	// current generation (its signers were revoked since it was applied):
	// cages keep running it, but it is what a revoked key shipped.
	Unvouched string `json:"unvouched,omitempty"`
	genState  string
}

// Message is one line for an operator; empty when all is well.
func (f Freshness) Message() string {
	var msg []string
	at := f.Expires.UTC().Format(time.RFC3339)
	switch f.genState {
	case FreshExpired:
		msg = append(msg, fmt.Sprintf("generation %d's release expired at %s: the channel looks frozen (its mirror serves no newer release); publish and apply a fresh release", f.Generation, at))
	case FreshExpiring:
		msg = append(msg, fmt.Sprintf("generation %d's release expires at %s: publish and apply a fresh one before then", f.Generation, at))
	}
	ks := f.KeySetExpires.UTC().Format(time.RFC3339)
	switch f.KeySetState {
	case FreshExpired:
		msg = append(msg, fmt.Sprintf("key set version %d expired at %s: no release can be accepted until the root keys sign a new one (cagectl key rotate)", f.KeySetVersion, ks))
	case FreshExpiring:
		msg = append(msg, fmt.Sprintf("key set version %d expires at %s: have the root keys sign a new one (cagectl key rotate) before then", f.KeySetVersion, ks))
	}
	if f.Unvouched != "" {
		msg = append(msg, fmt.Sprintf("current generation is not vouched for by the trusted key set (version %d): %s; apply a newer release signed by the current release keys", f.KeySetVersion, f.Unvouched))
	}
	return strings.Join(msg, "; ")
}

// freshness is the state of something that expires at exp.
func (s *Store) freshness(exp time.Time) string {
	now := s.opts.Now()
	switch {
	case !now.Before(exp):
		return FreshExpired
	case now.Add(s.opts.ExpiryWarning).After(exp):
		return FreshExpiring
	}
	return FreshOK
}

var freshRank = map[string]int{FreshNone: 0, FreshOK: 1, FreshExpiring: 2, FreshExpired: 3}

// Freshness reports the current generation's expiry against now and
// Options.ExpiryWarning. Cages keep running an expired generation (stopping
// them would turn a frozen mirror into an outage); it is reported, not
// enforced.
func (s *Store) Freshness() (Freshness, error) {
	cur, err := s.Current()
	if err != nil || cur == 0 {
		return Freshness{State: FreshNone}, err
	}
	m, err := s.manifest(cur)
	if err != nil {
		return Freshness{Generation: cur, State: FreshNone}, err
	}
	f := Freshness{Generation: cur, Expires: m.Expires, genState: s.freshness(m.Expires)}
	f.State = f.genState
	if t, err := s.Trust(); err == nil {
		f.KeySetVersion = t.Version
		if !t.Expires.IsZero() {
			f.KeySetExpires, f.KeySetState = t.Expires, s.freshness(t.Expires)
			if freshRank[f.KeySetState] > freshRank[f.State] {
				f.State = f.KeySetState
			}
		}
		if len(t.ReleaseKeys) > 0 {
			if err := s.vouchedFor(cur, t); err != nil {
				f.Unvouched = err.Error()
			}
		}
	}
	return f, nil
}
