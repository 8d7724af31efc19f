// Package suggest turns an agent's audit records into the egress policy
// entries that would have allowed what was refused (`cagectl policy
// suggest`). It proposes only what a policy can allow: never an address
// (IP literals, names that resolved to private or metadata addresses), never
// a name a deny entry covers (the agent's own or a shipped policy's), never a
// special-use name; and it marks every entry a reviewer should look at twice.
package suggest

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/nixcage/nixcage/internal/auditlog"
	"github.com/nixcage/nixcage/internal/policy"
)

// Thresholds of the warnings. An entry is "upload-heavy" when the cage sent
// the host more than UploadBytes in the window and more than UploadRatio
// times what it received: the shape of exfiltration, and of a backup job.
const (
	UploadBytes = 1 << 20
	UploadRatio = 4
	// WildcardSiblings distinct names under one parent of at least
	// WildcardMinLabels labels become one "*.parent" entry (with a warning):
	// CDNs and object stores shard names; a list of forty shards is noise.
	WildcardSiblings  = 4
	WildcardMinLabels = 3
)

// Options select and judge records.
type Options struct {
	// Since drops records before it (zero: all).
	Since time.Time
	// Denies are patterns never to suggest (the agent's policy is already
	// known to refuse them via deny:* rules; these are the shipped lists).
	Denies []string
	// Forbidden, if set, says why the gateway would refuse host by its
	// addresses ("" when it would not): a name that resolves to a private,
	// loopback or metadata address is never suggested, though the audit
	// only shows it refused as not allowed (the policy check comes first).
	Forbidden func(host string) string
}

// Resolved returns a Forbidden check that resolves host with lookup and
// refuses any address bad reports on (a resolution failure is not a
// refusal: the host may resolve only from the cage's resolver).
func Resolved(lookup func(host string) ([]netip.Addr, error), bad func(netip.Addr) string) func(string) string {
	return func(host string) string {
		addrs, err := lookup(host)
		if err != nil {
			return ""
		}
		for _, a := range addrs {
			if why := bad(a.Unmap()); why != "" {
				return fmt.Sprintf("resolves to %s (%s), which the gateway always refuses", a, why)
			}
		}
		return ""
	}
}

// cgnat is RFC 6598 shared address space, which netip has no predicate for.
var cgnat = netip.MustParsePrefix("100.64.0.0/10")

// StdBad is a conservative address check for cagectl, which must not link
// the gateway: loopback, private, CGNAT, link-local (metadata), multicast
// and unspecified addresses. The gateway's netguard stays the authority; this
// only keeps such names out of a suggestion.
func StdBad(a netip.Addr) string {
	switch {
	case a.IsLoopback():
		return "loopback"
	case a.IsPrivate() || cgnat.Contains(a):
		return "private"
	case a.IsLinkLocalUnicast():
		return "link-local or metadata"
	case a.IsMulticast() || a.IsLinkLocalMulticast() || a.IsInterfaceLocalMulticast():
		return "multicast"
	case a.IsUnspecified() || !a.IsValid():
		return "unspecified"
	}
	return ""
}

// Entry is one suggested host.
type Entry struct {
	Pattern     string
	Requests    int // refused proxy requests (CONNECT and plain HTTP)
	Lookups     int // refused DNS lookups
	Ports       []int
	First, Last string // RFC 3339 times of the first and last record
	BytesOut    int64
	BytesIn     int64
	Names       []string // for a wildcard: the names seen
	Warnings    []string
}

// Skipped is a refused host that is not suggested, and why.
type Skipped struct {
	Host, Why string
	Count     int
}

// Suggestion is the result.
type Suggestion struct {
	Agent   string
	Entries []Entry
	// Ports beyond the defaults (80 for HTTP, 443 for CONNECT) the entries need.
	Ports   []int
	Skipped []Skipped
	Records int // records read in the window
}

type hostAcc struct{ Entry }

