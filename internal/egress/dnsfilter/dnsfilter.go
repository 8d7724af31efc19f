// Package dnsfilter is the cage's resolver: it answers names the egress
// policy allows, for the record types the policy allows, and refuses
// everything else with REFUSED. Every query is one audit record (within
// the audit budget; beyond it, counted in summary records).
//
// Why a filter at all when all traffic goes through the proxy: DNS is itself
// an exfiltration channel (data in labels of queries for an attacker's
// zone), so names outside the policy never leave the host, and long labels
// are refused before any lookup. And the resolver never forwards what the
// agent wrote: the upstream query is the gateway's own (the normalized
// name, a fresh random ID, fixed flags, no sections of the client's), so
// letter case, IDs, flags, EDNS options and additional records carry
// nothing to the upstream resolver. What is left to an agent is the choice
// of allowed name and type, and that is rate-limited, cached and watched
// (pattern.go).
package dnsfilter

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/miekg/dns"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/egress/netguard"
	"github.com/nixcage/nixcage/internal/policy"
)

// Config is what the filter needs from the current policy; it is looked up
// per query so a reload applies to the next query.
type Config struct {
	Policy *policy.Policy
	Guard  *netguard.Guard
	// Grants are the time-bound grants in force (policy.Grant).
	Grants []policy.Grant
	// Bans are the control commands' bans for this agent: a banned name
	// is refused whatever the policy and the grants say.
	Bans []policy.Ban
	// Learning is learn mode, nil when off.
	Learning *policy.Learning
}

// Filter is a dns.Handler.
type Filter struct {
	Current  func() Config
	Upstream string // host:port of the upstream resolver
	Audit    *audit.Logger
	Timeout  time.Duration
	// Lookups is the cage's lookup budget, shared with the gateway's
	// Resolver; nil gives the filter one of its own.
	Lookups *Lookups

	once  sync.Once
	cache *cache
	watch *watcher
}

// Refusal is the one rcode for every query the policy refuses (denied or
// unlisted name, type, class, label, opcode, rate limit, DNS disabled):
// REFUSED says "this server will not answer that", which is true, where
// NXDOMAIN would claim the name does not exist (and be cached as such by
// stub resolvers). Upstream failures are SERVFAIL; the upstream's own
// answers (NXDOMAIN included) pass through.
const Refusal = dns.RcodeRefused

// Lookup rate per cage: cache misses that reach the upstream resolver,
// from the filter and the gateway's Resolver together (Lookups).
const (
	LookupsPerSecond = 50
	LookupBurst      = 200
)

// RuleRateLimit refuses a lookup beyond the cage's budget; ErrLookupRate
// says why.
const RuleRateLimit = "dns-rate-limit"

var ErrLookupRate = fmt.Errorf("more than %d lookups per second (burst %d) from this cage", LookupsPerSecond, LookupBurst)

func (f *Filter) init() {
	f.once.Do(func() {
		f.cache = newCache(cacheEntries, cacheCost)
		if f.Lookups == nil {
			f.Lookups = NewLookups()
		}
		f.watch = newWatcher()
	})
}

// TypeName is the name of a record type as policies write it.
func TypeName(t uint16) string {
	if s := dns.TypeToString[t]; s != "" {
		return s
	}
	return fmt.Sprintf("TYPE%d", t)
}

// Decide says whether a question may be answered, with reason and rule.
func Decide(p *policy.Policy, q dns.Question) (bool, string, string) {
	return DecideWithGrants(p, nil, time.Time{}, q)
}

// DecideWithGrants is Decide with the time-bound grants in force at now.
func DecideWithGrants(p *policy.Policy, grants []policy.Grant, now time.Time, q dns.Question) (bool, string, string) {
	return DecideLearning(p, nil, grants, now, q)
}

// DecideLearning is DecideWithGrants with learn mode (nil: off): an
// unlisted name is answered (rule learn); the types, labels and the
// answers' address vetting stay as they are.
func DecideLearning(p *policy.Policy, l *policy.Learning, grants []policy.Grant, now time.Time, q dns.Question) (bool, string, string) {
	name := policy.Normalize(q.Name)
	if q.Qclass != dns.ClassINET {
		return false, fmt.Sprintf("class %s refused", dns.ClassToString[q.Qclass]), "dns-class"
	}
	if why, rule, ok := CheckName(p, name); !ok {
		return false, why, rule
	}
	ok, rule := p.AllowsNameLearning(l, grants, now, name)
	if !ok {
		return false, "name " + name + " is not allowed by policy", rule
	}
	t := TypeName(q.Qtype)
	for _, d := range p.DNS.DenyTypes {
		if strings.EqualFold(d, t) {
			return false, "record type " + t + " is denied by policy", "dns-deny-type:" + t
		}
	}
	allow := p.DNS.AllowTypes
	if len(allow) == 0 {
		allow = policy.DefaultDNSAllowTypes
	}
	if !slices.ContainsFunc(allow, func(a string) bool { return strings.EqualFold(a, t) }) {
		return false, fmt.Sprintf("record type %s is not in the policy's dns allow_types %v", t, allow), "dns-type:" + t
	}
	return true, "name " + name + " allowed", rule
}

