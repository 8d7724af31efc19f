package daemon_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/auditlog"
	"github.com/nixcage/nixcage/internal/daemon/daemontest"
	"github.com/nixcage/nixcage/internal/paths"
)

// A compromised gateway owns its logs directory: it replaces audit.jsonl
// with a link to a root-only file. caged's ReadAudit (served to any viewer)
// must refuse the link, and the counters must not read through it.
func TestReadAuditRefusesLinkedFile(t *testing.T) {
	c := daemontest.Start(t, twoAgents)
	cl := c.Client()
	ctx := context.Background()
	secretFile := filepath.Join(t.TempDir(), "shadow")
	if err := os.WriteFile(secretFile, []byte(`{"decision":"blocked","host":"root:$6$secrethash"}`+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	auditFile := c.Path(filepath.Join(paths.AuditDir("alpha"), "audit.jsonl"))
	if err := os.MkdirAll(filepath.Dir(auditFile), 0o755); err != nil {
		t.Fatal(err)
	}
	plant := map[string]func() error{
		"symlink":   func() error { return os.Symlink(secretFile, auditFile) },
		"hard link": func() error { return os.Link(secretFile, auditFile) },
		"fifo":      func() error { return syscall.Mkfifo(auditFile, 0o600) },
	}
	for _, name := range []string{"symlink", "hard link", "fifo"} {
		t.Run(name, func(t *testing.T) {
			os.Remove(auditFile)
			if err := plant[name](); err != nil {
				t.Skipf("cannot plant a %s here: %v", name, err)
			}
			ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			for _, off := range []int64{0, -1} {
				lines, _, err := cl.ReadAudit(ctx, "alpha", off, 10)
				if strings.Contains(strings.Join(lines, "\n"), "secrethash") {
					t.Fatalf("ReadAudit(%d) returned the linked file: %q", off, lines)
				}
				if err == nil || !strings.Contains(err.Error(), "not a plain file") {
					t.Fatalf("ReadAudit(%d) = %q, %v; want a refusal naming the reason", off, lines, err)
				}
			}
		})
	}
	os.Remove(auditFile)
	st, err := cl.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if a := st.Agents[0]; a.Blocked != 0 {
		t.Fatalf("counters read through the link: %+v", a)
	}
	// The refusal is auditlog's own, for any reader (cagectl as root too).
	if err := os.Symlink(secretFile, auditFile); err != nil {
		t.Fatal(err)
	}
	if _, _, err := auditlog.Read(auditFile, 0, 10); !errors.Is(err, auditlog.ErrNotPlainFile) {
		t.Fatalf("auditlog.Read on a symlink: %v", err)
	}
}
