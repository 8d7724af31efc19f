package egress

import (
	"bufio"
	"context"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/coreos/go-systemd/v22/activation"
	"github.com/coreos/go-systemd/v22/daemon"
	"github.com/miekg/dns"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/egress/ca"
	"github.com/nixcage/nixcage/internal/egress/dnsfilter"
	"github.com/nixcage/nixcage/internal/egress/prepare"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/policy"
	"github.com/nixcage/nixcage/internal/procs"
	"github.com/nixcage/nixcage/internal/stdio"
	"github.com/nixcage/nixcage/internal/version"
)

// Stdio is the program's view of the terminal.
type Stdio = stdio.Stdio

// Socket-activation fd names (FileDescriptorName= in the socket units).
const (
	FDProxy = paths.FDProxy
	FDDNS   = paths.FDDNS
)

const usage = `usage:
  cage-egress --config FILE [--listen-proxy ADDR] [--listen-dns ADDR] [--resolver ADDR] [--upstream-ca FILE]
  cage-egress prepare --config FILE

Listeners come from socket activation (fd names "proxy" and "dns") or from
the --listen-* flags. Secrets are read from $CREDENTIALS_DIRECTORY.`

// Run is cage-egress.
func Run(ctx context.Context, args []string, stdio Stdio) error {
	return run(ctx, args, stdio, false)
}

// Main is Run for the cage-egress process itself: serving, it also
// governs the process's GOMAXPROCS (one P while its CPU work is serial,
// internal/procs). Run leaves GOMAXPROCS alone, so tests that run many
// gateways in one process keep theirs.
func Main(ctx context.Context, args []string, stdio Stdio) error {
	return run(ctx, args, stdio, true)
}

func run(ctx context.Context, args []string, stdio Stdio, governProcs bool) error {
	if len(args) == 1 && (args[0] == "--version" || args[0] == "version") {
		fmt.Fprintln(stdio.Out, "cage-egress", version.Version)
		return nil
	}
	if len(args) > 0 && args[0] == "prepare" {
		return runPrepare(args[1:], stdio)
	}
	return runServe(ctx, args, stdio, governProcs)
}

func newFlags(name string, stdio Stdio) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stdio.Err)
	fs.Usage = func() { fmt.Fprintln(stdio.Err, usage) }
	return fs
}

func runPrepare(args []string, stdio Stdio) error {
	fs := newFlags("prepare", stdio)
	config := fs.String("config", "", "egress runtime document (JSON)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *config == "" || fs.NArg() > 0 {
		return fmt.Errorf("prepare: want --config FILE and no arguments")
	}
	rt, err := policy.Load(*config)
	if err != nil {
		return err
	}
	res, err := prepare.Prepare(rt, os.Getenv("CREDENTIALS_DIRECTORY"))
	if err != nil {
		return err
	}
	ca := "kept"
	if res.CACreated {
		ca = "created"
	}
	fmt.Fprintf(stdio.Out, "prepared agent %s: CA %s in %s; placeholders for %d secrets\n", rt.Agent, ca, rt.CADir, len(res.Placeholders))
	if !res.LearnUntil.IsZero() {
		fmt.Fprintf(stdio.Out, "LEARN MODE for agent %s until %s: requests outside the policy will be allowed and flagged\n", rt.Agent, res.LearnUntil.UTC().Format(time.RFC3339))
	}
	return nil
}

type serveFlags struct {
	config, listenProxy, listenDNS, resolver, upstreamCA, logLevel string
	unsafeBenchIPLiterals                                          bool
}

