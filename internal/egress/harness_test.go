package egress

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/egress/ca"
	"github.com/nixcage/nixcage/internal/policy"
	"github.com/nixcage/nixcage/internal/testenv"
)

// Real values of the test secrets. Shaped like provider keys so the
// secret_patterns inspector would match them (and their placeholders).
const (
	realAnthropic = "sk-ant-api03-REALrealREAL0123456789abcdefghijABCDEFGHIJ-xyzXYZ0123456789"
	realGitHub    = "ghp_REALgithubTOKEN0123456789abcdefghijklmn"
)

// fakeDNS is the upstream resolver: a real miekg/dns server on loopback.
// Each name maps to a list of answer sets; query n for a type gets set
// min(n, last), which is how rebinding is staged.
type fakeDNS struct {
	addr    string
	mu      sync.Mutex
	records map[string][][]string // "name TYPE" -> answer sets of RR text
	count   map[string]int
	msgs    []*dns.Msg // every query received, as received
	ttl     int        // TTL of the answers set() registers
}

func startFakeDNS(t testing.TB) *fakeDNS {
	t.Helper()
	f := &fakeDNS{records: map[string][][]string{}, count: map[string]int{}}
	l, pc, err := listenBoth("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f.addr = pc.LocalAddr().String()
	us := &dns.Server{PacketConn: pc, Handler: f}
	ts := &dns.Server{Listener: l, Handler: f}
	go us.ActivateAndServe()
	go ts.ActivateAndServe()
	t.Cleanup(func() { us.Shutdown(); ts.Shutdown() })
	return f
}

// set registers answer sets for name and type, e.g. set("a.example.com", "A", "127.0.0.1").
func (f *fakeDNS) set(name, typ string, sets ...string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	k := dns.Fqdn(name) + " " + typ
	f.records[k] = nil
	for _, s := range sets {
		var rrs []string
		for _, v := range strings.Split(s, ",") {
			rrs = append(rrs, fmt.Sprintf("%s %d IN %s %s", dns.Fqdn(name), f.ttl, typ, v))
		}
		f.records[k] = append(f.records[k], rrs)
	}
}

func (f *fakeDNS) queries(name, typ string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.count[dns.Fqdn(name)+" "+typ]
}

func (f *fakeDNS) ServeDNS(w dns.ResponseWriter, r *dns.Msg) {
	m := new(dns.Msg)
	m.SetReply(r)
	q := r.Question[0]
	k := strings.ToLower(q.Name) + " " + dns.TypeToString[q.Qtype]
	f.mu.Lock()
	f.msgs = append(f.msgs, r.Copy())
	n := f.count[k]
	f.count[k]++
	known := false
	for key := range f.records {
		if strings.HasPrefix(key, strings.ToLower(q.Name)+" ") {
			known = true
		}
	}
	if sets := f.records[k]; len(sets) > 0 {
		for _, s := range sets[min(n, len(sets)-1)] {
			rr, err := dns.NewRR(s)
			if err == nil {
				m.Answer = append(m.Answer, rr)
			}
		}
	} else if !known {
		m.Rcode = dns.RcodeNameError
	}
	f.mu.Unlock()
	_ = w.WriteMsg(m)
}

// upstream is a fake internet server on loopback that echoes what it got.
type upstream struct {
	tlsAddr, httpAddr string
	tlsPort, httpPort int
	roots             *x509.CertPool
	rootsFile         string
	mu                sync.Mutex
	last              *seen
	release           chan struct{} // ends a /sse stream
}

type seen struct {
	Proto  string
	Host   string
	Header http.Header
	Body   string
	Path   string
}

func (u *upstream) lastSeen() *seen {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.last
}

func (u *upstream) handler(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/ws" {
		u.websocket(w, r)
		return
	}
	if strings.HasPrefix(r.URL.Path, "/echo/") {
		u.echo(w, r)
		return
	}
	if strings.HasPrefix(r.URL.Path, "/hdrecho/") {
		u.headerEcho(w, r)
		return
	}
	switch r.URL.Path {
	case "/ranged": // the key echoed in a body served with Range support
		u.mu.Lock()
		u.last = &seen{Proto: r.Proto, Host: r.Host, Header: r.Header.Clone(), Path: r.URL.Path}
		u.mu.Unlock()
		http.ServeContent(w, r, "", time.Time{}, strings.NewReader("your key: "+r.Header.Get("X-Api-Key")+"\n"))
		return
	case "/sink": // counts a request body without holding it
		n, _ := io.Copy(io.Discard, r.Body)
		fmt.Fprintf(w, "%d\n", n)
		return
	case "/stream": // n bytes of text, written 32 KiB at a time
		n, _ := strconv.Atoi(r.URL.Query().Get("n"))
		chunk := []byte(strings.Repeat("0123456789abcdef ", 2048)[:32<<10])
		for n > 0 {
			k := min(n, len(chunk))
			w.Write(chunk[:k])
			n -= k
		}
		return
	case "/reflect": // X-Reflect back, the first write ending right after it
		w.Header().Set("Content-Type", "text/plain")
		fmt.Fprintf(w, "%sreflected: %s", r.Header.Get("X-Pad"), r.Header.Get("X-Reflect"))
		http.NewResponseController(w).Flush()
		time.Sleep(100 * time.Millisecond) // so the gateway reads the two writes apart
		fmt.Fprint(w, "\nend of response\n")
		return
	}
	if r.URL.Path == "/sse" {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprintf(w, "data: one %s\n\n", r.Header.Get("X-Api-Key"))
		// A keep-alive comment, as model APIs send between events: the
		// gateway holds back a fixed window of bytes (redact.Reader), so
		// an event reaches the agent once that much more has arrived.
		fmt.Fprintf(w, ":%s\n\n", strings.Repeat(" ", 1024))
		http.NewResponseController(w).Flush()
		select {
		case <-u.release:
		case <-time.After(20 * time.Second):
		}
		fmt.Fprint(w, "data: two\n\n")
		return
	}
	b, _ := io.ReadAll(r.Body)
	s := &seen{Proto: r.Proto, Host: r.Host, Header: r.Header.Clone(), Body: string(b), Path: r.URL.Path}
	u.mu.Lock()
	u.last = s
	u.mu.Unlock()
	// Echo credentials back, as some APIs do in errors: the gateway must
	// redact them.
	if k := r.Header.Get("X-Api-Key"); k != "" {
		w.Header().Set("X-Echo-Key", k)
	}
	w.Header().Set("Content-Type", "text/plain")
	fmt.Fprintf(w, "proto=%s host=%s\n", r.Proto, r.Host)
	keys := make([]string, 0, len(r.Header))
	for k := range r.Header {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(w, "%s: %s\n", k, strings.Join(r.Header[k], ","))
	}
	if r.URL.Path == "/big" {
		n, _ := strconv.Atoi(r.URL.Query().Get("n"))
		w.Write(make([]byte, n))
	}
}

