package daemon

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/channel"
	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/events"
	"github.com/nixcage/nixcage/internal/release"
	"github.com/nixcage/nixcage/internal/store"
)

// channelApplyTimeout bounds a whole apply from the channel: the NARs have
// an idle timeout and their signed sizes, but a server trickling one byte
// just inside the idle timeout would otherwise hold the store's lock for
// ever. An hour is far above any real closure on a working link.
const channelApplyTimeout = time.Hour

var (
	errChannelApplyTimeout = errors.New("the channel apply did not finish within " + channelApplyTimeout.String())
	errYieldToAdmin        = errors.New("the channel apply was stopped for an admin's action (apply, rollback, reload); the next poll retries it")
)

// channelState is the poller and what the status reads of it.
type channelState struct {
	poller *channel.Poller
	url    string // as configured, for status

	mu      sync.Mutex
	client  *channel.Client
	key     string // URL and CA file client was made for
	lastErr string // the previous poll's error, to journal each reason once
}

// runChannel polls the configured channel until ctx ends. Adding or
// removing the channel block takes effect when caged restarts; a changed
// url, interval or ca_file at the next poll.
func (d *Daemon) runChannel(ctx context.Context) {
	c := d.config().Channel
	if c == nil {
		return
	}
	cs := &channelState{url: c.URL}
	cs.poller = &channel.Poller{
		Poll: func(ctx context.Context) (uint64, error) { return d.pollChannel(ctx, cs) },
		Interval: func() time.Duration {
			if c := d.config().Channel; c != nil {
				return c.Interval
			}
			return config.DefaultChannelInterval
		},
		OnStatus: func(channel.Status) { d.publishChannel() },
	}
	d.mu.Lock()
	d.channel = cs
	d.mu.Unlock()
	d.log.Info("polling release channel", "url", c.URL, "interval", c.Interval)
	cs.poller.Run(ctx)
}

// clientFor returns a client for c, made anew when the url or CA changed.
func (d *Daemon) clientFor(cs *channelState, c *config.Channel) (*channel.Client, error) {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	key := c.URL + "\x00" + c.CAFile
	if cs.client != nil && cs.key == key {
		return cs.client, nil
	}
	o := channel.Options{URL: c.URL}
	if strings.HasPrefix(c.URL, "/") {
		o.URL = d.qdirs.Host(c.URL)
	}
	if c.CAFile != "" {
		o.CAFile = d.qdirs.Host(c.CAFile)
	}
	cl, err := channel.New(o)
	if err != nil {
		return nil, err
	}
	cs.client, cs.key = cl, key
	return cl, nil
}

// pollChannel is one poll: read the index, hand the control feed to its
// consumer, then apply the release if it is newer. It returns the
// generation the index names (0 if unread).
func (d *Daemon) pollChannel(ctx context.Context, cs *channelState) (uint64, error) {
	cfg := d.config()
	err := func() error {
		if cfg.Channel == nil {
			return errors.New("the channel block was removed from the configuration; polling stops when caged restarts")
		}
		if cfg.Store == nil {
			return errNoStore
		}
		return nil
	}()
	if err != nil {
		return 0, d.pollFailed(cs, "", err)
	}
	cl, err := d.clientFor(cs, cfg.Channel)
	if err != nil {
		return 0, d.pollFailed(cs, "", err)
	}
	ix, err := cl.Index(ctx)
	if err != nil {
		return 0, d.pollFailed(cs, cl.String(), err)
	}
	var ctlErr error
	if d.controlFeed != nil {
		cmds, err := cl.Controls(ctx)
		if err != nil {
			ctlErr = err
		} else {
			d.controlFeed(ctx, cmds)
		}
	}
	if ix.Channel != cfg.Store.Channel {
		err := &release.Refusal{Reason: fmt.Sprintf("the channel at %s publishes channel %q, this store follows %q: fix channel.url or store.channel", cl, ix.Channel, cfg.Store.Channel)}
		return ix.Generation, d.pollFailed(cs, cl.String(), errors.Join(err, ctlErr))
	}
	err = d.pollRelease(ctx, cl, ix)
	if err = errors.Join(err, ctlErr); err != nil {
		return ix.Generation, d.pollFailed(cs, cl.Release(ix).String(), err)
	}
	cs.mu.Lock()
	cs.lastErr = ""
	cs.mu.Unlock()
	return ix.Generation, nil
}

