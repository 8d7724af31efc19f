// Package dnsfilter is the cage's resolver: it answers names the egress
// policy allows, for every record type except the policy's deny_types, from
// the upstream resolver, and refuses everything else. Every query is one
// audit record.
//
// Why a filter at all when all traffic goes through the proxy: DNS is itself
// an exfiltration channel (data in labels of queries for an attacker's
// zone), so names outside the policy never leave the host, and long labels
// are refused before any lookup.
package dnsfilter

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"
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
}

// Filter is a dns.Handler.
type Filter struct {
	Current  func() Config
	Upstream string // host:port of the upstream resolver
	Audit    *audit.Logger
	Timeout  time.Duration
}

// Decide says whether a question may be forwarded, with reason and rule.
func Decide(p *policy.Policy, q dns.Question) (bool, string, string) {
	name := policy.Normalize(q.Name)
	if q.Qclass != dns.ClassINET {
		return false, fmt.Sprintf("class %s refused", dns.ClassToString[q.Qclass]), "dns-class"
	}
	maxLabel := p.DNS.MaxLabelLength
	if maxLabel <= 0 || maxLabel > policy.DefaultMaxLabelLength {
		maxLabel = policy.DefaultMaxLabelLength
	}
	for _, l := range strings.Split(name, ".") {
		if len(l) > maxLabel {
			return false, fmt.Sprintf("label of %d bytes exceeds %d (data smuggling)", len(l), maxLabel), "dns-label-length"
		}
	}
	if err := policy.CheckHostname(name); err != nil {
		return false, fmt.Sprintf("name %q is not a host name: %v", name, err), "dns-name"
	}
	ok, rule := p.AllowsName(name)
	if !ok {
		return false, "name " + name + " is not allowed by policy", rule
	}
	t := dns.TypeToString[q.Qtype]
	if t == "" {
		t = fmt.Sprintf("TYPE%d", q.Qtype)
	}
	for _, d := range p.DNS.DenyTypes {
		if strings.EqualFold(d, t) {
			return false, "record type " + t + " is denied by policy", "dns-deny-type:" + t
		}
	}
	return true, "name " + name + " allowed", rule
}

// ServeDNS answers one query.
func (f *Filter) ServeDNS(w dns.ResponseWriter, r *dns.Msg) {
	start := time.Now()
	cfg := f.Current()
	rec := audit.Record{Method: "DNS", Port: 53}
	reply := func(m *dns.Msg, decision, reason, rule string) {
		rec.Decision, rec.Reason, rec.Rule = decision, reason, rule
		if b, err := m.Pack(); err == nil {
			rec.BytesIn = int64(len(b))
		}
		rec.DurationMS = time.Since(start).Milliseconds()
		_ = f.Audit.LogBudgeted(audit.ClassDNS, rec)
		_ = w.WriteMsg(m)
	}
	if b, err := r.Pack(); err == nil {
		rec.BytesOut = int64(len(b))
	}
	if r.Opcode != dns.OpcodeQuery || len(r.Question) != 1 || r.Response {
		m := new(dns.Msg)
		m.SetRcode(r, dns.RcodeRefused)
		reply(m, audit.Blocked, "only single-question standard queries are answered", "dns-opcode")
		return
	}
	q := r.Question[0]
	rec.Host = policy.Normalize(q.Name)
	rec.Path = dns.TypeToString[q.Qtype]
	if !cfg.Policy.DNS.Enabled {
		m := new(dns.Msg)
		m.SetRcode(r, dns.RcodeRefused)
		reply(m, audit.Blocked, "DNS is disabled by policy", "dns-disabled")
		return
	}
	ok, reason, rule := Decide(cfg.Policy, q)
	if !ok {
		m := new(dns.Msg)
		m.SetRcode(r, dns.RcodeRefused)
		reply(m, audit.Blocked, reason, rule)
		return
	}
	resp, err := f.exchange(r, w.LocalAddr().Network())
	if err != nil {
		m := new(dns.Msg)
		m.SetRcode(r, dns.RcodeServerFailure)
		reply(m, audit.Blocked, "upstream resolver: "+err.Error(), "dns-upstream")
		return
	}
	resp.Id = r.Id
	decision := audit.Allowed
	// Drop answers pointing at addresses the proxy would refuse: the cage
	// cannot use them, and they are the DNS half of a rebinding attack.
	kept := resp.Answer[:0]
	var dropped []string
	for _, rr := range resp.Answer {
		var ip net.IP
		switch a := rr.(type) {
		case *dns.A:
			ip = a.A
		case *dns.AAAA:
			ip = a.AAAA
		}
		if ip != nil {
			if addr, ok := netip.AddrFromSlice(ip); ok {
				if c, err := cfg.Guard.Check(addr); err != nil {
					dropped = append(dropped, string(c))
					continue
				}
			}
		}
		kept = append(kept, rr)
	}
	resp.Answer = kept
	if len(dropped) > 0 {
		slices.Sort(dropped)
		decision, reason = audit.Flagged, fmt.Sprintf("%s; dropped %d answers pointing at %s addresses", reason, len(dropped), strings.Join(slices.Compact(dropped), ","))
	}
	reply(resp, decision, reason, rule)
}

func (f *Filter) exchange(r *dns.Msg, network string) (*dns.Msg, error) {
	timeout := f.Timeout
	if timeout == 0 {
		timeout = 5 * time.Second
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	q := r.Copy()
	// Same transport as the client: a truncated UDP answer goes back
	// truncated and the client retries over TCP, as it would with any resolver.
	proto := "udp"
	if network == "tcp" {
		proto = "tcp"
	}
	c := &dns.Client{Net: proto, Timeout: timeout}
	resp, _, err := c.ExchangeContext(ctx, q, f.Upstream)
	return resp, err
}
