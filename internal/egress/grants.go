package egress

import (
	"context"
	"os"
	"syscall"
	"time"

	"github.com/nixcage/nixcage/internal/policy"
)

// grantsPoll is how often the gateway looks at its grants file: a stat per
// tick, a read only when it changed, so a grant applies within a second
// without inotify (which the gateway's sandbox and a bind-mounted runtime
// directory make unreliable) and without a signal caged must be allowed to
// send.
const grantsPoll = 250 * time.Millisecond

// decide is the policy decision with the bans, grants and learn mode in
// force now. A ban comes first: it beats the policy, a grant and learn
// mode alike.
func (g *Gateway) decide(st *state, host string, port int, method string) policy.Decision {
	if d, ok := g.banned(host); ok {
		return d
	}
	return st.pol.DecideLearning(g.learn.Load(), *g.grants.Load(), time.Now(), host, port, method)
}

// SetGrants replaces the grants in force. Open tunnels are not touched: a
// grant that ends refuses the next decision (a new tunnel, or the next
// request inside an intercepted one), as a reload does.
func (g *Gateway) SetGrants(gs []policy.Grant) {
	cp := append([]policy.Grant(nil), gs...)
	g.grants.Store(&cp)
}

// Grants returns the grants in force (expired ones included until the file
// drops them; they no longer match).
func (g *Gateway) Grants() []policy.Grant { return *g.grants.Load() }

// fileStamp is what a change of the file changes: a rename (inode), a
// write (size, mtime) or a chmod/chown (mode, ctime).
type fileStamp struct {
	ino, size, ctime int64
	mode             os.FileMode
	mtime            time.Time
	exists           bool
}

func stamp(path string) fileStamp {
	st, err := os.Lstat(path)
	if err != nil {
		return fileStamp{}
	}
	fs := fileStamp{size: st.Size(), mode: st.Mode(), mtime: st.ModTime(), exists: true}
	if s, ok := st.Sys().(*syscall.Stat_t); ok {
		fs.ino, fs.ctime = int64(s.Ino), s.Ctim.Nano()
	}
	return fs
}

// watchGrants loads path now and again whenever it changes, until ctx ends.
// A file that cannot be trusted or parsed leaves no grants in force (fail
// closed) and is logged.
func (g *Gateway) watchGrants(ctx context.Context, path string) {
	agent := g.st.Load().rt.Agent
	load := func() {
		doc, err := policy.LoadGrants(path, agent)
		if err != nil {
			g.log.Error("grants refused; no grants in force", "file", path, "err", err)
			g.SetGrants(nil)
			return
		}
		g.SetGrants(doc.Grants)
		g.log.Info("grants loaded", "file", path, "grants", len(doc.Grants))
	}
	watchFile(ctx, path, load)
}

// watchFile calls load now and whenever path changes (polled every
// grantsPoll), until ctx ends.
func watchFile(ctx context.Context, path string, load func()) {
	last := stamp(path)
	load()
	t := time.NewTicker(grantsPoll)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if s := stamp(path); s != last {
			last = s
			load()
		}
	}
}