func startUpstream(t testing.TB, dir string) *upstream {
	t.Helper()
	u := &upstream{release: make(chan struct{})}
	caDir := filepath.Join(dir, "upstream-ca")
	if _, err := ca.Ensure(caDir, "test upstream CA", []string{"example.com", "example.net"}); err != nil {
		t.Fatal(err)
	}
	a, err := ca.Load(filepath.Join(caDir, ca.KeyFile), filepath.Join(caDir, ca.CertFile))
	if err != nil {
		t.Fatal(err)
	}
	u.roots = x509.NewCertPool()
	u.roots.AddCert(a.Cert)
	u.rootsFile = filepath.Join(caDir, ca.CertFile)

	tl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var p http.Protocols
	p.SetHTTP1(true)
	p.SetHTTP2(true)
	tsrv := &http.Server{Handler: http.HandlerFunc(u.handler), Protocols: &p, ErrorLog: log.New(io.Discard, "", 0), TLSConfig: &tls.Config{
		GetCertificate: func(h *tls.ClientHelloInfo) (*tls.Certificate, error) { return a.Leaf(h.ServerName) },
	}}
	go tsrv.ServeTLS(tl, "", "")
	hl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hsrv := &http.Server{Handler: http.HandlerFunc(u.handler)}
	go hsrv.Serve(hl)
	t.Cleanup(func() { tsrv.Close(); hsrv.Close() })
	u.tlsAddr, u.httpAddr = tl.Addr().String(), hl.Addr().String()
	u.tlsPort, u.httpPort = tl.Addr().(*net.TCPAddr).Port, hl.Addr().(*net.TCPAddr).Port
	return u
}

