package dnsfilter

import (
	"sync"
	"time"

	"github.com/miekg/dns"

	"github.com/nixcage/nixcage/internal/egress/ratelimit"
)

// The cache answers a repeated question within its TTL without a new
// upstream query: the upstream resolver sees each name and type at most
// once per TTL, however often the agent asks. Bounded in entries and TTL,
// and in size: an upstream (or the owner of an allowed zone) can answer
// each of 4096 names with 64 KiB of records, about 700 KiB each once
// parsed, which would hold gigabytes in a gateway limited to 512 MiB. So
// each entry costs its records' wire size plus recordCost each, the cache
// holds at most cacheCost, and an answer costing more than a sixteenth of
// that is not cached at all (it is asked upstream again, within the lookup
// budget). Real answers cost a few hundred bytes.
const (
	cacheEntries = 4096
	maxCacheTTL  = 5 * time.Minute
	cacheCost    = 8 << 20
	recordCost   = 160 // a parsed record's header, slices and strings
)

// answerCost is what a's records hold in memory, roughly.
func answerCost(rrs [][]dns.RR) int {
	n := 0
	for _, s := range rrs {
		for _, rr := range s {
			n += dns.Len(rr) + recordCost
		}
	}
	return n
}

type cacheKey struct {
	name  string
	qtype uint16
}

type entry struct {
	a       *answer
	stored  time.Time
	expires time.Time
	cost    int
}

type cache struct {
	mu      sync.Mutex
	max     int
	maxCost int
	cost    int // of the entries in m
	m       map[cacheKey]entry
}

func newCache(max, maxCost int) *cache {
	return &cache{max: max, maxCost: maxCost, m: map[cacheKey]entry{}}
}

// drop removes k's entry (the lock held).
func (c *cache) drop(k cacheKey) {
	if e, ok := c.m[k]; ok {
		c.cost -= e.cost
		delete(c.m, k)
	}
}

// get returns a copy of the cached answer with TTLs counted down.
func (c *cache) get(k cacheKey, now time.Time) (*answer, bool) {
	c.mu.Lock()
	e, ok := c.m[k]
	if ok && !now.Before(e.expires) {
		c.drop(k)
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
	cost := answerCost(a.rrs)
	if ttl <= 0 || cost > c.maxCost/16 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.drop(k)
	full := func() bool { return len(c.m) >= c.max || c.cost+cost > c.maxCost }
	if full() {
		// Expired entries go first, then arbitrary ones while still
		// full, down to three quarters of either bound.
		for key, e := range c.m {
			if !now.Before(e.expires) || full() {
				c.drop(key)
			}
			if len(c.m) < c.max*3/4 && c.cost+cost <= c.maxCost*3/4 {
				break
			}
		}
	}
	c.m[k] = entry{a: a, stored: now, expires: now.Add(ttl), cost: cost}
	c.cost += cost
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