func runServe(ctx context.Context, args []string, stdio Stdio, governProcs bool) error {
	fs := newFlags("cage-egress", stdio)
	var f serveFlags
	fs.StringVar(&f.config, "config", "", "egress runtime document (JSON)")
	fs.StringVar(&f.listenProxy, "listen-proxy", "", "proxy listen address when not socket-activated")
	fs.StringVar(&f.listenDNS, "listen-dns", "", "DNS listen address (UDP and TCP) when not socket-activated")
	fs.StringVar(&f.resolver, "resolver", "", "upstream DNS server host:port (default: first nameserver in /etc/resolv.conf)")
	fs.StringVar(&f.upstreamCA, "upstream-ca", "", "PEM file of extra roots trusted for intercepted upstreams")
	fs.StringVar(&f.logLevel, "log-level", "info", "debug, info, warn or error")
	fs.BoolVar(&f.unsafeBenchIPLiterals, "unsafe-bench-ip-literals", false, "bench only: admit CONNECT to an IP literal, deciding on its TLS SNI (refused under systemd)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if err := checkBenchSwitch(f.unsafeBenchIPLiterals); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected argument %q\n%s", fs.Arg(0), usage)
	}
	if f.config == "" {
		return fmt.Errorf("missing --config FILE\n%s", usage)
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(f.logLevel)); err != nil {
		return fmt.Errorf("--log-level: %w", err)
	}
	log := slog.New(slog.NewTextHandler(stdio.Err, &slog.HandlerOptions{Level: level}))

	// Everything that can be wrong with the configuration is checked before
	// a single listener is served: fail closed.
	rt, err := policy.Load(f.config)
	if err != nil {
		return err
	}
	credDir := os.Getenv("CREDENTIALS_DIRECTORY")
	authority, err := loadCA(rt, credDir)
	if err != nil {
		return err
	}
	resolverAddr := f.resolver
	if resolverAddr == "" {
		if resolverAddr, err = systemResolver("/etc/resolv.conf"); err != nil {
			return err
		}
	} else if _, _, err := net.SplitHostPort(resolverAddr); err != nil {
		return fmt.Errorf("--resolver %q: want host:port, e.g. 127.0.0.53:53", resolverAddr)
	}
	var roots *x509.CertPool
	if f.upstreamCA != "" {
		roots, err = x509.SystemCertPool()
		if err != nil {
			roots = x509.NewCertPool()
		}
		pem, err := os.ReadFile(f.upstreamCA)
		if err != nil {
			return fmt.Errorf("--upstream-ca: %w", err)
		}
		if !roots.AppendCertsFromPEM(pem) {
			return fmt.Errorf("--upstream-ca %s: no PEM certificates", f.upstreamCA)
		}
	}
	al, err := audit.Open(rt.Agent, rt.AuditFile, audit.UnderSystemd())
	if err != nil {
		return err
	}
	defer al.Close()
	// One lookup budget for the cage: the names its DNS queries ask for
	// and the names its CONNECT and plain HTTP requests have the gateway
	// look up reach the upstream resolver alike.
	lookups := dnsfilter.NewLookups()
	var gov *procs.Governor
	if governProcs {
		gov = procs.New(log)
	}
	g, err := New(rt, Options{
		CredentialsDir: credDir,
		Resolver:       &dnsfilter.Resolver{Server: resolverAddr, Lookups: lookups},
		UpstreamRoots:  roots,
		Audit:          al,
		CA:             authority,
		Log:            log,

		UnsafeBenchIPLiterals: f.unsafeBenchIPLiterals,
		Procs:                 gov,
	})
	if err != nil {
		return err
	}
	if rt.GrantsFile != "" {
		// The grants file named at start is watched for the gateway's life.
		gctx, stopGrants := context.WithCancel(ctx)
		defer stopGrants()
		go g.watchGrants(gctx, rt.GrantsFile)
	}
	if rt.BansFile != "" {
		bctx, stopBans := context.WithCancel(ctx)
		defer stopBans()
		go g.watchBans(bctx, rt.BansFile)
	}
	// Learn mode's window was stamped by the prepare step; it is read
	// once and announced before anything is served.
	if l := g.loadLearning(rt); l != nil {
		g.SetLearning(l)
		lctx, stopLearn := context.WithCancel(ctx)
		defer stopLearn()
		go g.runLearning(lctx, l)
	} else if rt.Learn != nil {
		g.logAudit(audit.Record{Event: audit.EventLearn, Decision: audit.Blocked, Rule: policy.RuleLearn,
			Reason: "learn mode is configured but its window could not be read (see the gateway's log); the policy applies"})
	}
	if g.approvals != nil {
		g.approvals.clearStale()
	}
	ls, err := listeners(f)
	if err != nil {
		return err
	}
	defer ls.close()
	if len(ls.proxy) == 0 {
		return fmt.Errorf("no proxy listener: pass --listen-proxy ADDR or run socket-activated with FileDescriptorName=%s", FDProxy)
	}
	for _, l := range ls.proxy {
		g.addListener(l.Addr())
	}
	// SIGHUP is caught before anything is served (and announced): a reload
	// request must never kill the gateway.
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	errc := make(chan error, len(ls.proxy)+len(ls.dnsTCP)+len(ls.dnsUDP))
	var servers []*http.Server
	for _, l := range ls.proxy {
		srv := g.NewProxyServer()
		servers = append(servers, srv)
		go func() { errc <- srv.Serve(g.ProxyListener(l)) }()
	}
	filter := &dnsfilter.Filter{Current: g.dnsConfig, Upstream: resolverAddr, Audit: al, Lookups: lookups}
	var dnsServers []*dns.Server
	for _, l := range ls.dnsTCP {
		s := &dns.Server{Listener: l, Handler: filter, Net: "tcp"}
		dnsServers = append(dnsServers, s)
		go func() { errc <- s.ActivateAndServe() }()
	}
	for _, pc := range ls.dnsUDP {
		s := &dns.Server{PacketConn: pc, Handler: filter, Net: "udp"}
		dnsServers = append(dnsServers, s)
		go func() { errc <- s.ActivateAndServe() }()
	}
	if f.unsafeBenchIPLiterals {
		log.Warn("--unsafe-bench-ip-literals: CONNECT to IP literals admitted, decided on the TLS SNI (bench only)")
	}
	log.Info("cage-egress serving", "agent", rt.Agent, "proxy", addrs(ls.proxy), "dns", addrs(ls.dnsTCP), "dns_udp", len(ls.dnsUDP), "resolver", resolverAddr)
	_, _ = daemon.SdNotify(false, daemon.SdNotifyReady)

	for {
		select {
		case <-ctx.Done():
			_, _ = daemon.SdNotify(false, daemon.SdNotifyStopping)
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			for _, s := range servers {
				_ = s.Shutdown(sctx)
			}
			for _, s := range dnsServers {
				_ = s.ShutdownContext(sctx)
			}
			cancel()
			return nil
		case <-hup:
			_, _ = daemon.SdNotify(false, daemon.SdNotifyReloading)
			if err := reload(g, f.config); err != nil {
				log.Error("reload refused; previous configuration stays in force", "err", err)
			} else {
				log.Info("configuration reloaded", "config", f.config)
			}
			_, _ = daemon.SdNotify(false, daemon.SdNotifyReady)
		case err := <-errc:
			if err != nil && !errors.Is(err, http.ErrServerClosed) {
				return fmt.Errorf("listener failed: %w", err)
			}
		}
	}
}