// harness is one running cage-egress (egress.Run, in-process) with a fake
// resolver and upstreams on loopback.
type harness struct {
	t         testing.TB
	dir       string
	rt        *policy.Runtime
	cfgPath   string
	dns       *fakeDNS
	up        *upstream
	proxyAddr string
	dnsAddr   string
	cagePool  *x509.CertPool
	ph        map[string]string // secret name -> placeholder
	stop      func()
	args      []string // extra cage-egress flags for start
	cageNetns string   // the network namespace startCage made, if any
	logMu     sync.Mutex
	logBuf    strings.Builder
}

// logged reports whether the gateway's log has a line containing s.
func (h *harness) logged(s string) bool {
	h.logMu.Lock()
	defer h.logMu.Unlock()
	return strings.Contains(h.logBuf.String(), s)
}

// panicked returns the panic a crashed gateway left in its log (its first
// 3000 bytes), or "".
func (h *harness) panicked() string {
	h.logMu.Lock()
	defer h.logMu.Unlock()
	log := h.logBuf.String()
	if i := strings.Index(log, "panic:"); i >= 0 {
		return log[i:min(len(log), i+3000)]
	}
	return ""
}

// readLog collects the gateway's log lines and returns the serving line.
func (h *harness) readLog(r io.Reader) string {
	sc := bufio.NewScanner(r)
	serving := ""
	for sc.Scan() {
		h.logMu.Lock()
		h.logBuf.WriteString(sc.Text() + "\n")
		h.logMu.Unlock()
		if servingRe.MatchString(sc.Text()) {
			serving = sc.Text()
			break
		}
	}
	go func() {
		for sc.Scan() {
			h.logMu.Lock()
			h.logBuf.WriteString(sc.Text() + "\n")
			h.logMu.Unlock()
		}
	}()
	return serving
}

// testRuntime is the policy most tests use.
func testRuntime(dir string, u *upstream) *policy.Runtime {
	return &policy.Runtime{
		Schema: policy.Schema,
		Agent:  "alice",
		Policy: policy.Policy{
			Name:    "test",
			Allow:   []string{"*.example.com", "example.net"},
			Deny:    []string{"denied.example.com"},
			Ports:   []int{u.tlsPort, u.httpPort},
			Inspect: []string{"api.example.com", "other.example.com"},
			// The config model's default (config.DefaultWebSocket).
			WebSocket: true,
			Inspectors: []policy.Inspector{
				{Name: policy.InspectRealValues, Action: policy.ActionBlock},
				{Name: policy.InspectSecretPatterns, Action: policy.ActionBlock},
				{Name: policy.InspectBodySize, Action: policy.ActionFlag, MaxBytes: 64 << 10},
				{Name: policy.InspectEntropy, Action: policy.ActionFlag},
				{Name: policy.InspectEncodedBlobs, Action: policy.ActionFlag, MinLength: 512},
			},
			Limits: policy.Limits{MaxTunnels: 64, MaxHeaderBytes: 16 << 10, MaxBodyBytes: 1 << 20, IdleTimeoutSeconds: 30},
			DNS:    policy.DNS{Enabled: true, DenyTypes: []string{"ANY", "AXFR"}, MaxLabelLength: 40},

			UnsafeAllowLoopbackUpstreams: true,
		},
		Secrets: []policy.Secret{
			{Name: "anthropic", Env: "ANTHROPIC_API_KEY", Hosts: []string{"api.example.com"}, Header: "x-api-key"},
			{Name: "github", Env: "GITHUB_TOKEN", Hosts: []string{"api.example.com"}, Header: "Authorization"},
		},
		AuditFile:       filepath.Join(dir, "audit.jsonl"),
		PlaceholderFile: filepath.Join(dir, "run", "placeholders.json"),
		AgentEnvFile:    filepath.Join(dir, "run", "agent.env"),
		ResolvConf:      filepath.Join(dir, "run", "resolv.conf"),
		CADir:           filepath.Join(dir, "ca"),
	}
}

// newHarness starts fakes, prepares and runs the gateway. mutate may change
// the runtime document before it is written.
func newHarness(t testing.TB, mutate func(*policy.Runtime)) *harness {
	t.Helper()
	h := setupHarness(t, mutate)
	h.start()
	return h
}

