// Package audit writes one record per gateway decision to a JSONL file and,
// under systemd, to the journal with structured fields.
//
// Invariant: records carry secret names, never secret values; callers pass
// names only, and the inspectors report pattern names, not matched text.
package audit

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/coreos/go-systemd/v22/journal"

	"github.com/nixcage/nixcage/internal/auditlog"
)

// The record schema is auditlog's: one type for the gateway that writes it,
// caged that reads it and cagectl that shows it.
const Schema = auditlog.Schema

// Decisions.
const (
	Allowed = auditlog.Allowed
	Flagged = auditlog.Flagged
	Blocked = auditlog.Blocked
)

// Events.
const (
	EventRequest = auditlog.EventRequest
	EventOpen    = auditlog.EventOpen
	EventClose   = auditlog.EventClose
	EventSummary = auditlog.EventSummary
	EventLearn   = auditlog.EventLearn
)

// Record is one decision.
type Record = auditlog.Record

// Logger fans records out to its sinks. Safe for concurrent use.
type Logger struct {
	agent   string
	mu      sync.Mutex
	file    *os.File
	journal bool
	// Hook, if set, sees every record written (events, tests).
	Hook func(Record)
	bud  budgets
}

var lineBufs = sync.Pool{New: func() any { b := make([]byte, 0, 1024); return &b }}

// UnderSystemd reports whether the process was started by systemd with its
// output connected to the journal.
func UnderSystemd() bool {
	return os.Getenv("JOURNAL_STREAM") != "" || os.Getenv("INVOCATION_ID") != ""
}

// Open creates a logger. file may be empty (no file sink).
func Open(agent, file string, toJournal bool) (*Logger, error) {
	l := &Logger{agent: agent, journal: toJournal && journal.Enabled()}
	if file != "" {
		f, err := os.OpenFile(file, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o640)
		if err != nil {
			return nil, fmt.Errorf("open audit file: %w", err)
		}
		l.file = f
	}
	return l, nil
}

// Close writes pending summaries and closes the file sink.
func (l *Logger) Close() error {
	l.stopBudgets()
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.file == nil {
		return nil
	}
	err := l.file.Close()
	l.file = nil
	return err
}

// Log stamps and writes r. Write errors are returned so the caller can
// decide; the gateway treats a failing audit sink as fatal to the request.
func (l *Logger) Log(r Record) error {
	r.Schema = Schema
	r.Agent = l.agent
	if r.Event == "" {
		r.Event = auditlog.EventRequest
	}
	if r.TS == "" {
		r.TS = time.Now().UTC().Format(time.RFC3339Nano)
	}
	for _, p := range []*[]string{&r.Inspectors, &r.SecretsInjected, &r.SecretsRedacted} {
		if *p == nil {
			*p = []string{}
		}
	}
	// Host, path and reason are the agent's words: each field is cut to
	// its bound here, so no record is larger than auditlog.MaxRecordBytes.
	r.Bound()
	if l.Hook != nil {
		l.Hook(r)
	}
	// The line (json.Marshal's bytes, without its reflection) is built
	// in a pooled buffer: every record is bounded (auditlog.MaxRecordBytes).
	bp := lineBufs.Get().(*[]byte)
	*bp = append(r.AppendJSON((*bp)[:0]), '\n')
	var err error
	l.mu.Lock()
	if l.file != nil {
		_, err = l.file.Write(*bp)
	}
	l.mu.Unlock()
	lineBufs.Put(bp)
	if err != nil {
		err = fmt.Errorf("audit: %w", err)
	}
	if l.journal {
		prio := journal.PriInfo
		if r.Decision != Allowed {
			prio = journal.PriWarning
		}
		msg := fmt.Sprintf("%s %s %s:%d %s: %s", r.Decision, r.Method, r.Host, r.Port, r.Path, r.Reason)
		if jerr := journal.Send(msg, prio, Fields(r)); jerr != nil && err == nil {
			err = fmt.Errorf("audit journal: %w", jerr)
		}
	}
	return err
}

// Fields are the journal fields of r (upper-case, prefixed NIXCAGE_).
func Fields(r Record) map[string]string {
	return map[string]string{
		"NIXCAGE_SCHEMA":           strconv.Itoa(r.Schema),
		"NIXCAGE_AGENT":            r.Agent,
		"NIXCAGE_EVENT":            r.Event,
		"NIXCAGE_COUNT":            strconv.FormatInt(r.Count, 10),
		"NIXCAGE_METHOD":           r.Method,
		"NIXCAGE_HOST":             r.Host,
		"NIXCAGE_PORT":             strconv.Itoa(r.Port),
		"NIXCAGE_PATH":             r.Path,
		"NIXCAGE_DECISION":         r.Decision,
		"NIXCAGE_REASON":           r.Reason,
		"NIXCAGE_RULE":             r.Rule,
		"NIXCAGE_INSPECTORS":       strings.Join(r.Inspectors, ","),
		"NIXCAGE_SECRETS_INJECTED": strings.Join(r.SecretsInjected, ","),
		"NIXCAGE_SECRETS_REDACTED": strings.Join(r.SecretsRedacted, ","),
		"NIXCAGE_BYTES_OUT":        strconv.FormatInt(r.BytesOut, 10),
		"NIXCAGE_BYTES_IN":         strconv.FormatInt(r.BytesIn, 10),
		"NIXCAGE_DURATION_MS":      strconv.FormatInt(r.DurationMS, 10),
	}
}
