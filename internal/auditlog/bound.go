package auditlog

import (
	"strconv"
	"unicode/utf8"
)

// Field bounds. Host, path, method and reason are the agent's words (a
// refused request with a 14 KiB path was a 14 KiB record, and a flood of
// them wrote ~50 MiB of audit a second, red team, issue 22 item 3), so
// every string field of a record is cut to a stated bound before it is
// written. Bounds count bytes of the field's JSON encoding, not of the raw
// string: a control byte or '<' takes 6 bytes there, so a raw bound would
// let one field grow six-fold. A cut field ends in CutMarker's form,
// "…(+N bytes)", N being the raw bytes left out.
const (
	MaxMethod = 64
	MaxHost   = 256 // a DNS name is at most 253 bytes
	MaxPath   = 1024
	MaxReason = 1024
	MaxRule   = 256
	MaxName   = 128 // agent name, each inspector and secret name
	MaxList   = 16  // entries of each name list, a "…(+N more)" one included
	// markerRoom is the longest "…(+N bytes)" (N up to 20 digits).
	markerRoom = len("…(+") + 20 + len(" bytes)")
	// recordOverhead bounds everything in an encoded record but the
	// bounded fields: keys, punctuation, ts, numbers (20 bytes each) and
	// the fixed-vocabulary event and decision.
	recordOverhead = 512
	// MaxRecordBytes bounds one encoded record line (newline included).
	MaxRecordBytes = recordOverhead + MaxMethod + MaxHost + MaxPath + MaxReason + MaxRule + MaxName +
		3*MaxList*(MaxName+3)
)

// Bound cuts every string field of r to its bound (see MaxPath). It is the
// one place a record's size is bounded; the gateway's writer calls it on
// every record. Bounding a bounded record changes nothing.
func (r *Record) Bound() {
	r.Method = Clip(r.Method, MaxMethod)
	r.Host = Clip(r.Host, MaxHost)
	r.Path = Clip(r.Path, MaxPath)
	r.Reason = Clip(r.Reason, MaxReason)
	r.Rule = Clip(r.Rule, MaxRule)
	r.Agent = Clip(r.Agent, MaxName)
	r.Event = Clip(r.Event, MaxName)
	r.Decision = Clip(r.Decision, MaxName)
	r.TS = Clip(r.TS, MaxName)
	for _, p := range []*[]string{&r.Inspectors, &r.SecretsInjected, &r.SecretsRedacted} {
		*p = clipList(*p)
	}
}

func clipList(l []string) []string {
	cut := 0
	if len(l) > MaxList {
		cut = len(l) - (MaxList - 1)
		l = l[: MaxList-1 : MaxList-1]
	}
	out := l
	for i, s := range l {
		if c := Clip(s, MaxName); c != s {
			if &out[0] == &l[0] {
				out = append([]string(nil), l...) // never write the caller's slice
			}
			out[i] = c
		}
	}
	if cut > 0 {
		out = append(out, "…(+"+strconv.Itoa(cut)+" more)")
	}
	return out
}

// Clip returns s if its JSON encoding (without quotes) takes at most max
// bytes, else the longest prefix that leaves room for the marker, cut at a
// character boundary, followed by "…(+N bytes)".
func Clip(s string, max int) string {
	if len(s) <= max/6 { // fast path: even all-escaped it fits
		return s
	}
	n, cutAt := 0, -1
	for i := 0; i < len(s); {
		c, size := utf8.DecodeRuneInString(s[i:])
		w := jsonLen(c, size)
		if cutAt < 0 && n+w > max-markerRoom {
			cutAt = i
		}
		if n += w; n > max {
			return s[:cutAt] + "…(+" + strconv.Itoa(len(s)-cutAt) + " bytes)"
		}
		i += size
	}
	return s
}

// jsonLen is how many bytes encoding/json writes for one decoded rune
// (size is its length in s, 1 for an invalid byte).
func jsonLen(c rune, size int) int {
	switch {
	case c == utf8.RuneError && size == 1:
		return 6 // \ufffd
	case c == '"' || c == '\\' || c == '\n' || c == '\r' || c == '\t':
		return 2
	case c < 0x20 || c == '<' || c == '>' || c == '&' || c == '\u2028' || c == '\u2029':
		return 6
	}
	return size
}
