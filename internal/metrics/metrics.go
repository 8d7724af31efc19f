// Package metrics serves caged's state to Prometheus with the official
// client library. Nothing is counted here: each scrape reads a Snapshot
// that caged builds from what it already keeps (the audit counters it
// follows, its unit state cache, the store), so the metrics cannot drift
// from `cagectl status`.
package metrics

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Agent is one agent (declared or throw-away) at scrape time.
type Agent struct {
	Name string
	// Decisions since caged started, from the gateway's audit log.
	Allowed, Flagged, Blocked uint64
	// Bytes the gateway moved for the agent since caged started.
	BytesOut, BytesIn uint64
	// ActiveState is systemd's for the agent's unit; GatewayUp whether its
	// gateway's service is active.
	ActiveState string
	GatewayUp   bool
	Quarantined bool
}

// Snapshot is what one scrape reports.
type Snapshot struct {
	Agents []Agent
	// Generation is the store's current generation (0: none).
	Generation uint64
	// Expires is when the current generation's release expires (zero:
	// no generation).
	Expires time.Time
	// LastApply is when this caged last made a generation current (zero:
	// not since it started).
	LastApply time.Time
	// Channel is the pulled release channel; nil when none is polled.
	Channel *Channel
}

// Channel is the release channel poller at scrape time.
type Channel struct {
	LastPoll, LastSuccess time.Time // zero: none yet
	Published             uint64    // generation the index named (0: never read)
	Lag                   int64     // Published minus the current generation
	Failures              int       // consecutive failed polls
}

// Source builds a snapshot; it is called once per scrape.
type Source func(ctx context.Context) (*Snapshot, error)

// ActiveStates are systemd's unit active states; nixcage_agent_state has a
// series for each, 1 for the current one (the node_exporter convention, so
// `nixcage_agent_state{state="failed"} == 1` alerts).
var ActiveStates = []string{"active", "reloading", "inactive", "failed", "activating", "deactivating"}

var (
	descRequests   = prometheus.NewDesc("nixcage_requests_total", "Egress decisions the agent's gateway made since caged started, by decision.", []string{"agent", "decision"}, nil)
	descBytes      = prometheus.NewDesc("nixcage_egress_bytes_total", "Bytes the agent's gateway moved since caged started; direction is up (agent to upstream) or down.", []string{"agent", "direction"}, nil)
	descGateway    = prometheus.NewDesc("nixcage_gateway_up", "1 if the agent's egress gateway service is active.", []string{"agent"}, nil)
	descState      = prometheus.NewDesc("nixcage_agent_state", "1 for the agent unit's current systemd active state.", []string{"agent", "state"}, nil)
	descQuarantine = prometheus.NewDesc("nixcage_agent_quarantined", "1 if the agent is quarantined.", []string{"agent"}, nil)
	descGeneration = prometheus.NewDesc("nixcage_store_generation", "The shared store's current generation (0: none).", nil, nil)
	descExpiry     = prometheus.NewDesc("nixcage_release_expiry_seconds", "Seconds until the current generation's release expires (negative: expired, the channel is frozen).", nil, nil)
	descLastApply  = prometheus.NewDesc("nixcage_last_apply_timestamp_seconds", "Unix time this caged last made a generation current (apply or rollback).", nil, nil)
	descPoll       = prometheus.NewDesc("nixcage_channel_last_poll_timestamp_seconds", "Unix time the last poll of the release channel finished (success or not).", nil, nil)
	descPollOK     = prometheus.NewDesc("nixcage_channel_last_success_timestamp_seconds", "Unix time a poll of the release channel last succeeded.", nil, nil)
	descPublished  = prometheus.NewDesc("nixcage_channel_published_generation", "Generation the release channel's index named at the last poll that read it.", nil, nil)
	descLag        = prometheus.NewDesc("nixcage_channel_lag_generations", "Published generation minus the store's current one (>0: behind the channel).", nil, nil)
	descFailures   = prometheus.NewDesc("nixcage_channel_poll_failures", "Consecutive failed polls of the release channel (0: the last one succeeded).", nil, nil)
	descScrapeErr  = prometheus.NewDesc("nixcage_scrape_error", "1 if caged could not build its status for this scrape.", nil, nil)
)

