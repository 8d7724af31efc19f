// Package upstream is the fake internet of a system-test machine: an HTTPS
// and HTTP echo server for every name of a test zone and an authoritative DNS
// server for that zone. It runs inside the machine in a network namespace of
// its own (TEST-NET addresses), so the egress gateway reaches it exactly as it
// would reach the internet: resolve with the system resolver, classify, dial.
//
// Every request and query it receives is appended to a JSONL log, which is
// how tests prove what did, and what did not, leave a cage.
package upstream

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/miekg/dns"
)

// Config is the server's configuration file.
type Config struct {
	HTTPS string `json:"https"` // listen address, e.g. ":443"
	HTTP  string `json:"http"`  // listen address, e.g. ":80"
	DNS   string `json:"dns"`   // listen address (udp and tcp), e.g. "203.0.113.53:53"
	Cert  string `json:"cert"`
	Key   string `json:"key"`
	// Zone maps fully qualified names (with or without the trailing dot) to
	// IPv4 or IPv6 addresses.
	Zone map[string][]string `json:"zone"`
	Log  string              `json:"log"`
	// Ready is created once every listener is up.
	Ready string `json:"ready"`
}

// Record is one log line.
type Record struct {
	TS      time.Time           `json:"ts"`
	Kind    string              `json:"kind"` // https, http, dns
	Host    string              `json:"host,omitempty"`
	SNI     string              `json:"sni,omitempty"`
	Local   string              `json:"local,omitempty"`
	Remote  string              `json:"remote,omitempty"`
	Method  string              `json:"method,omitempty"`
	Path    string              `json:"path,omitempty"`
	Headers map[string][]string `json:"headers,omitempty"`
	Body    string              `json:"body,omitempty"`
	BodyLen int64               `json:"body_len,omitempty"`
	Name    string              `json:"name,omitempty"`  // dns
	QType   string              `json:"qtype,omitempty"` // dns
	Rcode   string              `json:"rcode,omitempty"` // dns
}

// Echo is the body of every HTTP(S) response: what the server saw.
type Echo struct {
	Kind    string              `json:"kind"`
	Host    string              `json:"host"`
	Method  string              `json:"method"`
	Path    string              `json:"path"`
	Headers map[string][]string `json:"headers"`
	BodyLen int64               `json:"body_len"`
}