// RuleLabelLength refuses a name with a label longer than the policy's
// dns max_label_length, RuleName one that is not a host name (CheckName).
const (
	RuleLabelLength = "dns-label-length"
	RuleName        = "dns-name"
)

// CheckName says why name (normalized) must not be looked up at all, with
// the rule, or ok: a label longer than p's dns max_label_length, or not a
// host name (letters, digits, hyphens and underscores in 1 to 63 byte
// labels). Every lookup sends the name upstream, the filter's and the
// gateway's own for a CONNECT or plain HTTP request alike, so both check
// it: a CONNECT to "<data>.x.example.com" must not carry more to the
// zone's name servers than a DNS query for it could.
func CheckName(p *policy.Policy, name string) (why, rule string, ok bool) {
	maxLabel := p.DNS.MaxLabelLength
	if maxLabel <= 0 || maxLabel > policy.DefaultMaxLabelLength {
		maxLabel = policy.DefaultMaxLabelLength
	}
	for _, l := range strings.Split(name, ".") {
		if len(l) > maxLabel {
			return fmt.Sprintf("label of %d bytes exceeds %d (data smuggling)", len(l), maxLabel), RuleLabelLength, false
		}
	}
	if err := policy.CheckHostname(name); err != nil {
		return fmt.Sprintf("name %q is not a host name: %v", name, err), RuleName, false
	}
	return "", "", true
}

// ServeDNS answers one query: decide, look up (cache, rate limit, the
// gateway's own upstream query), vet the answers, reply, audit.
func (f *Filter) ServeDNS(w dns.ResponseWriter, r *dns.Msg) {
	f.init()
	start := time.Now()
	cfg := f.Current()
	rec := audit.Record{Method: "DNS", Port: 53}
	reply := func(m *dns.Msg, decision, reason, rule string) {
		rec.Decision, rec.Reason, rec.Rule = decision, reason, rule
		fitUDP(m, r, w.LocalAddr().Network())
		if b, err := m.Pack(); err == nil {
			rec.BytesIn = int64(len(b))
		}
		rec.DurationMS = time.Since(start).Milliseconds()
		_ = f.Audit.LogBudgeted(audit.ClassDNS, rec)
		_ = w.WriteMsg(m)
	}
	refuse := func(reason, rule string) {
		m := new(dns.Msg)
		m.SetRcode(r, Refusal)
		m.Extra = nil
		reply(m, audit.Blocked, reason, rule)
	}
	if b, err := r.Pack(); err == nil {
		rec.BytesOut = int64(len(b))
	}
	if r.Opcode != dns.OpcodeQuery || len(r.Question) != 1 || r.Response {
		refuse("only single-question standard queries are answered", "dns-opcode")
		return
	}
	q := r.Question[0]
	rec.Host = policy.Normalize(q.Name)
	rec.Path = TypeName(q.Qtype)
	if !cfg.Policy.DNS.Enabled {
		refuse("DNS is disabled by policy", "dns-disabled")
		return
	}
	ok, reason, rule := DecideLearning(cfg.Policy, cfg.Learning, cfg.Grants, time.Now(), q)
	if b := policy.BanFor(cfg.Bans, policy.Normalize(q.Name)); b != nil {
		d := policy.Banned(b, policy.Normalize(q.Name))
		ok, reason, rule = false, d.Reason, d.Rule
	}
	if !ok {
		refuse(reason, rule)
		return
	}
	// Watch the pattern before the cache: repeating an exfiltration name
	// from cache carries no new data, but a new name does, cached or not.
	unusual, alert := f.watch.observe(rec.Host, rule, start)
	if alert {
		_ = f.Audit.Log(audit.Record{Method: "DNS", Host: rec.Host, Port: 53, Path: rec.Path, Decision: audit.Flagged, Rule: "dns-pattern", Reason: "unusual DNS pattern from this cage: " + unusual + "; further lookups like it are flagged, this alert repeats at most once a minute per pattern"})
	}
	key := cacheKey{rec.Host, q.Qtype}
	resp, cached := f.cache.get(key, start)
	if !cached {
		if !f.Lookups.Take(start) {
			refuse(ErrLookupRate.Error(), RuleRateLimit)
			return
		}
		up, err := f.exchange(rec.Host, q.Qtype, w.LocalAddr().Network())
		if err != nil {
			m := new(dns.Msg)
			m.SetRcode(r, dns.RcodeServerFailure)
			reply(m, audit.Blocked, "upstream resolver: "+err.Error(), "dns-upstream")
			return
		}
		resp = vetAnswer(up, cfg.Guard)
		if !resp.truncated {
			f.cache.put(key, resp, start)
		}
	}
	// The chain is judged at every reply, cached or not: a ban issued
	// while the answer is cached applies to the next query.
	if d, refused := resp.chain.Refused(ChainDeny(cfg.Policy, cfg.Learning, rule), cfg.Bans); refused {
		refuse(d.Reason, d.Rule)
		return
	}
	m := resp.reply(r)
	decision := audit.Allowed
	var notes []string
	if cached {
		notes = append(notes, "from cache")
	}
	if vn, flag := resp.notes(); len(vn) > 0 {
		notes = append(notes, vn...)
		if flag {
			decision = audit.Flagged
		}
	}
	if unusual != "" {
		decision = audit.Flagged
		notes = append(notes, unusual)
	}
	if rule == policy.RuleLearn {
		decision = audit.Flagged
		notes = append(notes, "learn mode: outside the policy, answered and flagged")
	}
	if len(notes) > 0 {
		reason += "; " + strings.Join(notes, "; ")
	}
	reply(m, decision, reason, rule)
}