type collector struct{ src Source }

func (c collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descRequests, descBytes, descGateway, descState, descQuarantine, descGeneration, descExpiry, descLastApply, descPoll, descPollOK, descPublished, descLag, descFailures, descScrapeErr} {
		ch <- d
	}
}

func (c collector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := c.src(ctx)
	if err != nil {
		ch <- prometheus.MustNewConstMetric(descScrapeErr, prometheus.GaugeValue, 1)
		return
	}
	ch <- prometheus.MustNewConstMetric(descScrapeErr, prometheus.GaugeValue, 0)
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	counter := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	for _, a := range s.Agents {
		counter(descRequests, a.Allowed, a.Name, "allowed")
		counter(descRequests, a.Flagged, a.Name, "flagged")
		counter(descRequests, a.Blocked, a.Name, "blocked")
		counter(descBytes, a.BytesOut, a.Name, "up")
		counter(descBytes, a.BytesIn, a.Name, "down")
		gauge(descGateway, b2f(a.GatewayUp), a.Name)
		gauge(descQuarantine, b2f(a.Quarantined), a.Name)
		for _, st := range ActiveStates {
			gauge(descState, b2f(a.ActiveState == st), a.Name, st)
		}
	}
	gauge(descGeneration, float64(s.Generation))
	if !s.Expires.IsZero() {
		gauge(descExpiry, time.Until(s.Expires).Seconds())
	}
	if !s.LastApply.IsZero() {
		gauge(descLastApply, float64(s.LastApply.UnixNano())/1e9)
	}
	if c := s.Channel; c != nil {
		if !c.LastPoll.IsZero() {
			gauge(descPoll, float64(c.LastPoll.UnixNano())/1e9)
		}
		if !c.LastSuccess.IsZero() {
			gauge(descPollOK, float64(c.LastSuccess.UnixNano())/1e9)
		}
		if c.Published != 0 {
			gauge(descPublished, float64(c.Published))
			gauge(descLag, float64(c.Lag))
		}
		gauge(descFailures, float64(c.Failures))
	}
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// Handler serves src in the Prometheus exposition format, on a registry
// of its own (no Go runtime metrics of the library's default registry:
// caged's own process is the node exporter's business).
func Handler(src Source) http.Handler {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collector{src})
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError}))
	return mux
}

// Listen opens listen ("HOST:PORT" or "unix:PATH", as config validated it),
// with root prefixed to a socket path (tests). A stale socket file of an
// earlier caged is replaced; the socket is made 0660 (root's group reads).
func Listen(listen, root string) (net.Listener, error) {
	p, unix := strings.CutPrefix(listen, "unix:")
	if !unix {
		l, err := net.Listen("tcp", listen)
		if err != nil {
			return nil, fmt.Errorf("metrics: listen on %s: %w", listen, err)
		}
		return l, nil
	}
	p = filepath.Join(root, p)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return nil, fmt.Errorf("metrics: %w", err)
	}
	if fi, err := os.Lstat(p); err == nil && fi.Mode()&os.ModeSocket != 0 {
		os.Remove(p)
	}
	l, err := net.Listen("unix", p)
	if err != nil {
		return nil, fmt.Errorf("metrics: listen on %s: %w", p, err)
	}
	if err := os.Chmod(p, 0o660); err != nil {
		l.Close()
		return nil, fmt.Errorf("metrics: %w", err)
	}
	return l, nil
}

// Serve serves h on l until ctx ends.
func Serve(ctx context.Context, l net.Listener, h http.Handler) error {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: time.Minute}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(sctx)
	}()
	if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("metrics: %w", err)
	}
	return nil
}
