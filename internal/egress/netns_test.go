package egress

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/egress/prepare"
	"github.com/nixcage/nixcage/internal/testenv"
)

// inNetns runs f on a thread switched into the network namespace at path,
// the way systemd binds a socket unit's sockets with NetworkNamespacePath=.
func inNetns(path string, f func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		// The thread is not unlocked: if switching back failed it must die
		// with the goroutine rather than serve others in the wrong netns.
		orig, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			errc <- err
			return
		}
		defer orig.Close()
		target, err := os.Open(path)
		if err != nil {
			errc <- err
			return
		}
		defer target.Close()
		if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("setns %s: %w", path, err)
			return
		}
		ferr := f()
		if err := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("setns back: %w", err)
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

// The production shape on a real kernel: a network namespace holding only
// lo, the gateway's sockets bound inside it and handed over by socket
// activation, the gateway itself in the host namespace, and an "agent"
// (curl, getent) inside the namespace. The agent reaches allowed hosts only
// through the gateway; everything else fails in the kernel or at the
// gateway, and the gateway's decisions are audited.
func TestCageNetns(t *testing.T) {
	testenv.RequirePrivileged(t)
	curl := testenv.LookPath(t, "curl")
	getent := testenv.LookPath(t, "getent")
	h := setupHarness(t, nil)
	agent, cmd := startCage(t, h)
	caFile := filepath.Join(h.rt.CADir, "ca.crt")
	port := strconv.Itoa(h.up.tlsPort)

	t.Run("allowed host through the gateway, credential injected", func(t *testing.T) {
		out, err := agent(curl, "-sS", "--max-time", "20", "--proxy", "http://127.0.0.1:3128", "--cacert", caFile,
			"-H", "x-api-key: "+h.ph["anthropic"], "https://api.example.com:"+port+"/from-cage")
		if err != nil || !strings.Contains(out, "host=api.example.com") || strings.Contains(out, realAnthropic) {
			t.Fatalf("curl in the cage: %v\n%s", err, out)
		}
		if h.up.lastSeen().Header.Get("X-Api-Key") != realAnthropic {
			t.Fatal("credential not injected")
		}
		h.want(t, func(r audit.Record) bool { return r.Path == "/from-cage" }, audit.Allowed, "")
	})
	t.Run("direct connections fail in the kernel", func(t *testing.T) {
		// No route at all: nothing is sent anywhere.
		out, err := agent(curl, "-sS", "--max-time", "5", "--noproxy", "*", "https://192.0.2.1/")
		if err == nil || !strings.Contains(out, "192.0.2.1") {
			t.Fatalf("direct connect from the cage: %v\n%s", err, out)
		}
		if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 7 { // CURLE_COULDNT_CONNECT
			t.Fatalf("direct connect: %v\n%s", err, out)
		}
		// The host's loopback services are not the cage's loopback.
		out, err = agent(curl, "-sS", "--max-time", "5", "--noproxy", "*", "--cacert", h.up.rootsFile, "https://127.0.0.1:"+port+"/")
		if err == nil {
			t.Fatalf("cage reached the host's loopback upstream:\n%s", out)
		}
	})
	t.Run("cage DNS is the gateway's filter", func(t *testing.T) {
		// getent hosts (gethostbyname), not ahosts: getaddrinfo's
		// AI_ADDRCONFIG finds no non-loopback address in a cage and gives up
		// without sending a query.
		if out, err := agent(getent, "hosts", "api.example.com"); err != nil || !strings.Contains(out, "127.0.0.1") {
			t.Fatalf("allowed name: %v\n%s\naudit:\n%s", err, out, h.dump())
		}
		if out, err := agent(getent, "hosts", "exfil.attacker.test"); err == nil {
			t.Fatalf("denied name resolved:\n%s", out)
		}
		h.want(t, is("DNS", "exfil.attacker.test", 53), audit.Blocked, "default-deny")
	})
	t.Run("denied host through the gateway", func(t *testing.T) {
		out, _ := agent(curl, "-sS", "--max-time", "20", "--proxy", "http://127.0.0.1:3128", "-o", "/dev/null", "-w", "%{http_code}", "https://denied.example.com/")
		if !strings.Contains(out, "403") {
			t.Fatalf("denied host: %s", out)
		}
		h.want(t, is("CONNECT", "denied.example.com", 443), audit.Blocked, "deny:denied.example.com")
	})
	t.Run("gateway killed: the cage loses the network", func(t *testing.T) {
		cmd.Process.Kill()
		cmd.Wait()
		out, err := agent(curl, "-sS", "--max-time", "5", "--proxy", "http://127.0.0.1:3128", "--cacert", caFile, "https://api.example.com:"+port+"/after-kill")
		if err == nil {
			t.Fatalf("request succeeded with the gateway dead:\n%s", out)
		}
	})
}