// checkBenchSwitch refuses --unsafe-bench-ip-literals where a cage's
// gateway runs: under systemd or socket-activated. The rendered units never
// pass it; this makes a hand-edited ExecStart= fail to start, not weaken
// the cage.
func checkBenchSwitch(on bool) error {
	if !on {
		return nil
	}
	if audit.UnderSystemd() || os.Getenv("LISTEN_FDS") != "" {
		return errors.New("--unsafe-bench-ip-literals is for bench/egress/run.sh only and is refused under systemd or socket activation; remove it from the command line")
	}
	return nil
}

func reload(g *Gateway, path string) error {
	rt, err := policy.Load(path)
	if err != nil {
		return err
	}
	return g.Reload(rt)
}

func (g *Gateway) dnsConfig() dnsfilter.Config {
	st := g.st.Load()
	return dnsfilter.Config{Policy: st.pol, Guard: st.guard, Grants: *g.grants.Load(), Learning: g.learn.Load(), Bans: g.Bans()}
}

// loadCA finds the CA key: the LoadCredential= copy first, then CADir. With
// no CADir the gateway keeps its own CA in $STATE_DIRECTORY, created on
// first start (standalone use).
func loadCA(rt *policy.Runtime, credDir string) (*ca.Authority, error) {
	dir := rt.CADir
	if dir == "" {
		state := os.Getenv("STATE_DIRECTORY")
		if state == "" {
			if len(prepare.InterceptHosts(rt)) > 0 {
				return nil, fmt.Errorf("egress config has no ca_dir and $STATE_DIRECTORY is unset: set ca_dir or run with StateDirectory=")
			}
			return nil, nil
		}
		dir = strings.Split(state, ":")[0]
		if _, err := ca.Ensure(dir, "nixcage "+rt.Agent+" egress CA", ca.Constraints(prepare.InterceptHosts(rt))); err != nil {
			return nil, err
		}
	}
	key := filepath.Join(dir, ca.KeyFile)
	if credDir != "" {
		if _, err := os.Stat(filepath.Join(credDir, ca.KeyFile)); err == nil {
			key = filepath.Join(credDir, ca.KeyFile)
		}
	}
	a, err := ca.Load(key, filepath.Join(dir, ca.CertFile))
	if err != nil {
		if errors.Is(err, os.ErrNotExist) && len(prepare.InterceptHosts(rt)) == 0 {
			return nil, nil
		}
		return nil, fmt.Errorf("%w (run `cage-egress prepare --config FILE` first)", err)
	}
	return a, nil
}

