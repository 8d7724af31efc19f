// Package egress is cage-egress, the only way out of a cage. Per request the
// pipeline is decide -> inspect -> inject -> forward -> redact -> audit:
//
//   - decide: policy.Decide on the host and port the agent asked for, then
//     resolve once, classify every address (netguard) and dial the vetted one;
//   - inspect: on intercepted TLS and plain HTTP, content inspectors see the
//     request as the agent wrote it (placeholders, never real values);
//   - inject: only after every inspector passed, placeholders in headers of
//     requests over TLS to hosts bound to that secret become real values;
//   - forward, redact: responses have real values turned back into
//     placeholders, in headers and streamed bodies;
//   - audit: one record per decision, never a secret value.
//
// The configuration lives in an immutable state value swapped atomically on
// reload, so a tunnel keeps the state it was admitted under and a reload
// never drops one.
package egress

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/egress/ca"
	"github.com/nixcage/nixcage/internal/egress/dnsfilter"
	"github.com/nixcage/nixcage/internal/egress/inspect"
	"github.com/nixcage/nixcage/internal/egress/netguard"
	"github.com/nixcage/nixcage/internal/egress/redact"
	"github.com/nixcage/nixcage/internal/egress/secrets"
	"github.com/nixcage/nixcage/internal/policy"
	"github.com/nixcage/nixcage/internal/procs"
)

// Limits a document leaves at zero take the model's defaults
// (policy.Default*): one value per knob.
const (
	handshakeTimeout = 15 * time.Second
	dialTimeout      = 15 * time.Second
)

// Resolver looks up addresses; *net.Resolver implements it.
type Resolver interface {
	LookupNetIP(ctx context.Context, network, host string) ([]netip.Addr, error)
}

// state is one loaded configuration. Immutable once built.
type state struct {
	rt        *policy.Runtime
	pol       *policy.Policy
	secrets   []*secrets.Secret
	insp      *inspect.Set
	redact    *redact.Matcher // every form of every real value
	guard     *netguard.Guard
	limiter   *limiter
	intercept []string // inspect patterns plus every secret's hosts
	maxTun    int
	maxHeader int
	maxBody   int64
	idle      time.Duration
}

// Options configure a Gateway beyond the runtime document.
type Options struct {
	CredentialsDir string
	Resolver       Resolver
	// UpstreamRoots verify upstream servers on intercepted connections;
	// nil means the system roots.
	UpstreamRoots *x509.CertPool
	Audit         *audit.Logger
	CA            *ca.Authority
	Log           *slog.Logger
	// UnsafeBenchIPLiterals lets a CONNECT name an IP literal, decided on
	// the TLS SNI name instead (bench/egress/run.sh's ip rows). Set only by
	// cage-egress --unsafe-bench-ip-literals, which refuses to run under
	// systemd; no configuration document can set it (docs/egress.md).
	UnsafeBenchIPLiterals bool
	// Procs sets GOMAXPROCS from the intercepted work in flight (one P
	// while it is serial; internal/procs). nil leaves GOMAXPROCS alone:
	// cage-egress sets it, tests that run many gateways in one process
	// do not.
	Procs *procs.Governor
}

// Gateway is one agent's egress gateway.
type Gateway struct {
	st   atomic.Pointer[state]
	opts Options
	// held counts connections, tunnels and HTTP/2 streams (max_tunnels).
	held     atomic.Int64
	refusers atomic.Int64
	own      map[netip.Addr]bool
	mu       sync.Mutex
	listen   map[netip.AddrPort]bool
	h1, h2   *http.Transport
	// decodeMem bounds the brotli and zstd windows held at once
	// (coding.go).
	decodeMem *decodeBudget
	// upTLS is the client config toward intercepted upstreams (one
	// session cache: a new connection to a host resumes its TLS session);
	// upIdle the upstream connections between intercepted tunnels.
	upTLS  *tls.Config
	upIdle upPool
	log    *slog.Logger
	// grants are the time-bound grants in force (grants.go), swapped
	// whole when the grants file changes; expiry is checked per decision.
	grants atomic.Pointer[[]policy.Grant]
	// bans are the control commands' bans for this agent (bans.go);
	// live holds the open tunnels a new ban closes.
	bans atomic.Pointer[[]policy.Ban]
	live sync.Map // *liveTunnel -> struct{}
	// learn is learn mode (learn.go), nil when off; its window's end is
	// checked per decision.
	learn atomic.Pointer[policy.Learning]
	// approvals is the approval queue (approval.go), nil when off. It is
	// the runtime document's at start; a reload does not change it.
	approvals *approvals
}