// startCage makes a network namespace holding only lo, binds the gateway's
// sockets inside it, runs the gateway of h (prepared, not started) in the
// host namespace by socket activation, as systemd does, and returns a way
// to run a command as the agent inside the namespace, and the gateway's
// process.
func startCage(t *testing.T, h *harness) (func(args ...string) (string, error), *exec.Cmd) {
	t.Helper()
	ipTool := testenv.LookPath(t, "ip")
	sh := testenv.LookPath(t, "sh")
	b := make([]byte, 4)
	rand.Read(b)
	ns := "nixcage-test-" + hex.EncodeToString(b)
	run := func(args ...string) (string, error) {
		out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
		return string(out), err
	}
	if out, err := run(ipTool, "netns", "add", ns); err != nil {
		t.Fatalf("ip netns add: %v\n%s", err, out)
	}
	t.Cleanup(func() { run(ipTool, "netns", "del", ns); os.RemoveAll("/etc/netns/" + ns) })
	if out, err := run(ipTool, "-n", ns, "link", "set", "lo", "up"); err != nil {
		t.Fatalf("lo up: %v\n%s", err, out)
	}
	// ip netns exec bind-mounts /etc/netns/NAME/resolv.conf over
	// /etc/resolv.conf: the cage's resolver is the gateway.
	os.MkdirAll("/etc/netns/"+ns, 0o755)
	os.WriteFile("/etc/netns/"+ns+"/resolv.conf", []byte(prepare.ResolvConfText), 0o644)

	var files []*os.File
	err := inNetns("/run/netns/"+ns, func() error {
		pl, err := net.Listen("tcp", "127.0.0.1:3128")
		if err != nil {
			return err
		}
		dl, du, err := listenBoth("127.0.0.1:53")
		if err != nil {
			return err
		}
		for _, f := range []interface{ File() (*os.File, error) }{pl.(*net.TCPListener), dl.(*net.TCPListener), du.(*net.UDPConn)} {
			file, err := f.File()
			if err != nil {
				return err
			}
			files = append(files, file)
		}
		pl.Close()
		dl.Close()
		du.Close()
		return nil
	})
	if err != nil {
		t.Fatalf("sockets in the cage namespace: %v", err)
	}

	args := strings.Join([]string{"--config", h.cfgPath, "--resolver", h.dns.addr, "--upstream-ca", h.up.rootsFile}, "\x1f")
	cmd := exec.Command(sh, "-c", `LISTEN_PID=$$ exec "$0" "$@"`, os.Args[0], "-test.run=^TestHelperGateway$")
	cmd.Env = append(os.Environ(), helperEnv+"="+args, "LISTEN_FDS=3", "LISTEN_FDNAMES=proxy:dns:dns")
	cmd.ExtraFiles = files
	stderr, _ := cmd.StderrPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Signal(syscall.SIGTERM); cmd.Wait() })
	for _, f := range files {
		f.Close()
	}
	if line := h.readLog(stderr); !strings.Contains(line, "proxy=127.0.0.1:3128") {
		t.Fatalf("gateway did not start: %q", line)
	}
	h.cageNetns = "/run/netns/" + ns
	return func(args ...string) (string, error) {
		return run(append([]string{ipTool, "netns", "exec", ns}, args...)...)
	}, cmd
}
