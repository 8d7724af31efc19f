package egress

import (
	"bufio"
	"crypto/tls"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/systest"
)

// startBinary runs the real cage-egress binary (go build ./cmd/cage-egress)
// on the harness's config, fakes and loopback listeners, and returns it.
// The caller may kill it; cleanup does too.
func (h *harness) startBinary(t *testing.T) *exec.Cmd {
	t.Helper()
	bin := systest.BuildT(t, "./cmd/cage-egress")
	cmd := exec.Command(bin, "--config", h.cfgPath, "--listen-proxy", "127.0.0.1:0", "--listen-dns", "127.0.0.1:0",
		"--resolver", h.dns.addr, "--upstream-ca", h.up.rootsFile)
	cmd.Env = os.Environ() // CREDENTIALS_DIRECTORY from setupHarness
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	m := servingRe.FindStringSubmatch(h.readLog(stderr))
	if m == nil {
		t.Fatalf("cage-egress binary did not start:\n%s", h.logBuf.String())
	}
	h.proxyAddr, h.dnsAddr = m[1], m[2]
	return cmd
}

// SIGKILL of the gateway (what the OOM killer does) in the middle of a slow
// upload through a tunnel: the tunnel's open record is already on disk, for
// a plain tunnel and an intercepted one.
func TestKilledGatewayLeavesOpenRecords(t *testing.T) {
	h := setupHarness(t, nil)
	cmd := h.startBinary(t)
	port := strconv.Itoa(h.up.tlsPort)

	// Plain tunnel: TLS to the upstream itself, a POST whose body trickles.
	plain, code := h.connect("plain.example.com:"+port, "")
	if code != 200 {
		t.Fatalf("CONNECT plain: %d", code)
	}
	defer plain.Close()
	pt := tls.Client(plain, &tls.Config{RootCAs: h.up.roots, ServerName: "plain.example.com"})
	fmt.Fprintf(pt, "POST /upload HTTP/1.1\r\nHost: plain.example.com\r\nContent-Length: 10000000\r\n\r\n%s", strings.Repeat("d", 4096))

	// Intercepted tunnel: TLS to the gateway's leaf, the same slow POST.
	icpt, code := h.connect("api.example.com:"+port, "")
	if code != 200 {
		t.Fatalf("CONNECT api: %d", code)
	}
	defer icpt.Close()
	it := tls.Client(icpt, &tls.Config{RootCAs: h.cagePool, ServerName: "api.example.com", NextProtos: []string{"http/1.1"}})
	fmt.Fprintf(it, "POST /upload HTTP/1.1\r\nHost: api.example.com:%s\r\nContent-Length: 10000000\r\n\r\n%s", port, strings.Repeat("d", 4096))

	open := func(host string) func(audit.Record) bool {
		m := is("CONNECT", host, h.up.tlsPort)
		return func(r audit.Record) bool { return m(r) && r.Event == audit.EventOpen }
	}
	h.want(t, open("plain.example.com"), audit.Allowed, "allow:*.example.com")
	h.want(t, open("api.example.com"), audit.Allowed, "allow:*.example.com")

	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	// The cage loses the network: the tunnels are gone.
	plain.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.Copy(io.Discard, bufio.NewReader(plain)); err != nil {
		t.Fatalf("tunnel survived the gateway: %v", err)
	}
	for _, r := range h.records(t) {
		if r.Event == audit.EventClose {
			t.Fatalf("close record without a close: %+v", r)
		}
	}
	h.want(t, open("plain.example.com"), audit.Allowed, "")
	h.want(t, open("api.example.com"), audit.Allowed, "")
}
