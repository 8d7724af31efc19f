package egress

import (
	"errors"
	"io"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/nixcage/nixcage/internal/egress/ratelimit"
	"github.com/nixcage/nixcage/internal/policy"
)

// limiter is a token bucket per destination host. A zero rate disables it.
type limiter struct {
	rate, burst float64
	mu          sync.Mutex
	buckets     map[string]*ratelimit.Bucket
	now         func() time.Time
}

func newLimiter(r policy.RateLimit) *limiter {
	burst := float64(r.Burst)
	if burst < 1 {
		burst = max(1, r.PerSecond)
	}
	return &limiter{rate: r.PerSecond, burst: burst, buckets: map[string]*ratelimit.Bucket{}, now: time.Now}
}

// allow takes one token for host.
func (l *limiter) allow(host string) bool {
	if l.rate <= 0 {
		return true
	}
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	b, ok := l.buckets[host]
	if !ok {
		if len(l.buckets) > 10000 { // hosts are policy-bounded; this bounds wildcards
			clear(l.buckets)
		}
		b = ratelimit.New(l.rate, l.burst)
		l.buckets[host] = b
	}
	return b.Take(now)
}

// Read timeouts against slow clients (slowloris). A request header must be
// complete within headerTimeout (the servers' ReadHeaderTimeout); a request
// body must make progress, some byte within bodyIdleTimeout of the last,
// and be complete within bodyTimeout (both shortened to the policy's idle
// timeout when that is shorter). Each stalled request still holds a
// slot (max_tunnels) until then, so the cap bounds how many can stall.
const (
	headerTimeout   = 30 * time.Second
	bodyIdleTimeout = 30 * time.Second
	bodyTimeout     = 10 * time.Minute
)

// h2Limits bound what one intercepted HTTP/2 connection can make the
// gateway hold: 32 concurrent streams (not net/http's 250; each also takes a
// max_tunnels slot), 64 KiB frames, and flow-control windows the agent must
// wait on instead of gateway memory.
var h2Limits = &http.HTTP2Config{
	MaxConcurrentStreams:          32,
	MaxReadFrameSize:              64 << 10,
	MaxReceiveBufferPerConnection: 1 << 20,
	MaxReceiveBufferPerStream:     256 << 10,
	MaxDecoderHeaderTableSize:     4 << 10,
}

// upstreamH2 bounds what an HTTP/2 upstream may send the gateway before
// the agent reads it: the gateway reads a response only as fast as the
// agent takes it, and net/http's Transport lets an upstream send 4 MiB
// per stream first (48 streams the agent did not read held 199 MiB of the
// gateway, max_tunnels 256 would hold 1 GiB: red team redh2,
// TestRedTeamH2UpstreamWindowHeldForAgentNotReading). 256 KiB per stream,
// as the agent gets toward the gateway (h2Limits): at most 64 MiB over
// max_tunnels' 256 streams. The connection's window stays net/http's: it
// is bounded by its streams', and a smaller one would let streams the
// agent does not read stall every other on the same upstream connection.
var upstreamH2 = &http.HTTP2Config{
	MaxReceiveBufferPerStream: 256 << 10,
}

// errBodyStalled ends a request body the agent sends too slowly.
type errBodyStalled struct{ what string }

func (e errBodyStalled) Error() string {
	return "request body " + e.what + " (body read timeout)"
}

// deadlineBody sets the connection's (or HTTP/2 stream's) read deadline
// before each read of the request body, and clears it at the end so a
// long response on the same request is not cut off.
//
// The upstream client may still read the body after the handler has
// returned (net/http's HTTP/2 Transport writes a request body on a
// goroutine of its own that outlives RoundTrip), but the ResponseWriter and
// the body are dead then: net/http's HTTP/2 stream writer dereferences nil
// once its handler is done, which crashed the gateway under an agent that
// reset streams mid-upload (TestFloodRSS: about one run in ten before). detach,
// run as the handler returns, wakes a read in flight, waits for it, and
// makes every later read fail without touching either.
type deadlineBody struct {
	io.ReadCloser
	rc       *http.ResponseController
	idle     time.Duration
	deadline time.Time

	mu       sync.Mutex
	done     bool // the handler returned
	inflight int  // Reads in flight (under mu)
	reading  sync.WaitGroup
}

// errBodyDetached is what the upstream client reads from a request body
// once the handler that owned it has returned.
var errBodyDetached = errors.New("request body read after its handler returned")

// limitBody puts r's body under the body read timeouts. The handler must
// call the returned detach before it returns.
func (g *Gateway) limitBody(w http.ResponseWriter, r *http.Request, st *state) (detach func()) {
	if r.Body == nil || r.Body == http.NoBody {
		return func() {}
	}
	b := &deadlineBody{ReadCloser: r.Body, rc: http.NewResponseController(w), idle: min(bodyIdleTimeout, st.idle), deadline: time.Now().Add(min(bodyTimeout, st.idle))}
	r.Body = b
	return b.detach
}

func (b *deadlineBody) detach() {
	b.mu.Lock()
	if b.done {
		b.mu.Unlock()
		return
	}
	b.done = true
	if b.inflight > 0 {
		// Still the handler's: a read blocked on the agent returns now.
		_ = b.rc.SetReadDeadline(time.Now())
	}
	b.mu.Unlock()
	b.reading.Wait()
}

func (b *deadlineBody) Read(p []byte) (int, error) {
	b.mu.Lock()
	if b.done {
		b.mu.Unlock()
		return 0, errBodyDetached
	}
	b.inflight++
	b.reading.Add(1)
	defer b.readDone()
	d := time.Now().Add(b.idle)
	if b.deadline.Before(d) {
		d = b.deadline
	}
	_ = b.rc.SetReadDeadline(d)
	b.mu.Unlock()
	n, err := b.ReadCloser.Read(p)
	switch {
	case err == nil:
	case errors.Is(err, os.ErrDeadlineExceeded):
		if b.isDone() {
			return n, errBodyDetached
		}
		what := "stalled"
		if !time.Now().Before(b.deadline) {
			what = "took too long"
		}
		return n, errBodyStalled{what}
	default:
		b.mu.Lock()
		if !b.done {
			_ = b.rc.SetReadDeadline(time.Time{})
		}
		b.mu.Unlock()
	}
	return n, err
}

func (b *deadlineBody) readDone() {
	b.mu.Lock()
	b.inflight--
	b.mu.Unlock()
	b.reading.Done()
}

func (b *deadlineBody) isDone() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.done
}