// Build reads records (JSONL lines) and returns the suggestion.
func Build(agent string, lines []string, o Options) *Suggestion {
	s := &Suggestion{Agent: agent}
	acc := map[string]*hostAcc{}
	skip := map[string]*Skipped{}
	// Traffic per host over every record, refused or not, for the warnings.
	out, in := map[string]int64{}, map[string]int64{}
	placeholder := map[string]bool{}
	get := func(h string) *hostAcc {
		a := acc[h]
		if a == nil {
			a = &hostAcc{Entry: Entry{Pattern: h}}
			acc[h] = a
		}
		return a
	}
	for _, line := range lines {
		r, ok := parse(line)
		if !ok || (!o.Since.IsZero() && before(r.TS, o.Since)) {
			continue
		}
		s.Records++
		host := policy.Normalize(r.Host)
		out[host] += r.BytesOut
		in[host] += r.BytesIn
		if strings.HasPrefix(r.Rule, "placeholder:") {
			placeholder[host] = true
		}
		// A decision learn mode let through (rule learn, flagged) is one
		// the policy refused: a learn run is read as a refused run. Its
		// tunnel's close record repeats the open one.
		learned := r.Rule == policy.RuleLearn && r.Event != auditlog.EventClose
		if (r.Decision != auditlog.Blocked && !learned) || host == "" {
			continue
		}
		// Only what the host patterns and ports refused: content, SNI,
		// rate and cap refusals are not something an allow entry fixes.
		if !learned && r.Rule != "default-deny" && r.Rule != "port" && r.Rule != "ip-literal" && r.Rule != "address" && !strings.HasPrefix(r.Rule, "deny:") {
			continue
		}
		if why := refuseReason(host, r.Rule, o.Denies); why != "" {
			k := skip[host]
			if k == nil {
				k = &Skipped{Host: host, Why: why}
				skip[host] = k
			}
			k.Count++
			continue
		}
		a := get(host)
		if r.Method == "DNS" {
			a.Lookups++
		} else {
			a.Requests++
			def := policy.DefaultHTTPPort
			if r.Method == "CONNECT" {
				def = policy.DefaultConnectPort
			}
			if r.Port != 0 && r.Port != def && !slices.Contains(a.Ports, r.Port) {
				a.Ports = append(a.Ports, r.Port)
			}
		}
		if a.First == "" || r.TS < a.First {
			a.First = r.TS
		}
		if r.TS > a.Last {
			a.Last = r.TS
		}
	}
	// A name that was also refused as an address (it resolved to a private
	// or metadata address) is never suggested: the gateway refuses it anyway.
	if o.Forbidden != nil {
		for h, a := range acc {
			if why := o.Forbidden(h); why != "" {
				skip[h] = &Skipped{Host: h, Why: why, Count: a.Requests + a.Lookups}
				delete(acc, h)
			}
		}
	}
	for h, k := range skip {
		if a := acc[h]; a != nil {
			k.Count += a.Requests + a.Lookups
			delete(acc, h)
		}
	}
	for h, a := range acc {
		a.BytesOut, a.BytesIn = out[h], in[h]
	}
	s.Entries = collapse(acc)
	for i := range s.Entries {
		e := &s.Entries[i]
		e.Warnings = warnings(e, placeholder)
		for _, p := range e.Ports {
			if !slices.Contains(s.Ports, p) {
				s.Ports = append(s.Ports, p)
			}
		}
	}
	sort.Ints(s.Ports)
	for _, k := range skip {
		s.Skipped = append(s.Skipped, *k)
	}
	sort.Slice(s.Skipped, func(i, j int) bool { return s.Skipped[i].Host < s.Skipped[j].Host })
	return s
}

func parse(line string) (auditlog.Record, bool) {
	var r auditlog.Record
	if err := json.Unmarshal([]byte(line), &r); err != nil {
		return r, false
	}
	return r, true
}

func before(ts string, t time.Time) bool {
	x, err := time.Parse(time.RFC3339Nano, ts)
	return err != nil || x.Before(t)
}

// refuseReason says why host must never be suggested, or "".
func refuseReason(host, rule string, denies []string) string {
	switch {
	case rule == "ip-literal" || isAddress(host):
		return "an IP address: policies name hosts, the gateway never allows addresses"
	case rule == "address":
		return "resolved to a private, loopback or metadata address, which the gateway always refuses"
	case strings.HasPrefix(rule, "deny:"):
		return "denied by the agent's policy (" + strings.TrimPrefix(rule, "deny:") + ")"
	}
	if d := policy.MatchDeny(denies, host); d != "" {
		return "covered by a shipped policy's deny list (" + d + ")"
	}
	if why := policy.SpecialUse(host); why != "" {
		return why
	}
	if err := policy.CheckPattern(host); err != nil {
		return "not a host name a policy can allow"
	}
	return ""
}

func isAddress(h string) bool {
	// CheckPattern calls anything ending in a numeric label an address.
	err := policy.CheckPattern(h)
	return err != nil && strings.Contains(err.Error(), "IP address")
}

