package dnsfilter

import (
	"sync"
	"time"

	"github.com/miekg/dns"

	"github.com/nixcage/nixcage/internal/egress/ratelimit"
)

// The cache answers a repeated question within its TTL without a new
// upstream query: the upstream resolver sees each name and type at most
// once per TTL, however often the agent asks. Bounded in entries and TTL.
const (
	cacheEntries = 4096
	maxCacheTTL  = 5 * time.Minute
)

type cacheKey struct {
	name  string
	qtype uint16
}

type entry struct {
	a       *answer
	stored  time.Time
	expires time.Time
}

type cache struct {
	mu  sync.Mutex
	max int
	m   map[cacheKey]entry
}

func newCache(max int) *cache { return &cache{max: max, m: map[cacheKey]entry{}} }

// get returns a copy of the cached answer with TTLs counted down.
func (c *cache) get(k cacheKey, now time.Time) (*answer, bool) {
	c.mu.Lock()
	e, ok := c.m[k]
	if ok && !now.Before(e.expires) {
		delete(c.m, k)
		ok = false
	}
	c.mu.Unlock()
	if !ok {
		return nil, false
	}
	age := uint32(now.Sub(e.stored) / time.Second)
	a := *e.a
	a.rrs = make([][]dns.RR, len(e.a.rrs))
	for i, rrs := range e.a.rrs {
		for _, rr := range rrs {
			rr = dns.Copy(rr)
			h := rr.Header()
			h.Ttl = max(h.Ttl, age) - age
			a.rrs[i] = append(a.rrs[i], rr)
		}
	}
	return &a, true
}

func (c *cache) put(k cacheKey, a *answer, now time.Time) {
	ttl := min(a.ttl, maxCacheTTL)
	if ttl <= 0 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.m) >= c.max {
		for key, e := range c.m {
			if !now.Before(e.expires) || len(c.m) >= c.max {
				delete(c.m, key)
			}
			if len(c.m) < c.max*3/4 {
				break
			}
		}
	}
	c.m[k] = entry{a: a, stored: now, expires: now.Add(ttl)}
}

// minTTL is how long an answer may be cached: its smallest TTL, and for a
// negative answer the SOA's (RFC 2308: the smaller of its TTL and MINIMUM).
func minTTL(sections [][]dns.RR) time.Duration {
	var ttl uint32
	first := true
	for _, rrs := range sections {
		for _, rr := range rrs {
			t := rr.Header().Ttl
			if soa, ok := rr.(*dns.SOA); ok {
				t = min(t, soa.Minttl)
			}
			if first || t < ttl {
				ttl, first = t, false
			}
		}
	}
	return time.Duration(ttl) * time.Second
}

// Lookups is a cage's budget of upstream lookups (ratelimit.Bucket under a
// lock). The DNS filter and the gateway's Resolver share one: a name the
// agent has the gateway look up for a CONNECT or plain HTTP request reaches
// the upstream resolver just as a DNS query does, and carries as much data
// in its labels.
type Lookups struct {
	mu sync.Mutex
	b  *ratelimit.Bucket
}

// NewLookups is a budget of LookupsPerSecond, burst LookupBurst.
func NewLookups() *Lookups { return &Lookups{b: ratelimit.New(LookupsPerSecond, LookupBurst)} }

// Take spends one lookup, or says the budget is spent.
func (b *Lookups) Take(now time.Time) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Take(now)
}