// Run serves until ctx ends.
func Run(ctx context.Context, args []string, stderr io.Writer) error {
	fs := flag.NewFlagSet("upstream", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfgPath := fs.String("config", "", "configuration file (JSON)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *cfgPath == "" {
		return errors.New("usage: upstream --config FILE")
	}
	data, err := os.ReadFile(*cfgPath)
	if err != nil {
		return fmt.Errorf("read config: %w", err)
	}
	var cfg Config
	if err := json.Unmarshal(data, &cfg); err != nil {
		return fmt.Errorf("parse config: %w", err)
	}
	if err := os.MkdirAll(filepath.Dir(cfg.Log), 0o755); err != nil {
		return fmt.Errorf("create log dir: %w", err)
	}
	logf, err := os.OpenFile(cfg.Log, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return fmt.Errorf("open log: %w", err)
	}
	defer logf.Close()
	s := &server{log: json.NewEncoder(logf), zone: map[string][]net.IP{}}
	for name, addrs := range cfg.Zone {
		fq := dns.Fqdn(strings.ToLower(name))
		for _, a := range addrs {
			ip := net.ParseIP(a)
			if ip == nil {
				return fmt.Errorf("zone %s: bad address %q", name, a)
			}
			s.zone[fq] = append(s.zone[fq], ip)
		}
	}

	errc := make(chan error, 4)
	var closers []func()
	if cfg.HTTPS != "" {
		cert, err := tls.LoadX509KeyPair(cfg.Cert, cfg.Key)
		if err != nil {
			return fmt.Errorf("load certificate: %w", err)
		}
		l, err := tls.Listen("tcp", cfg.HTTPS, &tls.Config{Certificates: []tls.Certificate{cert}})
		if err != nil {
			return fmt.Errorf("listen https: %w", err)
		}
		srv := &http.Server{Handler: s.handler("https"), ReadHeaderTimeout: 10 * time.Second}
		go func() { errc <- srv.Serve(l) }()
		closers = append(closers, func() { srv.Close() })
	}
	if cfg.HTTP != "" {
		l, err := net.Listen("tcp", cfg.HTTP)
		if err != nil {
			return fmt.Errorf("listen http: %w", err)
		}
		srv := &http.Server{Handler: s.handler("http"), ReadHeaderTimeout: 10 * time.Second}
		go func() { errc <- srv.Serve(l) }()
		closers = append(closers, func() { srv.Close() })
	}
	if cfg.DNS != "" {
		for _, netw := range []string{"udp", "tcp"} {
			started := make(chan struct{})
			srv := &dns.Server{Addr: cfg.DNS, Net: netw, Handler: dns.HandlerFunc(s.dns), NotifyStartedFunc: func() { close(started) }}
			go func() { errc <- srv.ListenAndServe() }()
			select {
			case <-started:
			case err := <-errc:
				return fmt.Errorf("listen dns/%s: %w", netw, err)
			}
			closers = append(closers, func() { srv.Shutdown() })
		}
	}
	if cfg.Ready != "" {
		if err := os.WriteFile(cfg.Ready, []byte("ready\n"), 0o644); err != nil {
			return fmt.Errorf("write ready file: %w", err)
		}
	}
	defer func() {
		for _, c := range closers {
			c()
		}
	}()
	select {
	case <-ctx.Done():
		return nil
	case err := <-errc:
		return err
	}
}

type server struct {
	mu   sync.Mutex
	log  *json.Encoder
	zone map[string][]net.IP
}

func (s *server) record(r Record) {
	r.TS = time.Now().UTC()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.log.Encode(r)
}

// handler echoes the request. /status/N answers with status N. The model
// hosts (model.go) answer their API paths as the model would.
func (s *server) handler(kind string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(io.LimitReader(r.Body, 8<<20))
		full := body
		rec := Record{Kind: kind, Host: r.Host, Remote: r.RemoteAddr, Method: r.Method,
			Path: r.URL.RequestURI(), Headers: r.Header, BodyLen: int64(len(body))}
		// Model requests are logged whole (up to 1 MiB): tests look for
		// what a harness sent its model (the cage note, tool results).
		if keep := 4096; modelHandler(r.Host) == nil && len(body) > keep {
			body = body[:keep]
		}
		rec.Body = string(body)
		if r.TLS != nil {
			rec.SNI = r.TLS.ServerName
		}
		if a, ok := r.Context().Value(http.LocalAddrContextKey).(net.Addr); ok {
			rec.Local = a.String()
		}
		s.record(rec)
		if h := modelHandler(r.Host); h != nil && h(w, r, full) {
			return
		}
		status := http.StatusOK
		if v, ok := strings.CutPrefix(r.URL.Path, "/status/"); ok {
			if n, err := strconv.Atoi(v); err == nil && n >= 200 && n < 600 {
				status = n
			}
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		json.NewEncoder(w).Encode(Echo{Kind: kind, Host: r.Host, Method: r.Method, Path: r.URL.RequestURI(), Headers: r.Header, BodyLen: rec.BodyLen})
	})
}

func (s *server) dns(w dns.ResponseWriter, req *dns.Msg) {
	resp := new(dns.Msg)
	resp.SetReply(req)
	resp.Authoritative = true
	for _, q := range req.Question {
		name := strings.ToLower(q.Name)
		ips, ok := s.zone[name]
		if !ok {
			resp.Rcode = dns.RcodeNameError
		}
		for _, ip := range ips {
			switch {
			case q.Qtype == dns.TypeA && ip.To4() != nil:
				resp.Answer = append(resp.Answer, &dns.A{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 30}, A: ip.To4()})
			case q.Qtype == dns.TypeAAAA && ip.To4() == nil:
				resp.Answer = append(resp.Answer, &dns.AAAA{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeAAAA, Class: dns.ClassINET, Ttl: 30}, AAAA: ip})
			}
		}
		s.record(Record{Kind: "dns", Name: q.Name, QType: dns.TypeToString[q.Qtype], Rcode: dns.RcodeToString[resp.Rcode], Remote: w.RemoteAddr().String()})
	}
	w.WriteMsg(resp)
}
