package systest

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/testenv"
)

var rootfsOnce struct {
	sync.Mutex
	dir string
}

// RootfsT returns the cached tree, building it on first use in this process.
func RootfsT(t testing.TB) string {
	t.Helper()
	testenv.RequireSystem(t)
	for _, tool := range []string{"debootstrap", "systemd-nspawn", "unshare", "nsenter", "chroot"} {
		testenv.LookPath(t, tool)
	}
	rootfsOnce.Lock()
	defer rootfsOnce.Unlock()
	if rootfsOnce.dir != "" {
		return rootfsOnce.dir
	}
	ctx, cancel := testContext(t, 8*time.Minute)
	defer cancel()
	dir, err := EnsureRootfs(ctx, testWriter{t})
	if err != nil {
		t.Fatalf("machine tree: %v", err)
	}
	rootfsOnce.dir = dir
	return dir
}

// BootT boots a machine for one test and powers it off when the test ends,
// printing the machine's console and failed units if the test failed.
func BootT(t testing.TB) *Machine {
	t.Helper()
	root := RootfsT(t)
	ctx, cancel := testContext(t, 2*time.Minute)
	defer cancel()
	console := filepath.Join(t.TempDir(), "console.log")
	m, err := Boot(ctx, Options{Root: root, Console: console, Log: testWriter{t}})
	if err != nil {
		t.Fatalf("%v", err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			out, _ := m.Run(context.Background(), "systemctl", "list-units", "--failed", "--no-legend", "--no-pager")
			t.Logf("failed units in machine %s:\n%s", m.Name, out)
			journal, _ := m.Run(context.Background(), "journalctl", "--no-pager", "-n", "150", "-o", "short-monotonic")
			t.Logf("journal tail:\n%s", journal)
		}
		start := time.Now()
		if err := m.Close(); err != nil {
			t.Errorf("close machine %s: %v", m.Name, err)
		}
		t.Logf("systest: machine %s stopped in %s", m.Name, time.Since(start).Round(time.Millisecond))
	})
	return m
}

// MustRun runs a command in the machine and fails the test on error.
func (m *Machine) MustRun(t testing.TB, args ...string) string {
	t.Helper()
	ctx, cancel := testContext(t, 2*time.Minute)
	defer cancel()
	out, err := m.Run(ctx, args...)
	if err != nil {
		t.Fatalf("%v", err)
	}
	return out
}

// MustShell runs a shell script in the machine and fails the test on error.
func (m *Machine) MustShell(t testing.TB, script string) string {
	t.Helper()
	return m.MustRun(t, "/bin/sh", "-ec", script)
}

// MustWriteFile writes a file in the machine and fails the test on error.
func (m *Machine) MustWriteFile(t testing.TB, p string, data []byte, mode os.FileMode) {
	t.Helper()
	if err := m.WriteFile(p, data, mode); err != nil {
		t.Fatal(err)
	}
}

// testContext bounds an operation by d and by the test's own deadline, so a
// hung machine fails the test with a message instead of the binary panicking.
func testContext(t testing.TB, d time.Duration) (context.Context, context.CancelFunc) {
	ctx := context.Background()
	if dt, ok := t.(interface{ Deadline() (time.Time, bool) }); ok {
		if dl, ok := dt.Deadline(); ok {
			return context.WithDeadline(ctx, minTime(dl.Add(-10*time.Second), time.Now().Add(d)))
		}
	}
	return context.WithTimeout(ctx, d)
}

func minTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// StartInternetT starts the fake internet in a machine for a test.
func StartInternetT(t testing.TB, m *Machine) *Internet {
	t.Helper()
	bin := BuildT(t, "./checks/system/upstream")
	ctx, cancel := testContext(t, time.Minute)
	defer cancel()
	in, err := StartInternet(ctx, m, bin)
	if err != nil {
		t.Fatal(err)
	}
	return in
}