// setupHarness starts the fakes and runs prepare, without a gateway.
func setupHarness(t testing.TB, mutate func(*policy.Runtime)) *harness {
	t.Helper()
	dir := t.TempDir()
	h := &harness{t: t, dir: dir, dns: startFakeDNS(t), up: startUpstream(t, dir)}
	for _, n := range []string{"api", "plain", "other", "denied", "loop", "slow"} {
		h.dns.set(n+".example.com", "A", "127.0.0.1")
	}
	h.dns.set("example.net", "A", "127.0.0.1")
	h.dns.set("example.net", "TXT", `"v=spf1 -all"`)
	h.dns.set("example.net", "MX", "10 mail.example.net.")
	h.dns.set("example.net", "AAAA", "2001:db8::1")
	h.dns.set("private.example.com", "A", "10.1.2.3")
	h.dns.set("cgnat.example.com", "A", "100.64.1.1")
	h.dns.set("linklocal.example.com", "A", "169.254.10.10")
	h.dns.set("metadata.example.com", "A", "169.254.169.254")
	h.dns.set("mapped.example.com", "AAAA", "::ffff:10.0.0.1")
	h.dns.set("nat64.example.com", "AAAA", "64:ff9b::a00:1")
	h.dns.set("sixtofour.example.com", "AAAA", "2002:a00:1::1")
	h.dns.set("ula.example.com", "AAAA", "fd12:3456::1")
	h.dns.set("mixed.example.com", "A", "127.0.0.1,10.9.9.9")
	h.dns.set("rebind.example.com", "A", "127.0.0.1", "10.0.0.5")

	credDir := filepath.Join(dir, "creds")
	os.MkdirAll(credDir, 0o700)
	os.WriteFile(filepath.Join(credDir, "anthropic"), []byte(realAnthropic+"\n"), 0o600)
	os.WriteFile(filepath.Join(credDir, "github"), []byte(realGitHub), 0o600)
	t.Setenv("CREDENTIALS_DIRECTORY", credDir)

	h.rt = testRuntime(dir, h.up)
	if mutate != nil {
		mutate(h.rt)
	}
	h.cfgPath = filepath.Join(dir, "egress.json")
	h.writeConfig(h.rt)
	if err := Run(context.Background(), []string{"prepare", "--config", h.cfgPath}, Stdio{Out: io.Discard, Err: io.Discard}); err != nil {
		t.Fatalf("prepare: %v", err)
	}
	pf, err := os.ReadFile(h.rt.PlaceholderFile)
	if err != nil {
		t.Fatal(err)
	}
	var f struct {
		Secrets map[string]struct{ Placeholder string }
	}
	json.Unmarshal(pf, &f)
	h.ph = map[string]string{}
	for k, v := range f.Secrets {
		h.ph[k] = v.Placeholder
	}
	pem, err := os.ReadFile(filepath.Join(h.rt.CADir, ca.CertFile))
	if err != nil {
		t.Fatal(err)
	}
	h.cagePool = x509.NewCertPool()
	h.cagePool.AppendCertsFromPEM(pem)
	return h
}

func (h *harness) writeConfig(rt *policy.Runtime) {
	b, err := rt.Marshal()
	if err != nil {
		h.t.Fatal(err)
	}
	if err := os.WriteFile(h.cfgPath, b, 0o644); err != nil {
		h.t.Fatal(err)
	}
}

var servingRe = regexp.MustCompile(`proxy=(\S+) dns=(\S+)`)

func (h *harness) start() {
	t := h.t
	ctx, cancel := context.WithCancel(context.Background())
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, append([]string{"--config", h.cfgPath, "--listen-proxy", "127.0.0.1:0", "--listen-dns", "127.0.0.1:0",
			"--resolver", h.dns.addr, "--upstream-ca", h.up.rootsFile}, h.args...), Stdio{Out: io.Discard, Err: pw})
		pw.Close()
	}()
	if m := servingRe.FindStringSubmatch(h.readLog(pr)); m != nil {
		h.proxyAddr, h.dnsAddr = m[1], m[2]
	} else {
		cancel()
		t.Fatalf("gateway did not start: %v", <-done)
	}
	// Idempotent: a test may stop and restart the gateway itself.
	var once sync.Once
	h.stop = func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(h.stop)
}