// New builds a gateway from a runtime document. Any inconsistency is an
// error: a gateway that cannot enforce its configuration does not start.
func New(rt *policy.Runtime, opts Options) (*Gateway, error) {
	if opts.Audit == nil {
		return nil, errors.New("egress: no audit logger")
	}
	if opts.Resolver == nil {
		opts.Resolver = net.DefaultResolver
	}
	if opts.Log == nil {
		opts.Log = slog.Default()
	}
	g := &Gateway{opts: opts, own: netguard.OwnAddrs(), listen: map[netip.AddrPort]bool{}, log: opts.Log}
	opts.Audit.SetBudget(audit.ClassDNS, audit.DefaultBudget)
	opts.Audit.SetBudget(audit.ClassCap, audit.DefaultBudget)
	opts.Audit.SetBudget(audit.ClassRefusal, audit.RefusalBudget)
	st, err := g.build(rt)
	if err != nil {
		return nil, err
	}
	if err := checkCA(st, opts.CA); err != nil {
		return nil, err
	}
	g.st.Store(st)
	g.grants.Store(&[]policy.Grant{})
	if rt.Approval != nil {
		g.approvals = newApprovals(rt.Approval, rt.Agent)
	}
	g.upTLS = &tls.Config{RootCAs: opts.UpstreamRoots, MinVersion: tls.VersionTLS12, ClientSessionCache: tls.NewLRUClientSessionCache(0)}
	g.decodeMem = newDecodeBudget()
	g.h1 = g.newTransport(false)
	g.h2 = g.newTransport(true)
	return g, nil
}

func (g *Gateway) build(rt *policy.Runtime) (*state, error) {
	secs, err := secrets.Load(rt, g.opts.CredentialsDir)
	if err != nil {
		return nil, err
	}
	var forms []redact.Form
	placeholders := map[string]string{}
	intercept := append([]string{}, rt.Policy.Inspect...)
	for _, s := range secs {
		fs, err := redact.Forms(s.Name, s.Real, s.Placeholder)
		if err != nil {
			return nil, fmt.Errorf("egress config: %w", err)
		}
		forms = append(forms, fs...)
		placeholders[s.Name] = s.Placeholder
		intercept = append(intercept, s.Hosts...)
	}
	// One list of forms for both directions: what the outbound check
	// blocks is exactly what responses are redacted of.
	matcher := redact.New(forms)
	insp, err := inspect.New(rt.Policy.Inspectors, matcher, placeholders)
	if err != nil {
		return nil, fmt.Errorf("egress config: %w", err)
	}
	for _, p := range rt.Policy.Ports {
		if p < 1 || p > 65535 {
			return nil, fmt.Errorf("egress config: port %d out of range 1-65535", p)
		}
	}
	if rt.Policy.RateLimit.PerSecond < 0 || rt.Policy.RateLimit.Burst < 0 {
		return nil, fmt.Errorf("egress config: rate_limit values must not be negative")
	}
	lim := rt.Policy.Limits
	if lim.MaxTunnels < 0 || lim.MaxHeaderBytes < 0 || lim.MaxBodyBytes < 0 || lim.IdleTimeoutSeconds < 0 {
		return nil, fmt.Errorf("egress config: limits must not be negative (0 means the default)")
	}
	st := &state{
		rt: rt, pol: &rt.Policy, secrets: secs, insp: insp, intercept: intercept, redact: matcher,
		guard: &netguard.Guard{
			UnsafeAllowLoopback: rt.Policy.UnsafeAllowLoopbackUpstreams,
			UnsafeAllowPrivate:  rt.Policy.UnsafeAllowPrivateUpstreams,
			Own:                 g.own,
			Forbidden:           g.listenersSnapshot(),
		},
		limiter:   newLimiter(rt.Policy.RateLimit),
		maxTun:    orDefault(lim.MaxTunnels, policy.DefaultMaxTunnels),
		maxHeader: orDefault(lim.MaxHeaderBytes, policy.DefaultMaxHeaderBytes),
		maxBody:   orDefault(lim.MaxBodyBytes, policy.DefaultMaxBodyBytes),
		idle:      time.Duration(orDefault(lim.IdleTimeoutSeconds, policy.DefaultIdleTimeoutSeconds)) * time.Second,
	}
	return st, nil
}

func orDefault[T int | int64](v, d T) T {
	if v == 0 {
		return d
	}
	return v
}

// Reload swaps in a new configuration. On error the old one stays in force
// and the error is returned; open tunnels are never touched.
func (g *Gateway) Reload(rt *policy.Runtime) error {
	if rt.Agent != g.st.Load().rt.Agent {
		return fmt.Errorf("reload: config is for agent %q, this gateway serves %q", rt.Agent, g.st.Load().rt.Agent)
	}
	st, err := g.build(rt)
	if err != nil {
		return err
	}
	if err := checkCA(st, g.opts.CA); err != nil {
		return fmt.Errorf("reload: %w", err)
	}
	g.st.Store(st)
	return nil
}

// checkCA refuses a configuration whose intercepted hosts the CA cannot
// vouch for: the agent would reject every leaf for them (name constraints),
// so it is a configuration error, reported now rather than as TLS failures.
func checkCA(st *state, a *ca.Authority) error {
	if len(st.intercept) == 0 {
		return nil
	}
	if a == nil {
		return errors.New("egress: policy intercepts hosts but no CA is loaded")
	}
	for _, p := range st.intercept {
		if !a.Permits(p) {
			return fmt.Errorf("egress: the cage CA's name constraints do not cover intercepted host %s; re-run `cage-egress prepare` (restart nixcage-prep@%s) and the agent", p, st.rt.Agent)
		}
	}
	return nil
}

