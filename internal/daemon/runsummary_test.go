package daemon

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nixcage/nixcage/internal/auditlog"
	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/quarantine"
)

// A run's summary counts what that run's gateway decided, all of it, in
// the real JSONL the gateway appends to (the audit log of a name outlives
// its runs):
//   - records an earlier run (or a former declared agent) of the same name
//     left in the log are not this run's: they are not counted, and their
//     blocked hosts are not listed;
//   - a cage that first fills its log with allowed requests (each a whole
//     record, up to auditlog.MaxRecordBytes; allowed records have no
//     budget) cannot push a later refusal out of the summary: every
//     record from the run's start on is read, not only the first read's
//     worth (red team: the summary read one auditlog.MaxRead window).
func TestRunSummaryCountsTheWholeRunAndOnlyIt(t *testing.T) {
	root := t.TempDir()
	d := &Daemon{qdirs: quarantine.Dirs{Root: root}}
	name := "run-sum"
	file := d.qdirs.AuditFile(name)
	if err := os.MkdirAll(filepath.Dir(file), 0o755); err != nil {
		t.Fatal(err)
	}
	line := func(rec auditlog.Record) []byte {
		b, err := json.Marshal(rec)
		if err != nil {
			t.Fatal(err)
		}
		return append(b, '\n')
	}
	var log []byte
	// An earlier run of the name: one refusal of another host.
	log = append(log, line(auditlog.Record{Agent: name, Decision: auditlog.Blocked, Host: "earlier.example"})...)
	if err := os.WriteFile(file, log, 0o644); err != nil {
		t.Fatal(err)
	}
	r := &run{name: name}
	d.markAuditStart(r)

	// This run: allowed requests with the longest path a record carries,
	// past one read's worth, then the refusal it would like to hide.
	allowed := 0
	path := "/" + strings.Repeat("a", auditlog.MaxPath-1)
	for len(log) < auditlog.MaxRead+(64<<10) {
		log = append(log, line(auditlog.Record{Agent: name, Decision: auditlog.Allowed, Host: "api.example.com", Method: "GET", Path: path})...)
		allowed++
	}
	log = append(log, line(auditlog.Record{Agent: name, Decision: auditlog.Blocked, Host: "evil.example.org"})...)
	if err := os.WriteFile(file, log, 0o644); err != nil {
		t.Fatal(err)
	}

	var sum bus.RunSummary
	d.auditSummary(r, &sum)
	if sum.Allowed != uint64(allowed) || sum.Blocked != 1 || strings.Join(sum.BlockedHosts, ",") != "evil.example.org" {
		t.Fatalf("summary allowed %d blocked %d hosts %v; want %d allowed, 1 blocked, evil.example.org only", sum.Allowed, sum.Blocked, sum.BlockedHosts, allowed)
	}
}
