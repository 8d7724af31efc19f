package egress

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/egress/ca"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/policy"
	"github.com/nixcage/nixcage/internal/stdio"
	"github.com/nixcage/nixcage/internal/testenv"
)

const helperEnv = "NIXCAGE_EGRESS_TEST_HELPER"

// TestHelperGateway is not a test: it is the child process of
// TestSocketActivation, running cage-egress with inherited listeners.
func TestHelperGateway(t *testing.T) {
	if os.Getenv(helperEnv) == "" {
		t.Skip("helper process for TestSocketActivation")
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	err := Main(ctx, strings.Split(os.Getenv(helperEnv), "\x1f"), stdio.OS())
	if err != nil {
		fmt.Fprintln(os.Stderr, "helper:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// Socket activation with real inherited fds: the parent binds the sockets,
// a shell sets LISTEN_PID to its own pid and execs the gateway (so the pid
// matches, as under systemd), and the gateway serves on fds 3..5 named by
// LISTEN_FDNAMES.
func TestSocketActivation(t *testing.T) {
	sh := testenv.LookPath(t, "sh")
	h := setupHarness(t, nil)
	pl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dl, du, err := listenBoth("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var files []*os.File
	for _, f := range []interface{ File() (*os.File, error) }{pl.(*net.TCPListener), dl.(*net.TCPListener), du.(*net.UDPConn)} {
		file, err := f.File()
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, file)
	}
	args := strings.Join([]string{"--config", h.cfgPath, "--resolver", h.dns.addr, "--upstream-ca", h.up.rootsFile}, "\x1f")
	cmd := exec.Command(sh, "-c", `LISTEN_PID=$$ exec "$0" "$@"`, os.Args[0], "-test.run=^TestHelperGateway$")
	cmd.Env = append(os.Environ(), helperEnv+"="+args, "LISTEN_FDS=3", "LISTEN_FDNAMES=proxy:dns:dns")
	cmd.ExtraFiles = files
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Signal(syscall.SIGTERM); cmd.Wait() })
	// Only the child serves from now on.
	pl.Close()
	dl.Close()
	du.Close()
	for _, f := range files {
		f.Close()
	}
	line := h.readLog(stderr)
	if !strings.Contains(line, "proxy="+pl.Addr().String()) || !strings.Contains(line, "dns="+dl.Addr().String()) || !strings.Contains(line, "dns_udp=1") {
		t.Fatalf("gateway did not serve the inherited sockets: %q", line)
	}
	h.proxyAddr, h.dnsAddr = pl.Addr().String(), dl.Addr().String()

	code, _, body, err := h.do(h.client(false), "GET", h.tlsURL("api.example.com", "/activated"), nil, "")
	if err != nil || code != 200 || !strings.Contains(body, "host=api.example.com") {
		t.Fatalf("proxy over inherited fd: %d %v", code, err)
	}
	h.want(t, func(r audit.Record) bool { return r.Path == "/activated" }, audit.Allowed, "")
	for _, n := range []string{"udp", "tcp"} {
		m := new(dns.Msg)
		m.SetQuestion("api.example.com.", dns.TypeA)
		resp, _, err := (&dns.Client{Net: n, Timeout: 10 * time.Second}).Exchange(m, h.dnsAddr)
		if err != nil || len(resp.Answer) != 1 {
			t.Fatalf("DNS over inherited %s fd: %v %v", n, resp, err)
		}
	}
	h.want(t, is("DNS", "api.example.com", 53), audit.Allowed, "allow:*.example.com")
}

func TestPrepare(t *testing.T) {
	dir := t.TempDir()
	cred := filepath.Join(dir, "creds")
	os.MkdirAll(cred, 0o700)
	os.WriteFile(filepath.Join(cred, "anthropic"), []byte(realAnthropic+"\n"), 0o600)
	os.WriteFile(filepath.Join(cred, "github"), []byte(realGitHub), 0o600)
	t.Setenv("CREDENTIALS_DIRECTORY", cred)
	rt := testRuntime(dir, &upstream{tlsPort: 8443, httpPort: 8080})
	cfg := filepath.Join(dir, "egress.json")
	write := func() {
		b, _ := rt.Marshal()
		os.WriteFile(cfg, b, 0o644)
	}
	write()
	prepare := func() string {
		var out strings.Builder
		if err := Run(context.Background(), []string{"prepare", "--config", cfg}, Stdio{Out: &out, Err: io.Discard}); err != nil {
			t.Fatalf("prepare: %v", err)
		}
		return out.String()
	}
	if out := prepare(); !strings.Contains(out, "CA created") {
		t.Fatalf("first prepare: %q", out)
	}
	mode := func(p string) os.FileMode {
		st, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		return st.Mode().Perm()
	}
	for p, want := range map[string]os.FileMode{
		filepath.Join(rt.CADir, ca.KeyFile): 0o600, filepath.Join(rt.CADir, ca.CertFile): 0o644,
		rt.PlaceholderFile: 0o644, rt.AgentEnvFile: 0o600, rt.ResolvConf: 0o644,
	} {
		if m := mode(p); m != want {
			t.Errorf("%s: mode %o, want %o", p, m, want)
		}
	}
	a, err := ca.Load(filepath.Join(rt.CADir, ca.KeyFile), filepath.Join(rt.CADir, ca.CertFile))
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(a.Cert.PermittedDNSDomains, []string{"api.example.com", "other.example.com"}) || !a.Cert.PermittedDNSDomainsCritical || len(a.Cert.ExcludedIPRanges) != 2 {
		t.Fatalf("CA constraints: %v %v", a.Cert.PermittedDNSDomains, a.Cert.ExcludedIPRanges)
	}
	if rc, _ := os.ReadFile(rt.ResolvConf); !strings.HasPrefix(string(rc), "nameserver 127.0.0.1\n") {
		t.Fatalf("resolv.conf %q", rc)
	}
	// The bundle trusts real servers (host roots) and the gateway (cage CA).
	bundle, err := os.ReadFile(filepath.Join(rt.CADir, paths.CABundleFile))
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := os.ReadFile(filepath.Join(rt.CADir, ca.CertFile))
	if !strings.HasSuffix(string(bundle), string(cert)) {
		t.Fatal("bundle does not end with the cage CA")
	}
	for _, p := range paths.HostCABundles {
		if roots, err := os.ReadFile(p); err == nil {
			if !strings.HasPrefix(string(bundle), string(roots)) {
				t.Fatalf("bundle does not start with the host roots of %s", p)
			}
			break
		}
	}
	env, _ := os.ReadFile(rt.AgentEnvFile)
	m := regexp.MustCompile(`(?m)^ANTHROPIC_API_KEY=(\S+)\nGITHUB_TOKEN=(\S+)\n$`).FindStringSubmatch(string(env))
	if m == nil {
		t.Fatalf("agent env %q", env)
	}
	if len(m[1]) != len(realAnthropic) || !strings.HasPrefix(m[1], "sk-ant-api03-") || m[1] == realAnthropic ||
		len(m[2]) != len(realGitHub) || !strings.HasPrefix(m[2], "ghp_") || m[2] == realGitHub {
		t.Fatalf("placeholders do not fit: %q %q", m[1], m[2])
	}
	for _, f := range []string{rt.PlaceholderFile, rt.AgentEnvFile, rt.ResolvConf, filepath.Join(rt.CADir, ca.CertFile)} {
		b, _ := os.ReadFile(f)
		if strings.Contains(string(b), "REAL") {
			t.Fatalf("%s contains a real value", f)
		}
	}
	// Idempotent: CA and placeholders survive a re-run.
	crt1, _ := os.ReadFile(filepath.Join(rt.CADir, ca.CertFile))
	if out := prepare(); !strings.Contains(out, "CA kept") {
		t.Fatalf("second prepare: %q", out)
	}
	crt2, _ := os.ReadFile(filepath.Join(rt.CADir, ca.CertFile))
	env2, _ := os.ReadFile(rt.AgentEnvFile)
	if string(crt1) != string(crt2) || string(env) != string(env2) {
		t.Fatal("re-run replaced the CA or the placeholders")
	}
	// A rotated credential of another length gets a new placeholder; a
	// changed inspect list gets a CA that covers it.
	os.WriteFile(filepath.Join(cred, "github"), []byte(realGitHub+"XYZ"), 0o600)
	rt.Policy.Inspect = append(rt.Policy.Inspect, "*.example.net")
	write()
	if out := prepare(); !strings.Contains(out, "CA created") {
		t.Fatalf("prepare after policy change: %q", out)
	}
	env3, _ := os.ReadFile(rt.AgentEnvFile)
	if !strings.Contains(string(env3), strings.Split(string(env), "\n")[0]) || string(env3) == string(env) {
		t.Fatalf("placeholders after rotation: %q", env3)
	}
	// The gateway accepts what prepare wrote.
	al, _ := audit.Open("alice", "", false)
	rt2, err := policy.Load(cfg)
	if err != nil {
		t.Fatal(err)
	}
	// The CA loaded before the policy change no longer covers *.example.net.
	if _, err := New(rt2, Options{CredentialsDir: cred, Audit: al, CA: a}); err == nil || !strings.Contains(err.Error(), "do not cover intercepted host *.example.net") {
		t.Fatalf("gateway with a stale CA: %v", err)
	}
	a2, err := ca.Load(filepath.Join(rt.CADir, ca.KeyFile), filepath.Join(rt.CADir, ca.CertFile))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := New(rt2, Options{CredentialsDir: cred, Audit: al, CA: a2}); err != nil {
		t.Fatalf("gateway refused prepared state: %v", err)
	}
}

// A gateway that cannot trust its configuration does not serve at all.
func TestFailClosedOnBrokenConfig(t *testing.T) {
	h := setupHarness(t, nil)
	good, _ := os.ReadFile(h.cfgPath)
	cases := []struct {
		name, want string
		edit       func(rt *policy.Runtime, raw []byte) []byte
	}{
		{"unknown field", "unknown field", func(_ *policy.Runtime, raw []byte) []byte {
			return []byte(strings.Replace(string(raw), `"schema"`, `"allow_all": true, "schema"`, 1))
		}},
		{"wrong schema", "schema 2", func(_ *policy.Runtime, raw []byte) []byte {
			return []byte(strings.Replace(string(raw), `"schema": 1`, `"schema": 2`, 1))
		}},
		{"truncated document", "parse egress config", func(_ *policy.Runtime, raw []byte) []byte { return raw[:len(raw)/2] }},
		{"bad host pattern", "use lower case", func(rt *policy.Runtime, _ []byte) []byte {
			rt.Policy.Allow = append(rt.Policy.Allow, "*.Example.org")
			return nil
		}},
		{"unknown inspector action", `action "warn"`, func(rt *policy.Runtime, _ []byte) []byte {
			rt.Policy.Inspectors[1].Action = "warn"
			return nil
		}},
		{"unknown inspector", `unknown inspector "magic"`, func(rt *policy.Runtime, _ []byte) []byte {
			rt.Policy.Inspectors = append(rt.Policy.Inspectors, policy.Inspector{Name: "magic", Action: "block"})
			return nil
		}},
		{"negative limit", "must not be negative", func(rt *policy.Runtime, _ []byte) []byte {
			rt.Policy.Limits.MaxTunnels = -1
			return nil
		}},
		{"bad port", "out of range", func(rt *policy.Runtime, _ []byte) []byte {
			rt.Policy.Ports = append(rt.Policy.Ports, 70000)
			return nil
		}},
		{"secret without credential", "secret openai", func(rt *policy.Runtime, _ []byte) []byte {
			rt.Secrets = append(rt.Secrets, policy.Secret{Name: "openai", Env: "OPENAI_API_KEY", Hosts: []string{"api.example.com"}})
			return nil
		}},
		{"placeholders missing", "run `cage-egress prepare` first", func(rt *policy.Runtime, _ []byte) []byte {
			rt.PlaceholderFile = filepath.Join(h.dir, "nowhere.json")
			return nil
		}},
		{"CA does not cover an intercepted host", "do not cover intercepted host new.example.com", func(rt *policy.Runtime, _ []byte) []byte {
			rt.Policy.Inspect = append(rt.Policy.Inspect, "new.example.com") // prepare not re-run
			return nil
		}},
		{"intercept without a CA", "prepare", func(rt *policy.Runtime, _ []byte) []byte {
			rt.CADir = filepath.Join(h.dir, "empty-ca")
			return nil
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rt, err := policy.Parse(good)
			if err != nil {
				t.Fatal(err)
			}
			raw := c.edit(rt, good)
			if raw == nil {
				raw, _ = rt.Marshal()
			}
			cfg := filepath.Join(t.TempDir(), "egress.json")
			os.WriteFile(cfg, raw, 0o644)
			l, _ := net.Listen("tcp", "127.0.0.1:0")
			addr := l.Addr().String()
			l.Close()
			err = Run(context.Background(), []string{"--config", cfg, "--listen-proxy", addr, "--resolver", h.dns.addr}, Stdio{Out: io.Discard, Err: io.Discard})
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("got %v, want an error containing %q", err, c.want)
			}
			if c, err := net.Dial("tcp", addr); err == nil {
				c.Close()
				t.Fatal("proxy port is served despite a broken config")
			}
		})
	}
	t.Run("credential rotated without prepare", func(t *testing.T) {
		os.WriteFile(filepath.Join(os.Getenv("CREDENTIALS_DIRECTORY"), "github"), []byte(realGitHub+"ROTATED"), 0o600)
		defer os.WriteFile(filepath.Join(os.Getenv("CREDENTIALS_DIRECTORY"), "github"), []byte(realGitHub), 0o600)
		err := Run(context.Background(), []string{"--config", h.cfgPath, "--listen-proxy", "127.0.0.1:0", "--resolver", h.dns.addr}, Stdio{Out: io.Discard, Err: io.Discard})
		if err == nil || !strings.Contains(err.Error(), "placeholder does not fit") {
			t.Fatalf("got %v", err)
		}
	})
}

// SIGHUP reloads the policy: new decisions follow it, open tunnels keep
// working, and a broken document leaves the previous policy in force.
func TestReloadKeepsTunnels(t *testing.T) {
	h := newHarness(t, nil)
	port := strconv.Itoa(h.up.tlsPort)
	conn, code := h.connect("plain.example.com:"+port, "")
	if code != 200 {
		t.Fatalf("CONNECT: %d", code)
	}
	defer conn.Close()
	tc := tls.Client(conn, &tls.Config{RootCAs: h.up.roots, ServerName: "plain.example.com"})
	br := bufio.NewReader(tc)
	get := func() error {
		fmt.Fprintf(tc, "GET /in-tunnel HTTP/1.1\r\nHost: plain.example.com\r\n\r\n")
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			return err
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return nil
	}
	if err := get(); err != nil {
		t.Fatal(err)
	}
	rt := *h.rt
	rt.Policy.Deny = append(slices.Clone(rt.Policy.Deny), "plain.example.com")
	h.writeConfig(&rt)
	syscall.Kill(os.Getpid(), syscall.SIGHUP)
	waitFor(t, "reloaded", func() bool { return h.logged("configuration reloaded") })
	if _, code := h.connect("plain.example.com:"+port, ""); code != http.StatusForbidden {
		t.Fatalf("new CONNECT after reload: %d, want 403", code)
	}
	h.want(t, func(r audit.Record) bool { return r.Host == "plain.example.com" && r.Rule == "deny:plain.example.com" }, audit.Blocked, "deny:plain.example.com")
	if err := get(); err != nil {
		t.Fatalf("open tunnel dropped by reload: %v", err)
	}
	os.WriteFile(h.cfgPath, []byte(`{"schema":1,"agent":"alice","policy":{"allow":["*"]}}`), 0o644)
	syscall.Kill(os.Getpid(), syscall.SIGHUP)
	waitFor(t, "refused reload", func() bool { return h.logged("reload refused") })
	if _, code := h.connect("plain.example.com:"+port, ""); code != http.StatusForbidden {
		t.Fatalf("after a broken reload: %d, want the previous policy (403)", code)
	}
	if _, code := h.connect("example.net:"+port, ""); code != 200 {
		t.Fatalf("after a broken reload: allowed host refused (%d)", code)
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// The CA's name constraints hold even against its own key: a leaf for a
// host outside the intercept list does not verify.
func TestCANameConstraints(t *testing.T) {
	h := setupHarness(t, nil)
	a, err := ca.Load(filepath.Join(h.rt.CADir, ca.KeyFile), filepath.Join(h.rt.CADir, ca.CertFile))
	if err != nil {
		t.Fatal(err)
	}
	for host, ok := range map[string]bool{"api.example.com": true, "other.example.com": true, "bank.test": false, "plain.example.com": false} {
		leaf, err := a.Leaf(host)
		if err != nil {
			t.Fatal(err)
		}
		_, err = leaf.Leaf.Verify(x509.VerifyOptions{DNSName: host, Roots: h.cagePool})
		if (err == nil) != ok {
			t.Errorf("%s: verify error %v, want ok=%v", host, err, ok)
		}
	}
}

// Even with loopback upstreams allowed and its port listed, the gateway
// never dials its own listener (a loop that would amplify one request into
// unbounded connections).
func TestOwnListenerIsNeverAnUpstream(t *testing.T) {
	h := newHarness(t, nil)
	_, ps, _ := net.SplitHostPort(h.proxyAddr)
	port, _ := strconv.Atoi(ps)
	rt := *h.rt
	rt.Policy.Ports = append(slices.Clone(rt.Policy.Ports), port)
	h.writeConfig(&rt)
	syscall.Kill(os.Getpid(), syscall.SIGHUP)
	waitFor(t, "reloaded", func() bool { return h.logged("configuration reloaded") })
	if _, code := h.connect("loop.example.com:"+ps, ""); code != http.StatusForbidden {
		t.Fatalf("CONNECT to the proxy's own port: %d, want 403", code)
	}
	r := h.want(t, is("CONNECT", "loop.example.com", port), audit.Blocked, "address")
	if !strings.Contains(r.Reason, "own listener") {
		t.Fatalf("reason %q", r.Reason)
	}
}
