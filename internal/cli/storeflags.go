package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/store"
)

// listFlag is a repeatable string flag.
type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(v string) error { *l = append(*l, v); return nil }

// storeFlags are the flags that stand in for the `store { ... }` config
// block until cagectl reads it.
type storeFlags struct {
	root      string
	channel   string
	keys      listFlag
	rootKeys  listFlag
	rootThr   int
	nixKeys   listFlag
	threshold int
	keep      int
	offline   bool
	jobs      int
	expiry    time.Duration
}

// Which store flags a command takes: each lists only what it reads.
const (
	sfKeys    = 1 << iota // --key, --threshold: verifying signatures
	sfApply               // --nix-key, --jobs: accepting a release
	sfKeep                // --keep: pruning generations
	sfOffline             // --offline: acting on the store without caged
	sfExpiry              // --expiry-warning: reporting a generation close to expiry
	sfChannel             // --channel: the channel the store follows
)

func addStoreFlags(fs *flag.FlagSet, which int) *storeFlags {
	sf := &storeFlags{threshold: 1, rootThr: 1, keep: 3, expiry: config.DefaultExpiryWarning}
	fs.StringVar(&sf.root, "store", paths.DefaultStoreRoot, "store root `DIR`")
	if which&sfKeys != 0 {
		fs.Var(&sf.keys, "key", "trusted release public key `PEM` file (repeatable)")
		fs.IntVar(&sf.threshold, "threshold", 1, "distinct trusted keys that must have signed")
		fs.Var(&sf.rootKeys, "root-key", "root public key `PEM` file that signs key rotations (store.root_keys; repeatable)")
		fs.IntVar(&sf.rootThr, "root-threshold", 1, "distinct root keys that must have signed a key rotation")
	}
	if which&sfExpiry != 0 {
		fs.DurationVar(&sf.expiry, "expiry-warning", config.DefaultExpiryWarning, "report the current generation as expiring this long before its release expires (store.expiry_warning)")
	}
	if which&sfChannel != 0 {
		fs.StringVar(&sf.channel, "channel", "", "channel the store follows")
	}
	if which&sfApply != 0 {
		fs.Var(&sf.nixKeys, "nix-key", "trusted Nix public key `name:base64`; every narinfo must then be signed (repeatable)")
		fs.IntVar(&sf.jobs, "jobs", 0, "NARs unpacked in parallel (0: automatic)")
	}
	if which&sfKeep != 0 {
		fs.IntVar(&sf.keep, "keep", 3, "generations to keep")
	}
	if which&sfOffline != 0 {
		fs.BoolVar(&sf.offline, "offline", false, "act directly on the store root instead of asking caged (as root; bootstrap, tests)")
	}
	return sf
}

func (sf *storeFlags) options() store.Options {
	return store.Options{Root: sf.root, Channel: sf.channel, TrustedKeys: sf.keys,
		NixPublicKeys: sf.nixKeys, Threshold: sf.threshold, Keep: sf.keep, Workers: sf.jobs, ExpiryWarning: sf.expiry,
		RootKeyFiles: sf.rootKeys, RootThreshold: sf.rootThr}
}

// errNoBus is what writers say until caged's D-Bus interface is wired in.
func errNoBus(cmd string) error {
	return &ExitError{Code: ExitNoConn, Err: fmt.Errorf("%s through caged is not available in this build (no bus client yet); run `cagectl %s --offline --store ROOT ...` as root to act on the store directly", cmd, cmd)}
}

// isTerminal reports whether w is a terminal, so progress is drawn only
// for a human and never into logs or pipes.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

// progressPrinter draws one self-overwriting status line, at most every
// 100ms.
type progressPrinter struct {
	mu   sync.Mutex
	w    io.Writer
	last time.Time
	drew bool
}

func (p *progressPrinter) update(pr store.Progress) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if time.Since(p.last) < 100*time.Millisecond && pr.Done != pr.Total {
		return
	}
	p.last = time.Now()
	fmt.Fprintf(p.w, "\r\033[K%s: %d/%d paths, %s/%s", pr.Phase, pr.Done, pr.Total, mib(pr.Bytes), mib(pr.TotalBytes))
	p.drew = true
}

func (p *progressPrinter) done() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.drew {
		fmt.Fprint(p.w, "\r\033[K")
	}
}

func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }

// failure marks an operation that ran and failed; a failure of the store's
// own disk gets its own status, so a script can tell it from a refusal.
func failure(err error) error {
	var ee *ExitError
	if errors.As(err, &ee) {
		return err
	}
	var se *store.StorageError
	if errors.As(err, &se) || errors.Is(err, bus.ErrIO) {
		return &ExitError{Code: ExitIO, Err: err}
	}
	return &ExitError{Code: ExitFailure, Err: err}
}
