package store

import (
	"fmt"
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
type Freshness struct {
	Generation uint64    `json:"generation"`
	Expires    time.Time `json:"expires"`
	State      string    `json:"state"`
}

// Message is one line for an operator; empty when all is well.
func (f Freshness) Message() string {
	switch f.State {
	case FreshExpired:
		return fmt.Sprintf("generation %d's release expired at %s: the channel looks frozen (its mirror serves no newer release); publish and apply a fresh release", f.Generation, f.Expires.UTC().Format(time.RFC3339))
	case FreshExpiring:
		return fmt.Sprintf("generation %d's release expires at %s: publish and apply a fresh one before then", f.Generation, f.Expires.UTC().Format(time.RFC3339))
	}
	return ""
}

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
	f := Freshness{Generation: cur, Expires: m.Expires}
	now := s.opts.Now()
	switch {
	case !now.Before(m.Expires):
		f.State = FreshExpired
	case now.Add(s.opts.ExpiryWarning).After(m.Expires):
		f.State = FreshExpiring
	default:
		f.State = FreshOK
	}
	return f, nil
}