// upstreamQuery is the only message the filter sends upstream: built from
// the decided name and type alone. A fresh ID from crypto/rand (dns.Id),
// RD set and every other flag clear, one question in lower case, and a
// fixed EDNS0 record (1232-byte UDP size, no options, DO clear). Nothing of
// the client's message (ID, case, flags, EDNS options, additional records)
// survives into it.
func upstreamQuery(name string, qtype uint16) *dns.Msg {
	m := new(dns.Msg)
	m.Id = dns.Id()
	m.RecursionDesired = true
	m.Question = []dns.Question{{Name: dns.Fqdn(name), Qtype: qtype, Qclass: dns.ClassINET}}
	m.SetEdns0(upstreamUDPSize, false)
	return m
}

const upstreamUDPSize = 1232

func (f *Filter) exchange(name string, qtype uint16, network string) (*dns.Msg, error) {
	timeout := f.Timeout
	if timeout == 0 {
		timeout = 5 * time.Second
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	q := upstreamQuery(name, qtype)
	c := &dns.Client{Net: "udp", Timeout: timeout, UDPSize: upstreamUDPSize}
	resp, _, err := c.ExchangeContext(ctx, q, f.Upstream)
	if err == nil && resp.Truncated {
		// The gateway retries over TCP itself; the client gets a whole
		// answer or, over UDP, a truncated one it may retry over TCP.
		c.Net = "tcp"
		resp, _, err = c.ExchangeContext(ctx, q, f.Upstream)
	}
	if err != nil {
		return nil, err
	}
	if resp.Id != q.Id || len(resp.Question) != 1 || !strings.EqualFold(resp.Question[0].Name, q.Question[0].Name) || resp.Question[0].Qtype != qtype {
		return nil, fmt.Errorf("upstream answer does not match the query")
	}
	return resp, nil
}

// answer is a vetted upstream answer, ready to be replayed from cache.
type answer struct {
	rcode     int
	rrs       [][]dns.RR // answer, authority
	chain     Chain      // checked against bans and deny entries per reply
	dropped   []string   // address classes dropped
	droppedN  int
	stray     int      // answer records outside the question's chain, dropped
	offType   int      // answer records of another type than the question's, dropped
	stripped  []string // SvcParam keys stripped from HTTPS/SVCB records
	svcbN     int      // HTTPS/SVCB records stripped or dropped
	truncated bool
	ttl       time.Duration
}

// vetAnswer keeps the answer and authority sections (no additional
// section: nothing the cage needs, and glue for names it may not ask
// about). From the answer section it keeps only the records of the
// question's chain (chain.go) and of the question's type (or CNAME and
// DNAME, the chain's own), drops A/AAAA records pointing at addresses
// the proxy would refuse (the cage cannot use them, and they are the DNS
// half of a rebinding attack) and strips HTTPS/SVCB records to what a
// client behind the gateway uses (svcb.go). The authority section keeps
// only SOA and NS records: what negative answers and referrals carry.
func vetAnswer(m *dns.Msg, guard *netguard.Guard) *answer {
	a := &answer{rcode: m.Rcode, truncated: m.Truncated}
	chain, inChain, stray := FollowChain(m.Question[0].Name, m.Answer)
	a.chain, a.stray = chain, stray
	kept := []dns.RR{}
	qtype := m.Question[0].Qtype
	for _, rr := range inChain {
		if t := rr.Header().Rrtype; t != qtype && t != dns.TypeCNAME && t != dns.TypeDNAME && qtype != dns.TypeANY {
			// An answer to an A question carries A records and the
			// chain: a TXT (or any other) record beside them is an
			// answer of a type the agent did not ask for, and maybe
			// one its policy refuses.
			a.offType++
			continue
		}
		var ip net.IP
		switch x := rr.(type) {
		case *dns.A:
			ip = x.A
		case *dns.AAAA:
			ip = x.AAAA
		}
		if ip != nil {
			if addr, ok := netip.AddrFromSlice(ip); ok {
				if c, err := guard.Check(addr); err != nil {
					a.dropped = append(a.dropped, string(c))
					a.droppedN++
					continue
				}
			}
		}
		if s := serviceBinding(rr); s != nil {
			stripped, refused, drop := vetServiceBinding(s, guard)
			a.stripped = append(a.stripped, stripped...)
			a.dropped = append(a.dropped, refused...)
			a.droppedN += len(refused)
			if len(stripped) > 0 {
				a.svcbN++
			}
			if drop {
				continue
			}
		}
		kept = append(kept, rr)
	}
	slices.Sort(a.dropped)
	a.dropped = slices.Compact(a.dropped)
	slices.Sort(a.stripped)
	a.stripped = slices.Compact(a.stripped)
	ns := []dns.RR{}
	for _, rr := range m.Ns {
		switch rr.(type) {
		case *dns.SOA, *dns.NS:
			ns = append(ns, rr)
		}
	}
	a.rrs = [][]dns.RR{kept, ns}
	a.ttl = minTTL(a.rrs)
	return a
}

// notes are what vetting changed, for the audit record's reason; flag is
// whether one of them is a sign of rebinding or smuggling.
func (a *answer) notes() (notes []string, flag bool) {
	if len(a.dropped) > 0 {
		notes = append(notes, fmt.Sprintf("dropped %d answers pointing at %s addresses", a.droppedN, strings.Join(a.dropped, ",")))
		flag = true
	}
	if a.stray > 0 {
		notes = append(notes, fmt.Sprintf("dropped %d answer records for names outside the question's chain", a.stray))
		flag = true
	}
	if a.offType > 0 {
		notes = append(notes, fmt.Sprintf("dropped %d answer records of types other than the question's", a.offType))
		flag = true
	}
	if len(a.stripped) > 0 {
		notes = append(notes, fmt.Sprintf("stripped %s from %d HTTPS/SVCB records", strings.Join(a.stripped, ","), a.svcbN))
	}
	if len(a.chain.Aliases) > 0 {
		notes = append(notes, "via "+strings.Join(a.chain.Aliases, ", "))
	}
	return notes, flag
}

// reply is the answer to client message r (the cache has counted its TTLs
// down already).
func (a *answer) reply(r *dns.Msg) *dns.Msg {
	m := new(dns.Msg)
	m.SetReply(r)
	m.Rcode = a.rcode
	m.RecursionAvailable = true
	m.Truncated = a.truncated
	sections := []*[]dns.RR{&m.Answer, &m.Ns}
	for i, rrs := range a.rrs {
		for _, rr := range rrs {
			*sections[i] = append(*sections[i], dns.Copy(rr))
		}
	}
	return m
}

// fitUDP keeps a UDP reply within what the client can take (512 bytes, or
// its EDNS0 size), setting TC so it retries over TCP; the client's EDNS
// options are never echoed.
func fitUDP(m, r *dns.Msg, network string) {
	m.Extra = nil
	if network != "udp" {
		return
	}
	size := dns.MinMsgSize
	if o := r.IsEdns0(); o != nil {
		size = int(min(max(o.UDPSize(), dns.MinMsgSize), upstreamUDPSize))
		m.SetEdns0(uint16(size), false)
	}
	m.Truncate(size)
}
