package auditlog

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"time"
)

// Excerpt writes to w the part of the audit log at path that evidence
// keeps, at most about max bytes, in log order, chosen in this order of
// precedence while room lasts:
//
//  1. every summary record (the counts of what the gateway's audit budget
//     did not write one by one) and the first record of every distinct
//     (decision, rule, host) since the log began, oldest first;
//  2. the other non-DNS records (HTTP requests, tunnels, refusals), newest
//     first;
//  3. the other DNS records, newest first.
//
// So a flood of any kind (DNS queries, refusals to made-up names, repeats
// of one refusal) cannot push the first blocked request to a destination
// out of the evidence: the flood's own repeats go first, and its distinct
// names are bounded by the gateway's budget. Records left out are not
// dropped silently: a final summary record counts them by kind and
// decision. The log is opened as Open does (no links). A missing log is an
// empty excerpt.
func Excerpt(w io.Writer, path, agent string, max int64) error {
	f, err := Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer f.Close()
	// Pass 1: sizes and ranks, to decide what fits.
	type line struct {
		rank int // 0, 1, 2: the precedence above
		dns  bool
		size int64
	}
	var lines []line
	seen := map[string]bool{}
	if err := scanLines(f, func(b []byte) {
		l := line{dns: isDNS(b), size: int64(len(b)) + 1, rank: 1}
		if l.dns {
			l.rank = 2
		}
		if k, summary := distinctKey(b); summary {
			l.rank = 0
		} else if !l.dns && k != "" && !seen[k] {
			seen[k] = true
			l.rank = 0
		}
		lines = append(lines, l)
	}); err != nil {
		return err
	}
	keep := make([]bool, len(lines))
	room := max
	for i := range lines { // rank 0, oldest first
		if lines[i].rank == 0 && lines[i].size <= room {
			keep[i] = true
			room -= lines[i].size
		}
	}
	for _, rank := range []int{1, 2} { // then newest first
		for i := len(lines) - 1; i >= 0; i-- {
			if lines[i].rank == rank && lines[i].size <= room {
				keep[i] = true
				room -= lines[i].size
			}
		}
	}
	// Pass 2: write what is kept, count what is not.
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return fmt.Errorf("audit: %w", err)
	}
	bw := bufio.NewWriterSize(w, 64<<10)
	left := map[string]int64{}
	var leftN int64
	var werr error
	i := 0
	if err := scanLines(f, func(b []byte) {
		if i >= len(keep) { // appended since pass 1: the next excerpt's
			return
		}
		if keep[i] {
			// b is the reader's buffer: write it, never append to it.
			bw.Write(b)
			if err := bw.WriteByte('\n'); err != nil && werr == nil {
				werr = err
			}
		} else {
			var r Record
			_ = json.Unmarshal(b, &r)
			kind := "dns"
			if !lines[i].dns {
				kind = "other"
			}
			n := max64(1, r.Count)
			if r.Event == EventClose {
				n = 0
			}
			left[kind+" "+r.Decision] += n
			leftN++
		}
		i++
	}); err != nil {
		return err
	}
	if werr != nil {
		return fmt.Errorf("audit excerpt: %w", werr)
	}
	if leftN > 0 {
		var parts []string
		for k, n := range left {
			parts = append(parts, fmt.Sprintf("%s %d", k, n))
		}
		sort.Strings(parts)
		rec := Record{
			Schema: Schema, TS: time.Now().UTC().Format(time.RFC3339Nano), Agent: agent,
			Event: EventSummary, Decision: Blocked, Rule: "evidence-excerpt", Count: leftN,
			Reason: fmt.Sprintf("%d records of the audit log (%s) are not in this excerpt of at most %d bytes: summaries and the first record of each distinct decision, rule and host are kept first, then the newest other non-DNS records, then the newest DNS records; decisions left out, by kind and decision: %s",
				leftN, path, max, strings.Join(parts, ", ")),
			Inspectors: []string{}, SecretsInjected: []string{}, SecretsRedacted: []string{},
		}
		b, _ := json.Marshal(rec)
		if _, err := bw.Write(append(b, '\n')); err != nil {
			return fmt.Errorf("audit excerpt: %w", err)
		}
	}
	if err := bw.Flush(); err != nil {
		return fmt.Errorf("audit excerpt: %w", err)
	}
	return nil
}

// distinctKey returns a record line's (decision, rule, host) key and
// whether it is a summary record. Only non-DNS lines are decoded (the log
// can hold millions of DNS records).
func distinctKey(b []byte) (key string, summary bool) {
	if !strings.Contains(string(b), `"event":"summary"`) && isDNS(b) {
		return "", false
	}
	var r struct{ Event, Decision, Rule, Host string }
	if json.Unmarshal(b, &r) != nil {
		return "", false
	}
	if r.Event == EventSummary {
		return "", true
	}
	if r.Event == EventClose {
		return "", false // its open record holds the decision
	}
	return r.Decision + "\x00" + r.Rule + "\x00" + r.Host, false
}

// isDNS reports whether a record line is a DNS query's, without a full
// decode (the log can hold millions of them).
func isDNS(b []byte) bool {
	return strings.Contains(string(b), `"method":"DNS"`)
}

// scanLines calls f with every complete line of r (without the newline);
// a partial last line (being written) is left for the next reader.
func scanLines(r io.Reader, f func([]byte)) error {
	br := bufio.NewReaderSize(r, 64<<10)
	for {
		b, err := br.ReadSlice('\n')
		if err == bufio.ErrBufferFull {
			// A line longer than the buffer: gather it whole.
			full := append([]byte(nil), b...)
			for err == bufio.ErrBufferFull {
				b, err = br.ReadSlice('\n')
				full = append(full, b...)
			}
			b = full
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return fmt.Errorf("audit: %w", err)
		}
		if len(b) > 1 {
			f(b[:len(b)-1])
		}
	}
}
