package dnsfilter

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/miekg/dns"
)

// Resolver looks names up at one DNS server, with no /etc/hosts and no
// search list: the gateway's view of a name is what the upstream resolver
// says, which is also what the cage's DNS filter serves. Answers are reused
// within their TTL (at most maxCacheTTL, never with TTL 0), so a new tunnel
// to a name seen a moment ago costs no DNS round trip; the caller still
// classifies every address it gets, and the dial's Control hook checks the
// one it connects to, so a reused answer is vetted exactly like a fresh one.
// Only the addresses of the name's own chain count (chain.go), and the
// chain's aliases are returned with them (LookupChain) for the gateway to
// judge against its bans and deny entries.
type Resolver struct {
	Server  string // host:port
	Timeout time.Duration
	// Lookups, when set, is the cage's lookup budget (the DNS filter's):
	// a name not in the cache takes one lookup or fails with
	// ErrLookupRate, so names the agent has the gateway resolve are
	// bounded like the names it asks the filter for.
	Lookups *Lookups

	mu      sync.Mutex
	answers map[string]addrEntry
}

type addrEntry struct {
	addrs   []netip.Addr
	aliases []string
	expires time.Time
}

// cached returns host's answer if it is still within its TTL.
func (r *Resolver) cached(host string, now time.Time) (addrEntry, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	e, ok := r.answers[host]
	if !ok {
		return addrEntry{}, false
	}
	if !now.Before(e.expires) {
		delete(r.answers, host)
		return addrEntry{}, false
	}
	return e, true
}

// maxCachedAddrs bounds an entry of the Resolver's cache: an upstream can
// answer with thousands of addresses per name (4096 entries of 8000 would
// be 800 MB); real names have a few, and a larger answer is looked up
// again (within the lookup budget) rather than held.
const maxCachedAddrs = 64

// remember stores an answer for ttl; the map is bounded like the DNS
// filter's cache (expired entries go first, then arbitrary ones).
func (r *Resolver) remember(host string, e addrEntry, ttl time.Duration, now time.Time) {
	ttl = min(ttl, maxCacheTTL)
	if ttl <= 0 || len(e.addrs) > maxCachedAddrs {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.answers == nil {
		r.answers = map[string]addrEntry{}
	}
	if len(r.answers) >= cacheEntries {
		for k, e := range r.answers {
			if !now.Before(e.expires) || len(r.answers) >= cacheEntries {
				delete(r.answers, k)
			}
			if len(r.answers) < cacheEntries*3/4 {
				break
			}
		}
	}
	e.expires = now.Add(ttl)
	r.answers[host] = e
}

// LookupNetIP returns the A and AAAA addresses of host (network is ignored:
// the gateway classifies every address of both families).
func (r *Resolver) LookupNetIP(ctx context.Context, _, host string) ([]netip.Addr, error) {
	addrs, _, err := r.LookupChain(ctx, host)
	return addrs, err
}

// LookupChain is LookupNetIP with the aliases the A and AAAA answers went
// through (both chains, each alias once, in order).
func (r *Resolver) LookupChain(ctx context.Context, host string) ([]netip.Addr, []string, error) {
	now := time.Now()
	if e, ok := r.cached(host, now); ok {
		return e.addrs, e.aliases, nil
	}
	if r.Lookups != nil && !r.Lookups.Take(now) {
		return nil, nil, ErrLookupRate
	}
	timeout := r.Timeout
	if timeout == 0 {
		timeout = 5 * time.Second
	}
	type res struct {
		addrs   []netip.Addr
		aliases []string
		ttl     time.Duration
		err     error
	}
	// A and AAAA in parallel: one goroutine for AAAA, A on this one, so a
	// lookup costs one round trip and one hand-off.
	ch := make(chan res, 1)
	go func() {
		a, al, ttl, err := r.query(ctx, host, dns.TypeAAAA, timeout)
		ch <- res{a, al, ttl, err}
	}()
	a4, aliases, ttl, err4 := r.query(ctx, host, dns.TypeA, timeout)
	x := <-ch
	addrs := append(a4, x.addrs...)
	for _, al := range x.aliases {
		if !slices.Contains(aliases, al) {
			aliases = append(aliases, al)
		}
	}
	errs := []error{}
	for _, err := range []error{err4, x.err} {
		if err != nil {
			errs = append(errs, err)
		}
	}
	if x.ttl >= 0 && (ttl < 0 || x.ttl < ttl) {
		ttl = x.ttl
	}
	if len(addrs) == 0 {
		if len(errs) > 0 {
			return nil, aliases, errors.Join(errs...)
		}
		return nil, aliases, fmt.Errorf("no A or AAAA records for %s", host)
	}
	// Only a complete answer (both types answered) is reused.
	if len(errs) == 0 {
		r.remember(host, addrEntry{addrs: addrs, aliases: aliases}, ttl, now)
	}
	return addrs, aliases, nil
}

// query asks for one type; ttl is the smallest TTL among the answers, -1
// if there are none (an empty type does not shorten the other's TTL).
// Addresses are those of host's own chain.
func (r *Resolver) query(ctx context.Context, host string, qt uint16, timeout time.Duration) ([]netip.Addr, []string, time.Duration, error) {
	m := new(dns.Msg)
	m.SetQuestion(dns.Fqdn(host), qt)
	m.RecursionDesired = true
	c := &dns.Client{Net: "udp", Timeout: timeout}
	resp, _, err := c.ExchangeContext(ctx, m, r.Server)
	if err == nil && resp.Truncated {
		c.Net = "tcp"
		resp, _, err = c.ExchangeContext(ctx, m, r.Server)
	}
	if err != nil {
		return nil, nil, -1, fmt.Errorf("%s %s: %w", dns.TypeToString[qt], host, err)
	}
	chain, inChain, _ := FollowChain(host, resp.Answer)
	if resp.Rcode != dns.RcodeSuccess {
		return nil, chain.Aliases, -1, fmt.Errorf("%s %s: %s", dns.TypeToString[qt], host, dns.RcodeToString[resp.Rcode])
	}
	var out []netip.Addr
	ttl := time.Duration(-1)
	for _, rr := range inChain {
		if t := time.Duration(rr.Header().Ttl) * time.Second; ttl < 0 || t < ttl {
			ttl = t
		}
		switch a := rr.(type) {
		case *dns.A:
			if ip, ok := netip.AddrFromSlice(a.A); ok {
				out = append(out, ip.Unmap())
			}
		case *dns.AAAA:
			if ip, ok := netip.AddrFromSlice(a.AAAA); ok {
				out = append(out, ip)
			}
		}
	}
	return out, chain.Aliases, ttl, nil
}
