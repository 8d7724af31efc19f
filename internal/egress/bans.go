package egress

import (
	"context"
	"net"
	"net/netip"
	"sync"

	"github.com/nixcage/nixcage/internal/egress/dnsfilter"
	"github.com/nixcage/nixcage/internal/policy"
)

// Bans (policy/bans.go) come from signed control commands through a
// host-wide file caged writes; the gateway watches it like its grants file
// and keeps the bans for its agent. A ban is checked before the policy and
// the grants at every decision (new tunnels, every request inside an
// intercepted tunnel, DNS), and open tunnels to a newly banned host are
// closed; every other tunnel is left alone.
//
// A ban names hosts, and an allowed name whose DNS answer goes through a
// banned name (a CNAME or DNAME chain) is that host under another name: the
// gateway judges every alias the answer went through (resolve), and an
// open tunnel is closed when a ban covers its host or any of its aliases.
// A ban does not follow addresses: another name on the banned host's
// addresses (a shared CDN, or a name the attacker points there) is not
// refused by it (docs/fleet.md, "Fleet-wide host bans").

// liveTunnel is an open tunnel the gateway can close when its host is
// banned.
type liveTunnel struct {
	host    string
	aliases []string
	conn    net.Conn
	mu      sync.Mutex
	ban     *policy.Ban // set when a ban closed it
	// up is a plain tunnel's upstream connection, closed by a ban with
	// conn: closing conn alone did not end a tunnel whose copy loop was
	// waiting to write to the upstream and to read from it (an upstream
	// that neither reads nor sends), which went on until the idle timeout
	// and delivered the agent's bytes still in the gateway after the ban.
	up net.Conn
}

// relaying records the upstream connection of a plain tunnel, closing it
// at once if a ban already cut the tunnel.
func (t *liveTunnel) relaying(up net.Conn) {
	t.mu.Lock()
	t.up = up
	cut := t.ban != nil
	t.mu.Unlock()
	if cut {
		up.Close()
	}
}

func (t *liveTunnel) bannedBy() *policy.Ban {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.ban
}

// banReason is why the ban that closed t covers it ("" if none did),
// naming the alias when the ban covers that rather than the host.
func (t *liveTunnel) banReason() string {
	b := t.bannedBy()
	if b == nil {
		return ""
	}
	if d, ok := (dnsfilter.Chain{Qname: t.host, Aliases: t.aliases}).Refused(nil, []policy.Ban{*b}); ok && !policy.Covers(b.Host, t.host) {
		return d.Reason
	}
	return policy.Banned(b, t.host).Reason
}

// track registers an open tunnel to t; the returned func forgets it.
func (g *Gateway) track(t *target, conn net.Conn) (*liveTunnel, func()) {
	lt := &liveTunnel{host: t.host, aliases: t.aliases, conn: conn}
	g.live.Store(lt, struct{}{})
	if b := banFor(g.Bans(), lt.host, lt.aliases); b != nil {
		// Banned between the decision and now.
		g.cut(lt, b)
	}
	return lt, func() { g.live.Delete(lt) }
}

func (g *Gateway) cut(lt *liveTunnel, b *policy.Ban) {
	lt.mu.Lock()
	if lt.ban == nil {
		lt.ban = b
	}
	up := lt.up
	lt.mu.Unlock()
	lt.conn.Close()
	if up != nil {
		up.Close()
	}
}

// SetBans replaces the bans in force and closes open tunnels to a banned
// host.
func (g *Gateway) SetBans(bans []policy.Ban) {
	cp := append([]policy.Ban(nil), bans...)
	g.bans.Store(&cp)
	g.live.Range(func(k, _ any) bool {
		lt := k.(*liveTunnel)
		if b := banFor(cp, lt.host, lt.aliases); b != nil {
			g.log.Warn("closing tunnel to banned host", "host", lt.host, "ban", b.ID)
			g.cut(lt, b)
		}
		return true
	})
}

// Bans returns the bans in force for this gateway's agent.
func (g *Gateway) Bans() []policy.Ban {
	if p := g.bans.Load(); p != nil {
		return *p
	}
	return nil
}

// banned is the refusal of host if a ban covers it.
func (g *Gateway) banned(host string) (policy.Decision, bool) {
	if b := policy.BanFor(g.Bans(), host); b != nil {
		return policy.Banned(b, host), true
	}
	return policy.Decision{}, false
}

// bannedTarget is the refusal of t if a ban covers its host, or a ban or
// the deny list now in force covers one of the aliases its address came
// through (a reload's new deny entry applies to the next request, as it
// does for the host).
func (g *Gateway) bannedTarget(t *target) (policy.Decision, bool) {
	if d, ok := g.banned(t.host); ok {
		return d, true
	}
	return g.aliasRefused(g.st.Load(), t.host, t.aliases, t.rule)
}

// banFor is the first ban covering host or one of its aliases, or nil.
func banFor(bans []policy.Ban, host string, aliases []string) *policy.Ban {
	if b := policy.BanFor(bans, host); b != nil {
		return b
	}
	for _, a := range aliases {
		if b := policy.BanFor(bans, a); b != nil {
			return b
		}
	}
	return nil
}

// chainResolver is a Resolver that also reports the aliases an answer
// went through (dnsfilter.Resolver, cage-egress's own).
type chainResolver interface {
	LookupChain(ctx context.Context, host string) ([]netip.Addr, []string, error)
}

// lookup resolves host with its aliases when the resolver reports them (a
// resolver that does not, such as net.Resolver in tests, gives none).
func (g *Gateway) lookup(ctx context.Context, host string) ([]netip.Addr, []string, error) {
	if cr, ok := g.opts.Resolver.(chainResolver); ok {
		return cr.LookupChain(ctx, host)
	}
	addrs, err := g.opts.Resolver.LookupNetIP(ctx, "ip", host)
	return addrs, nil, err
}

// aliasRefused is the refusal of host when a ban or the policy's deny list
// covers one of its aliases (dnsfilter.Chain.Refused): the same judgement
// the cage's DNS filter makes of the answer. A host learn mode let through
// (rule) has the shipped deny lists judge its aliases too
// (dnsfilter.ChainDeny).
func (g *Gateway) aliasRefused(st *state, host string, aliases []string, rule string) (policy.Decision, bool) {
	deny := dnsfilter.ChainDeny(st.pol, g.learn.Load(), rule)
	return dnsfilter.Chain{Qname: host, Aliases: aliases}.Refused(deny, g.Bans())
}

// errDecided is a resolution refused by a policy decision (a banned or
// denied alias), audited under the decision's rule.
type errDecided struct{ d policy.Decision }

func (e errDecided) Error() string { return e.d.Reason }

// watchBans loads path now and whenever it changes, until ctx ends. A file
// that cannot be trusted or parsed keeps the bans last in force: a broken
// file must never lift a ban (a missing file is no bans).
func (g *Gateway) watchBans(ctx context.Context, path string) {
	agent := g.st.Load().rt.Agent
	load := func() {
		doc, err := policy.LoadBans(path)
		if err != nil {
			g.log.Error("bans file refused; the bans in force are kept", "file", path, "err", err, "bans", len(g.Bans()))
			return
		}
		bans := doc.For(agent)
		g.SetBans(bans)
		g.log.Info("bans loaded", "file", path, "bans", len(bans))
	}
	watchFile(ctx, path, load)
}