// collapse merges WildcardSiblings or more names under one parent of at
// least WildcardMinLabels labels into "*.parent", and sorts the result.
func collapse(acc map[string]*hostAcc) []Entry {
	byParent := map[string][]string{}
	for h := range acc {
		if i := strings.IndexByte(h, '.'); i > 0 {
			p := h[i+1:]
			if strings.Count(p, ".")+1 >= WildcardMinLabels {
				byParent[p] = append(byParent[p], h)
			}
		}
	}
	var out []Entry
	done := map[string]bool{}
	parents := make([]string, 0, len(byParent))
	for p := range byParent {
		parents = append(parents, p)
	}
	sort.Strings(parents)
	for _, p := range parents {
		names := byParent[p]
		if len(names) < WildcardSiblings {
			continue
		}
		sort.Strings(names)
		w := Entry{Pattern: "*." + p, Names: names}
		for _, n := range names {
			a := acc[n]
			done[n] = true
			w.Requests += a.Requests
			w.Lookups += a.Lookups
			w.BytesOut += a.BytesOut
			w.BytesIn += a.BytesIn
			for _, port := range a.Ports {
				if !slices.Contains(w.Ports, port) {
					w.Ports = append(w.Ports, port)
				}
			}
			if w.First == "" || a.First < w.First {
				w.First = a.First
			}
			if a.Last > w.Last {
				w.Last = a.Last
			}
		}
		out = append(out, w)
	}
	for h, a := range acc {
		if !done[h] {
			out = append(out, a.Entry)
		}
	}
	for i := range out {
		sort.Ints(out[i].Ports)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Pattern < out[j].Pattern })
	return out
}

func warnings(e *Entry, placeholder map[string]bool) []string {
	var w []string
	if strings.HasPrefix(e.Pattern, "*.") {
		w = append(w, fmt.Sprintf("wildcard: allows every name under %s, not only the %d seen (%s)", strings.TrimPrefix(e.Pattern, "*."), len(e.Names), strings.Join(e.Names, ", ")))
	}
	if e.BytesOut > UploadBytes && e.BytesOut > UploadRatio*e.BytesIn {
		w = append(w, fmt.Sprintf("upload-heavy: the cage sent %d bytes and received %d", e.BytesOut, e.BytesIn))
	}
	names := e.Names
	if len(names) == 0 {
		names = []string{e.Pattern}
	}
	for _, n := range names {
		if placeholder[n] {
			w = append(w, "received a secret's placeholder ("+n+"): the agent tried to send a credential there")
		}
	}
	return w
}

// HCL renders the suggestion as an egress_policy block named name. Every
// string that came from the audit is a checked host pattern, so nothing the
// cage chose can break out of the quoted list or the comments.
func (s *Suggestion) HCL(name string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "# Suggested by `cagectl policy suggest %s` from %d audit records.\n", s.Agent, s.Records)
	b.WriteString("# Each entry was refused; review it before adding it to the agent's policy\n")
	b.WriteString("# (merge allow and ports into the policy the agent uses, or name this one).\n")
	for _, k := range s.Skipped {
		fmt.Fprintf(&b, "# not suggested: %s (%d refusals): %s\n", auditlog.Escape(k.Host), k.Count, k.Why)
	}
	fmt.Fprintf(&b, "egress_policy %s {\n", strconv.Quote(name))
	b.WriteString("  allow = [\n")
	for _, e := range s.Entries {
		fmt.Fprintf(&b, "    # %d requests, %d DNS lookups; first %s, last %s", e.Requests, e.Lookups, auditlog.Escape(e.First), auditlog.Escape(e.Last))
		if len(e.Ports) > 0 {
			fmt.Fprintf(&b, "; ports %v", e.Ports)
		}
		b.WriteString("\n")
		for _, w := range e.Warnings {
			fmt.Fprintf(&b, "    # WARNING: %s\n", w)
		}
		fmt.Fprintf(&b, "    %s,\n", strconv.Quote(e.Pattern))
	}
	b.WriteString("  ]\n")
	if len(s.Ports) > 0 {
		ps := make([]string, len(s.Ports))
		for i, p := range s.Ports {
			ps[i] = strconv.Itoa(p)
		}
		// 80 (HTTP) and 443 (CONNECT) are always allowed; these are extra.
		fmt.Fprintf(&b, "  ports = [%s]\n", strings.Join(ps, ", "))
	}
	b.WriteString("}\n")
	return b.String()
}