// pollRelease applies the release ix names unless it is the current
// generation. The index is untrusted and its number is only a hint: which
// release is newer is the store's decision (its anti-rollback counter
// counts only what the trusted keys signed, after the key rotations the
// channel ships), so everything but the current generation goes to the
// store. A pre-check by number here would freeze a host whose current
// generation a revoked key numbered 2^64-1, the attack the store's counter
// recovers from (docs/store.md "Anti-rollback counter").
func (d *Daemon) pollRelease(ctx context.Context, cl *channel.Client, ix *channel.Index) error {
	d.op.Lock()
	defer d.op.Unlock()
	s, err := d.openStore(false)
	if err != nil {
		return err
	}
	cur, err := s.Current()
	if err != nil {
		return err
	}
	if ix.Generation == cur {
		return nil
	}
	ctx, done := d.channelApplyContext(ctx)
	defer done()
	_, err = d.applySource(ctx, cl.Release(ix), channelBy(cl))
	if c := context.Cause(ctx); err != nil && (c == errYieldToAdmin || c == errChannelApplyTimeout) && !strings.Contains(err.Error(), c.Error()) {
		err = fmt.Errorf("%w (%v)", c, err)
	}
	var ref *release.Refusal
	if errors.As(err, &ref) && ix.Generation > cur && keptGeneration(s, ix.Generation) {
		// An operator rolled back from this very generation: the rollback
		// stands until the channel publishes something newer.
		d.log.Debug("channel serves a generation rolled back from", "generation", ix.Generation, "current", cur)
		return nil
	}
	return err
}

// keptGeneration reports whether n is one of the store's kept generations
// (a revoked key's generations above current are pruned, so this is never
// true of them).
func keptGeneration(s *store.Store, n uint64) bool {
	gens, err := s.Generations()
	if err != nil {
		return false
	}
	for _, g := range gens {
		if g.Number == n {
			return true
		}
	}
	return false
}

func channelBy(cl *channel.Client) string { return "channel " + cl.String() }

// pollFailed journals a failed poll once per distinct reason (a channel
// broken for a day must not write an entry per retry) and returns err.
// A refused release is a release-refused event, as from cagectl apply;
// anything else (unreachable, malformed index) a channel-poll-failed one.
func (d *Daemon) pollFailed(cs *channelState, source string, err error) error {
	cs.mu.Lock()
	repeat := cs.lastErr == err.Error()
	cs.lastErr = err.Error()
	cs.mu.Unlock()
	if repeat {
		return err
	}
	var ref *release.Refusal
	if errors.As(err, &ref) {
		d.storeFailure("poll", source, "channel", err)
		return err
	}
	d.log.Error("channel poll failed", "url", cs.url, "err", err)
	d.journal(events.ChannelPollFailed, map[string]string{"NIXCAGE_URL": cs.url, "NIXCAGE_REASON": err.Error()})
	return err
}

// channelStatus is the poller's state for status, properties and metrics.
func (d *Daemon) channelStatus(current uint64) bus.ChannelStatus {
	d.mu.RLock()
	cs := d.channel
	d.mu.RUnlock()
	if cs == nil {
		return bus.ChannelStatus{}
	}
	st := cs.poller.Status()
	out := bus.ChannelStatus{URL: cs.url, LastPollUnix: unixOrZero(st.LastPoll), LastSuccessUnix: unixOrZero(st.LastSuccess),
		NextPollUnix: unixOrZero(st.NextPoll), Published: st.Published, LastError: st.LastError, Failures: uint32(st.Failures)}
	if st.Published != 0 {
		out.Lag = int64(st.Published) - int64(current)
	}
	return out
}

// publishChannel updates the Manager's channel properties after a poll.
func (d *Daemon) publishChannel() {
	if d.srv == nil {
		return
	}
	gen, _ := d.storeCurrent()
	d.srv.SetChannel(d.channelStatus(gen))
}

// unixOrZero is t in Unix seconds, 0 for the zero time ("never").
func unixOrZero(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.Unix()
}
