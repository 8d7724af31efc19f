package auditlog

import (
	"fmt"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"
)

// Schema versions the record layout. 2 added event and count (tunnel open
// and close records, aggregate records).
const Schema = 2

// Decisions.
const (
	Allowed = "allowed"
	Flagged = "flagged"
	Blocked = "blocked"
)

// Events: what moment of a decision a record stands for.
const (
	// EventRequest is a decision made and finished at once: one HTTP
	// request, one DNS query, one refusal.
	EventRequest = "request"
	// EventOpen is written when a tunnel starts carrying bytes, so a
	// gateway killed mid-tunnel (OOM, SIGKILL) still leaves a record.
	EventOpen = "open"
	// EventClose ends a tunnel opened by an EventOpen record, with the
	// bytes moved and the duration.
	EventClose = "close"
	// EventSummary stands for Count decisions not written one by one
	// (the audit budget for DNS); Reason says what they were.
	EventSummary = "summary"
	// EventLearn marks the moments learn mode began and ended (no request:
	// Host is empty, Rule is "learn"); the records it let through carry
	// decision flagged and rule "learn" (docs/grants.md).
	EventLearn = "learn"
)

// Record is one gateway decision: the one schema the gateway writes, caged
// reads and cagectl shows.
type Record struct {
	Schema          int      `json:"schema"`
	TS              string   `json:"ts"`
	Agent           string   `json:"agent"`
	Event           string   `json:"event"`
	Method          string   `json:"method"`
	Host            string   `json:"host"`
	Port            int      `json:"port"`
	Path            string   `json:"path"`
	Decision        string   `json:"decision"`
	Reason          string   `json:"reason"`
	Rule            string   `json:"rule"`
	Inspectors      []string `json:"inspectors"`
	SecretsInjected []string `json:"secrets_injected"`
	SecretsRedacted []string `json:"secrets_redacted"`
	BytesOut        int64    `json:"bytes_out"`
	BytesIn         int64    `json:"bytes_in"`
	DurationMS      int64    `json:"duration_ms"`
	// Count is how many decisions the record stands for: 0 or 1 for one,
	// more for an EventSummary.
	Count int64 `json:"count,omitempty"`
}

// Decisions is how many decisions r stands for, for counters: a close
// record ends a decision its open record already counted.
func (r Record) Decisions() uint64 {
	switch {
	case r.Event == EventClose || r.Event == EventLearn:
		return 0
	case r.Count > 1:
		return uint64(r.Count)
	}
	return 1
}

// Line renders r as one line for a terminal. Every field an agent can
// influence (host, path, reason) is escaped: a record must never print as
// two lines or move the cursor.
func (r Record) Line() string {
	target := r.Host
	path := r.Path
	switch {
	case r.Method == "DNS":
		// "DNS api.example.com AAAA": the path holds the query type.
		if path != "" {
			path = " " + path
		}
	case r.Port != 0:
		target = fmt.Sprintf("%s:%d", r.Host, r.Port)
	}
	var why []string
	if r.Event != "" && r.Event != EventRequest {
		why = append(why, r.Event)
	}
	if r.Reason != "" {
		why = append(why, r.Reason)
	}
	if r.Rule != "" {
		why = append(why, "rule "+r.Rule)
	}
	if len(r.Inspectors) > 0 {
		why = append(why, "inspectors "+strings.Join(r.Inspectors, ","))
	}
	return fmt.Sprintf("%s  %-7s  %-7s %s%s  %s", Escape(r.TS), Escape(r.Decision), Escape(r.Method), Escape(target), Escape(path), Escape(strings.Join(why, "; ")))
}

// Escape makes s safe to print on a terminal: control bytes (C0, DEL, C1,
// so newlines and escape sequences), Unicode format characters (bidi
// overrides), invalid UTF-8 and the backslash itself come out as Go escapes
// (\n, \x1b, \u202e, \\), so what is shown is unambiguous and on one line.
func Escape(s string) string {
	clean := true
	for _, c := range s {
		if c == '\\' || c == utf8.RuneError || !unicode.IsPrint(c) {
			clean = false
			break
		}
	}
	if clean {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		c, n := utf8.DecodeRuneInString(s[i:])
		switch {
		case c == utf8.RuneError && n <= 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case c == '\\':
			b.WriteString(`\\`)
		case unicode.IsPrint(c):
			b.WriteString(s[i : i+n])
		default:
			q := strconv.QuoteRuneToASCII(c)
			b.WriteString(q[1 : len(q)-1])
		}
		i += n
	}
	return b.String()
}

// EscapeJSON is Escape for a valid JSON line: the same characters come out
// as JSON \u escapes, so the line stays the same JSON value. (A valid line
// holds such characters only inside strings.)
func EscapeJSON(line string) string {
	var b strings.Builder
	for _, c := range line {
		if unicode.IsPrint(c) || c == '\t' || c == '\n' || c == '\r' {
			b.WriteRune(c)
			continue
		}
		for _, u := range utf16.Encode([]rune{c}) {
			fmt.Fprintf(&b, `\u%04x`, u)
		}
	}
	return b.String()
}