// client is a Go client using the gateway as its proxy for http and https.
func (h *harness) client(h2 bool) *http.Client {
	pu, _ := url.Parse("http://" + h.proxyAddr)
	tr := &http.Transport{
		Proxy:             http.ProxyURL(pu),
		TLSClientConfig:   &tls.Config{RootCAs: h.cagePool},
		ForceAttemptHTTP2: h2,
		DisableKeepAlives: !h2,
	}
	if !h2 {
		tr.TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{}
	}
	h.t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 20 * time.Second}
}

func (h *harness) tlsURL(host, path string) string {
	return "https://" + net.JoinHostPort(host, strconv.Itoa(h.up.tlsPort)) + path
}

func (h *harness) httpURL(host, path string) string {
	return "http://" + net.JoinHostPort(host, strconv.Itoa(h.up.httpPort)) + path
}

// do sends a request through the gateway and returns status and body.
func (h *harness) do(c *http.Client, method, u string, hdr http.Header, body string) (int, http.Header, string, error) {
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, u, rd)
	if err != nil {
		h.t.Fatal(err)
	}
	for k, vs := range hdr {
		req.Header[k] = vs
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, nil, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, string(b), nil
}

// records reads the complete lines of the audit file (a record being
// appended right now may be visible half-written).
func (h *harness) records(t testing.TB) []audit.Record {
	b, err := os.ReadFile(h.rt.AuditFile)
	if err != nil {
		t.Fatal(err)
	}
	if i := strings.LastIndexByte(string(b), '\n'); i >= 0 {
		b = b[:i+1]
	} else {
		b = nil
	}
	var out []audit.Record
	for _, line := range strings.Split(string(b), "\n") {
		if line == "" {
			continue
		}
		var r audit.Record
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatalf("audit line %q: %v", line, err)
		}
		out = append(out, r)
	}
	return out
}

// want finds the audit record matching match (tunnel records are written
// when the tunnel closes, so it polls) and checks its decision and rule.
func (h *harness) want(t testing.TB, match func(audit.Record) bool, decision, rule string) audit.Record {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		recs := h.records(t)
		for i := len(recs) - 1; i >= 0; i-- {
			if r := recs[i]; match(r) {
				if r.Decision != decision || (rule != "" && r.Rule != rule) {
					t.Fatalf("audit record %+v: want decision %s rule %s", r, decision, rule)
				}
				if r.Schema != audit.Schema || r.Agent != "alice" || r.TS == "" {
					t.Fatalf("audit record %+v: missing schema, agent or ts", r)
				}
				return r
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no audit record matched; have:\n%s", h.dump())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (h *harness) dump() string {
	b, _ := os.ReadFile(h.rt.AuditFile)
	return string(b)
}

// is matches records by method, host and optional port.
func is(method, host string, port int) func(audit.Record) bool {
	return func(r audit.Record) bool {
		return r.Method == method && r.Host == host && (port == 0 || r.Port == port)
	}
}

// closed matches a tunnel's close record (its open record came first).
func closed(method, host string, port int) func(audit.Record) bool {
	m := is(method, host, port)
	return func(r audit.Record) bool { return m(r) && r.Event == audit.EventClose }
}

// connect opens a raw CONNECT tunnel and returns the connection after 200,
// or the status code of a refusal.
func (h *harness) connect(authority string, extra string) (net.Conn, int) {
	h.t.Helper()
	c, err := net.Dial("tcp", h.proxyAddr)
	if err != nil {
		h.t.Fatal(err)
	}
	fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n%s\r\n", authority, authority, extra)
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil {
		h.t.Fatalf("CONNECT %s: %v", authority, err)
	}
	if resp.StatusCode != http.StatusOK {
		c.Close()
		return nil, resp.StatusCode
	}
	if br.Buffered() > 0 {
		h.t.Fatalf("bytes after CONNECT response")
	}
	return c, resp.StatusCode
}

func hasAll(list []string, want ...string) bool {
	for _, w := range want {
		if !slices.Contains(list, w) {
			return false
		}
	}
	return true
}

func lookCurl(t *testing.T) string {
	t.Helper()
	return testenv.LookPath(t, "curl")
}

// serveEach runs serve on every connection l accepts, each on its own
// goroutine, until l is closed; the connection is closed after serve.
func serveEach(l net.Listener, serve func(net.Conn)) {
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				serve(c)
			}()
		}
	}()
}