// systemResolver returns the first nameserver in resolv.conf.
func systemResolver(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", fmt.Errorf("find upstream resolver: %w; pass --resolver ADDR", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 2 && fields[0] == "nameserver" {
			return net.JoinHostPort(fields[1], "53"), nil
		}
	}
	return "", fmt.Errorf("no nameserver in %s; pass --resolver ADDR", path)
}

type listenerSet struct {
	proxy  []net.Listener
	dnsTCP []net.Listener
	dnsUDP []net.PacketConn
}

func (s *listenerSet) close() {
	for _, l := range s.proxy {
		l.Close()
	}
	for _, l := range s.dnsTCP {
		l.Close()
	}
	for _, p := range s.dnsUDP {
		p.Close()
	}
}

func addrs(ls []net.Listener) string {
	var out []string
	for _, l := range ls {
		out = append(out, l.Addr().String())
	}
	return strings.Join(out, ",")
}

// listeners collects socket-activated fds by name, then flag listeners.
func listeners(f serveFlags) (*listenerSet, error) {
	s := &listenerSet{}
	for _, file := range activation.Files(true) {
		name := file.Name()
		typ, err := syscall.GetsockoptInt(int(file.Fd()), syscall.SOL_SOCKET, syscall.SO_TYPE)
		if err != nil {
			s.close()
			return nil, fmt.Errorf("activated fd %s: not a socket: %w", name, err)
		}
		switch {
		case name == FDProxy && typ == syscall.SOCK_STREAM:
			l, err := net.FileListener(file)
			if err != nil {
				s.close()
				return nil, fmt.Errorf("activated fd %s: %w", name, err)
			}
			s.proxy = append(s.proxy, l)
		case name == FDDNS && typ == syscall.SOCK_STREAM:
			l, err := net.FileListener(file)
			if err != nil {
				s.close()
				return nil, fmt.Errorf("activated fd %s: %w", name, err)
			}
			s.dnsTCP = append(s.dnsTCP, l)
		case name == FDDNS && typ == syscall.SOCK_DGRAM:
			pc, err := net.FilePacketConn(file)
			if err != nil {
				s.close()
				return nil, fmt.Errorf("activated fd %s: %w", name, err)
			}
			s.dnsUDP = append(s.dnsUDP, pc)
		default:
			s.close()
			return nil, fmt.Errorf("activated fd %q (socket type %d) is unexpected; name sockets FileDescriptorName=%s (stream) or %s (stream and datagram)", name, typ, FDProxy, FDDNS)
		}
		file.Close()
	}
	if f.listenProxy != "" {
		l, err := net.Listen("tcp", f.listenProxy)
		if err != nil {
			s.close()
			return nil, fmt.Errorf("--listen-proxy: %w", err)
		}
		s.proxy = append(s.proxy, l)
	}
	if f.listenDNS != "" {
		l, pc, err := listenBoth(f.listenDNS)
		if err != nil {
			s.close()
			return nil, fmt.Errorf("--listen-dns: %w", err)
		}
		s.dnsTCP = append(s.dnsTCP, l)
		s.dnsUDP = append(s.dnsUDP, pc)
	}
	return s, nil
}

// listenBoth listens on TCP and UDP at the same address. With port 0 it
// retries until one port is free for both protocols.
func listenBoth(addr string) (net.Listener, net.PacketConn, error) {
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, nil, err
	}
	for range 50 {
		l, err := net.Listen("tcp", addr)
		if err != nil {
			return nil, nil, err
		}
		pc, err := net.ListenPacket("udp", l.Addr().String())
		if err == nil {
			return l, pc, nil
		}
		l.Close()
		if port != "0" {
			return nil, nil, err
		}
	}
	return nil, nil, fmt.Errorf("no port free for both tcp and udp at %s", addr)
}
