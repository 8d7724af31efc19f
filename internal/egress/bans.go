package egress

import (
	"context"
	"net"
	"sync"

	"github.com/nixcage/nixcage/internal/policy"
)

// Bans (policy/bans.go) come from signed control commands through a
// host-wide file caged writes; the gateway watches it like its grants file
// and keeps the bans for its agent. A ban is checked before the policy and
// the grants at every decision (new tunnels, every request inside an
// intercepted tunnel, DNS), and open tunnels to a newly banned host are
// closed; every other tunnel is left alone.

// liveTunnel is an open tunnel the gateway can close when its host is
// banned.
type liveTunnel struct {
	host string
	conn net.Conn
	mu   sync.Mutex
	ban  *policy.Ban // set when a ban closed it
}

func (t *liveTunnel) bannedBy() *policy.Ban {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.ban
}

// track registers an open tunnel; the returned func forgets it.
func (g *Gateway) track(host string, conn net.Conn) (*liveTunnel, func()) {
	lt := &liveTunnel{host: host, conn: conn}
	g.live.Store(lt, struct{}{})
	if b := policy.BanFor(g.Bans(), host); b != nil {
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
	lt.mu.Unlock()
	lt.conn.Close()
}

// SetBans replaces the bans in force and closes open tunnels to a banned
// host.
func (g *Gateway) SetBans(bans []policy.Ban) {
	cp := append([]policy.Ban(nil), bans...)
	g.bans.Store(&cp)
	g.live.Range(func(k, _ any) bool {
		lt := k.(*liveTunnel)
		if b := policy.BanFor(cp, lt.host); b != nil {
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
