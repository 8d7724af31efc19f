package dnsfilter

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/miekg/dns"
)

// Resolver looks names up at one DNS server, with no /etc/hosts, no search
// list and no cache: the gateway's view of a name is exactly what the
// upstream resolver says, which is also what the cage's DNS filter serves.
type Resolver struct {
	Server  string // host:port
	Timeout time.Duration
}

// LookupNetIP returns the A and AAAA addresses of host (network is ignored:
// the gateway classifies every address of both families).
func (r *Resolver) LookupNetIP(ctx context.Context, _, host string) ([]netip.Addr, error) {
	timeout := r.Timeout
	if timeout == 0 {
		timeout = 5 * time.Second
	}
	type res struct {
		addrs []netip.Addr
		err   error
	}
	ch := make(chan res, 2)
	for _, qt := range []uint16{dns.TypeA, dns.TypeAAAA} {
		go func() {
			a, err := r.query(ctx, host, qt, timeout)
			ch <- res{a, err}
		}()
	}
	var addrs []netip.Addr
	var errs []error
	for range 2 {
		x := <-ch
		addrs = append(addrs, x.addrs...)
		if x.err != nil {
			errs = append(errs, x.err)
		}
	}
	if len(addrs) == 0 {
		if len(errs) > 0 {
			return nil, errors.Join(errs...)
		}
		return nil, fmt.Errorf("no A or AAAA records for %s", host)
	}
	return addrs, nil
}

func (r *Resolver) query(ctx context.Context, host string, qt uint16, timeout time.Duration) ([]netip.Addr, error) {
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
		return nil, fmt.Errorf("%s %s: %w", dns.TypeToString[qt], host, err)
	}
	if resp.Rcode != dns.RcodeSuccess {
		return nil, fmt.Errorf("%s %s: %s", dns.TypeToString[qt], host, dns.RcodeToString[resp.Rcode])
	}
	var out []netip.Addr
	for _, rr := range resp.Answer {
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
	return out, nil
}
