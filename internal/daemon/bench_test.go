package daemon_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/daemon/daemontest"
	"github.com/nixcage/nixcage/internal/testenv"
)

// agentsConfig declares n service agents.
func agentsConfig(n int) string {
	var b strings.Builder
	for i := 0; i < n; i++ {
		fmt.Fprintf(&b, "agent \"a%04d\" {\n  backend = \"service\"\n  command = [\"/bin/sleep\", \"infinity\"]\n}\n", i)
	}
	return b.String()
}

// BenchmarkStatus is one GetStatus round trip through the typed client
// (what `cagectl status` does after connecting); BenchmarkStatus/ping is an
// empty Peer.Ping to caged on the same bus, the baseline.
func BenchmarkStatus(b *testing.B) {
	daemontest.PollInterval = time.Second // caged's default
	for _, n := range []int{10, 100, 1000} {
		c := daemontest.Start(b, agentsConfig(n))
		cl := c.Client()
		ctx := context.Background()
		b.Run(fmt.Sprintf("ping/agents=%d", n), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				if err := cl.Ping(ctx); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(fmt.Sprintf("status/agents=%d", n), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				st, err := cl.Status(ctx)
				if err != nil || len(st.Agents) != n {
					b.Fatal(err)
				}
			}
		})
		c.Stop()
	}
}

// TestStatusLatencyReport measures what an operator sees: the wall-clock
// median of running the `cagectl status` binary, against running `busctl
// call ... org.freedesktop.DBus.Peer Ping` on the same bus (process start,
// connect, authenticate, one call). It prints a table; it asserts nothing
// about speed. Run: bash bench/caged/status.sh
func TestStatusLatencyReport(t *testing.T) {
	if os.Getenv("NIXCAGE_BENCH") != "1" {
		t.Skip("benchmark report: set NIXCAGE_BENCH=1 (bash bench/caged/status.sh does)")
	}
	busctl := testenv.LookPath(t, "busctl")
	daemontest.PollInterval = time.Second // caged's default
	bin := filepath.Join(t.TempDir(), "cagectl")
	if out, err := exec.Command(filepath.Join(runtimeGOROOT(), "bin", "go"), "build", "-o", bin, "github.com/nixcage/nixcage/cmd/cagectl").CombinedOutput(); err != nil {
		t.Fatalf("build cagectl: %v\n%s", err, out)
	}
	runs := 101
	fmt.Printf("| agents | cagectl status median | busctl Ping median | ratio | status bytes |\n|---|---|---|---|---|\n")
	for _, n := range []int{10, 100, 1000} {
		c := daemontest.Start(t, agentsConfig(n))
		status := []string{bin, "status", "--bus", c.Bus.Address}
		ping := []string{busctl, "--address=" + c.Bus.Address, "call", bus.Name, "/org/nixcage/cage1", "org.freedesktop.DBus.Peer", "Ping"}
		out, err := exec.Command(status[0], status[1:]...).Output()
		if err != nil || strings.Count(string(out), "\n") < n {
			t.Fatalf("cagectl status: %v\n%s", err, out)
		}
		// Interleave so drift affects both alike.
		var ts, tp []time.Duration
		for i := 0; i < runs; i++ {
			ts = append(ts, timeRun(t, status))
			tp = append(tp, timeRun(t, ping))
		}
		ms, mp := median(ts), median(tp)
		fmt.Printf("| %d | %.2f ms | %.2f ms | %.2f | %d |\n", n, ms.Seconds()*1000, mp.Seconds()*1000, float64(ms)/float64(mp), len(out))
		c.Stop()
	}
}

func timeRun(t *testing.T, argv []string) time.Duration {
	start := time.Now()
	cmd := exec.Command(argv[0], argv[1:]...)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%v: %v\n%s", argv, err, out)
	}
	return time.Since(start)
}

func median(d []time.Duration) time.Duration {
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}

func runtimeGOROOT() string {
	if out, err := exec.Command("go", "env", "GOROOT").Output(); err == nil {
		return strings.TrimSpace(string(out))
	}
	return "/usr/local/go"
}
