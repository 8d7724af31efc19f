package daemon

import (
	"context"
	"time"

	"github.com/nixcage/nixcage/internal/metrics"
)

// serveMetrics serves the metrics block's endpoint until ctx ends. A
// failure to listen is logged, not fatal: caged manages the cages and
// their quarantine, and a taken port must not stop that.
func (d *Daemon) serveMetrics(ctx context.Context) {
	m := d.config().Metrics
	if m == nil {
		return
	}
	l, err := metrics.Listen(m.Listen, d.o.Root)
	if err != nil {
		d.log.Error("metrics are not served", "err", err)
		return
	}
	d.log.Info("serving metrics", "listen", m.Listen)
	if err := metrics.Serve(ctx, l, metrics.Handler(d.metricsSnapshot)); err != nil {
		d.log.Error("metrics endpoint stopped", "err", err)
	}
}

// metricsSnapshot is one scrape: the status cagectl shows, plus bytes.
func (d *Daemon) metricsSnapshot(ctx context.Context) (*metrics.Snapshot, error) {
	st, err := d.Status(ctx)
	if err != nil {
		return nil, err
	}
	s := &metrics.Snapshot{Generation: st.Generation}
	if st.GenerationExpiresUnix != 0 {
		s.Expires = time.Unix(st.GenerationExpiresUnix, 0)
	}
	d.mu.RLock()
	s.LastApply = d.lastApply
	d.mu.RUnlock()
	if c := st.ChannelPoll; c.URL != "" {
		s.Channel = &metrics.Channel{Published: c.Published, Lag: c.Lag, Failures: int(c.Failures)}
		if c.LastPollUnix != 0 {
			s.Channel.LastPoll = time.Unix(c.LastPollUnix, 0)
		}
		if c.LastSuccessUnix != 0 {
			s.Channel.LastSuccess = time.Unix(c.LastSuccessUnix, 0)
		}
	}
	for _, a := range st.Agents {
		m := metrics.Agent{Name: a.Name, Allowed: a.Allowed, Flagged: a.Flagged, Blocked: a.Blocked,
			ActiveState: a.ActiveState, GatewayUp: a.EgressState == "active", Quarantined: a.Quarantined}
		if d.audit != nil {
			m.BytesOut, m.BytesIn = d.audit.traffic(a.Name)
		}
		s.Agents = append(s.Agents, m)
	}
	return s, nil
}