// Runtime returns the configuration in force.
func (g *Gateway) Runtime() *policy.Runtime { return g.st.Load().rt }

// addListener records an address the gateway serves on, so it is never an
// upstream.
func (g *Gateway) addListener(a net.Addr) {
	ap, err := netip.ParseAddrPort(a.String())
	if err != nil {
		return
	}
	g.mu.Lock()
	g.listen[netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())] = true
	g.mu.Unlock()
	st := g.st.Load()
	cp := *st
	guard := *st.guard
	guard.Forbidden = g.listenersSnapshot()
	cp.guard = &guard
	g.st.Store(&cp)
}

func (g *Gateway) listenersSnapshot() map[netip.AddrPort]bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	m := make(map[netip.AddrPort]bool, len(g.listen))
	for k := range g.listen {
		m[k] = true
	}
	return m
}

// bound reports whether some secret is bound to host: its real value may be
// injected there, so everything coming back is decoded and redacted.
func (st *state) bound(host string) bool {
	for _, s := range st.secrets {
		if policy.MatchAny(s.Hosts, host) != "" {
			return true
		}
	}
	return false
}

// intercepts reports whether host is TLS-intercepted under st.
func (st *state) intercepts(host string) bool {
	return policy.MatchAny(st.intercept, host) != ""
}

// errRefused is a dial refused by address classification.
type errRefused struct{ err error }

func (e errRefused) Error() string { return e.err.Error() }

// resolve looks host up once and vets every address. Any forbidden address
// refuses the whole name: a mixed answer is how rebinding starts. A ban or
// deny entry covering one of the answer's aliases refuses it too
// (errDecided, bans.go; rule is host's decision, for learn mode's deny
// lists); the aliases are returned for the tunnel to be judged by later
// bans.
func (g *Gateway) resolve(ctx context.Context, st *state, host string, port int, rule string) (netip.AddrPort, []string, error) {
	// The lookup sends host upstream as a DNS query would: the cage's
	// DNS limits on names hold for it too (and its lookup budget, in the
	// Resolver).
	if why, rule, ok := dnsfilter.CheckName(st.pol, host); !ok {
		return netip.AddrPort{}, nil, errDecided{policy.Decision{Result: policy.Deny, Rule: rule, Reason: why}}
	}
	ctx, cancel := context.WithTimeout(ctx, dialTimeout)
	defer cancel()
	addrs, aliases, err := g.lookup(ctx, host)
	if err != nil {
		return netip.AddrPort{}, nil, fmt.Errorf("resolve %s: %w", host, err)
	}
	if d, ok := g.aliasRefused(st, host, aliases, rule); ok {
		return netip.AddrPort{}, nil, errDecided{d}
	}
	if len(addrs) == 0 {
		return netip.AddrPort{}, nil, fmt.Errorf("resolve %s: no addresses", host)
	}
	var pick netip.AddrPort
	for _, a := range addrs {
		ap := netip.AddrPortFrom(a.Unmap(), uint16(port))
		if _, err := st.guard.CheckEndpoint(ap); err != nil {
			return netip.AddrPort{}, nil, errRefused{fmt.Errorf("%s resolves to %w", host, err)}
		}
		if !pick.IsValid() || (!pick.Addr().Is4() && ap.Addr().Is4()) {
			pick = ap
		}
	}
	return pick, aliases, nil
}

// dial connects to a vetted address; the guard checks it again at connect.
func (g *Gateway) dial(ctx context.Context, st *state, dst netip.AddrPort) (net.Conn, error) {
	d := net.Dialer{Timeout: dialTimeout, Control: st.guard.Control, KeepAlive: 30 * time.Second}
	return d.DialContext(ctx, "tcp", dst.String())
}

type dstKey struct{}

// withDst attaches the vetted destination and state to a request context;
// the transports dial only that address.
type dstInfo struct {
	st  *state
	dst netip.AddrPort
}

func (g *Gateway) newTransport(h2 bool) *http.Transport {
	t := &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			di, ok := ctx.Value(dstKey{}).(dstInfo)
			if !ok {
				return nil, errors.New("egress: request without a vetted destination")
			}
			return g.dial(ctx, di.st, di.dst)
		},
		// A copy per transport: the HTTP/2 one adds "h2" to its
		// NextProtos, which must not reach the HTTP/1.1 clients' offers.
		// The session cache is shared.
		TLSClientConfig:        g.upTLS.Clone(),
		TLSHandshakeTimeout:    handshakeTimeout,
		MaxIdleConnsPerHost:    64,
		IdleConnTimeout:        90 * time.Second,
		ResponseHeaderTimeout:  5 * time.Minute,
		MaxResponseHeaderBytes: maxUpstreamHeader,
		DisableCompression:     true,
		// Proxy stays nil: the gateway never chains to another proxy,
		// whatever HTTP_PROXY says in its own environment.
	}
	if h2 {
		t.ForceAttemptHTTP2 = true
		t.HTTP2 = upstreamH2
	} else {
		t.TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{}
	}
	return t
}

func hostPort(host string, port int) string { return net.JoinHostPort(host, strconv.Itoa(port)) }
