package dnsfilter

import (
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/miekg/dns"
)

// TestCacheCostBound: the cache's cost stays within its bound and equal
// to its entries' (replaced, expired and evicted entries subtracted), and
// an answer over a sixteenth of the bound is not cached.
func TestCacheCostBound(t *testing.T) {
	answerOf := func(n int) *answer {
		var rrs []dns.RR
		for i := range n {
			rrs = append(rrs, &dns.A{Hdr: dns.RR_Header{Name: "x.example.com.", Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 60}, A: net.IPv4(198, 51, 0, byte(i))})
		}
		return &answer{rrs: [][]dns.RR{rrs, nil}, ttl: time.Minute}
	}
	one := answerCost(answerOf(1).rrs)
	c := newCache(100, 64*one)
	now := time.Now()
	sum := func() int {
		n := 0
		for _, e := range c.m {
			n += e.cost
		}
		return n
	}
	for i := range 1000 {
		c.put(cacheKey{fmt.Sprintf("n%d", i%150), dns.TypeA}, answerOf(1+i%4), now.Add(time.Duration(i)*time.Second/10))
		if c.cost > c.maxCost || len(c.m) > c.max || c.cost != sum() {
			t.Fatalf("after %d puts: cost %d (entries say %d), %d entries; bounds %d, %d", i+1, c.cost, sum(), len(c.m), c.maxCost, c.max)
		}
	}
	c.get(cacheKey{"n1", dns.TypeA}, now.Add(time.Hour))
	if c.cost != sum() {
		t.Fatalf("after an expiry: cost %d, entries say %d", c.cost, sum())
	}
	c.put(cacheKey{"huge", dns.TypeA}, answerOf(5), now)
	if _, ok := c.get(cacheKey{"huge", dns.TypeA}, now); ok {
		t.Fatal("an answer over a sixteenth of the bound was cached")
	}
}
