package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/release"
	"github.com/nixcage/nixcage/internal/store"
)

func init() {
	register(&command{
		name:  "apply",
		args:  "DIR|URL [--offline --store ROOT --channel C --key PUB]",
		short: "verify a signed release and make it the current store generation",
		run:   runApply,
	})
	register(&command{
		name:  "rollback",
		args:  "[--to N] [--force] [--offline --store ROOT --key PUB]",
		short: "switch the store back to an older kept generation (logged)",
		run:   runRollback,
	})
}

func logger(env *Env) *slog.Logger {
	return slog.New(slog.NewTextHandler(env.Err, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

func runApply(ctx context.Context, env *Env, args []string) error {
	fl := newFlags(env, "apply")
	sf := addStoreFlags(fl, sfKeys|sfChannel|sfApply|sfKeep|sfOffline)
	verbose := fl.Bool("v", false, "print how long each step took")
	addr := addBusFlag(fl, env)
	pos, err := parseFlags(fl, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return usageError("usage: cagectl apply DIR|URL --offline --store ROOT --channel C --key PUB")
	}
	if !sf.offline {
		return applyViaCaged(ctx, env, *addr, pos[0], *verbose)
	}
	if sf.channel == "" || len(sf.keys) == 0 {
		return usageError("apply --offline needs --channel and at least one --key (the store.channel and store.keys settings)")
	}
	src, err := release.NewSource(pos[0])
	if err != nil {
		return failure(err)
	}
	opts := sf.options()
	opts.Logger = logger(env)
	var pp *progressPrinter
	if isTerminal(env.Err) {
		pp = &progressPrinter{w: env.Err}
		opts.Progress = pp.update
	}
	s, err := store.Open(opts)
	if err != nil {
		return failure(err)
	}
	res, err := s.Apply(ctx, src)
	if pp != nil {
		pp.done()
	}
	if err != nil {
		return failure(err)
	}
	printWarnings(env, res.Warnings)
	fmt.Fprintf(env.Out, "generation %d (channel %s) is current, was %d: %s; %d paths added (%s), %d reused; pruned %d generation(s), collected %d path(s)\n",
		res.Generation, res.Channel, res.Previous, res.Top, res.Added, mib(res.Bytes), res.Reused, len(res.Pruned), len(res.Collected))
	if *verbose {
		for _, p := range res.Phases {
			fmt.Fprintf(env.Out, "  %-16s %v\n", p.Name, p.Duration.Round(time.Millisecond))
		}
	}
	return nil
}

func runRollback(ctx context.Context, env *Env, args []string) error {
	fl := newFlags(env, "rollback")
	// Keys: a rollback to a generation signed by a revoked key is refused.
	sf := addStoreFlags(fl, sfKeys|sfChannel|sfOffline)
	addr := addBusFlag(fl, env)
	to := fl.Uint64("to", 0, "generation to switch to (default: the newest older one)")
	force := fl.Bool("force", false, "switch even to a generation the current key set does not vouch for (a revoked key signed it); logged as forced")
	pos, err := parseFlags(fl, args)
	if err != nil {
		return err
	}
	if len(pos) != 0 {
		return usageError("usage: cagectl rollback [--to N] [--force] --offline --store ROOT --key PUB")
	}
	if !sf.offline {
		return rollbackViaCaged(ctx, env, *addr, *to, *force)
	}
	opts := sf.options()
	opts.Logger = logger(env)
	s, err := store.Open(opts)
	if err != nil {
		return failure(err)
	}
	from, n, err := s.Rollback(ctx, *to, *force)
	if err != nil {
		return failure(err)
	}
	h, _ := s.Highest()
	fmt.Fprintf(env.Out, "rolled back from generation %d to %d; new releases must still be above generation %s\n", from, n, strconv.FormatUint(h, 10))
	return nil
}

// applyViaCaged asks caged to apply; it checks the caller is an admin. A
// local directory is opened here and handed over as a descriptor, so caged's
// sandbox (ProtectHome=, PrivateTmp=) does not decide which paths work.
func applyViaCaged(ctx context.Context, env *Env, addr, src string, verbose bool) error {
	var dir *os.File
	if !strings.Contains(src, "://") {
		f, err := os.OpenFile(src, os.O_RDONLY|unix.O_DIRECTORY, 0)
		if err != nil {
			return failure(fmt.Errorf("release directory: %w", err))
		}
		defer f.Close()
		dir = f
	}
	c, err := dialCaged(ctx, addr)
	if err != nil {
		return noCaged("apply", err)
	}
	defer c.Close()
	// caged addresses its progress to this connection: a progress line on
	// a terminal, and with -v the time each phase took (measured here).
	var pp *progressPrinter
	if isTerminal(env.Err) {
		pp = &progressPrinter{w: env.Err}
	}
	var phases []store.Phase
	phase, since := "", time.Now()
	stop := c.WatchApplyProgress(func(p bus.ApplyProgress) {
		if pp != nil {
			pp.update(store.Progress{Phase: p.Phase, Done: int(p.Done), Total: int(p.Total), Bytes: p.Bytes, TotalBytes: p.TotalBytes})
		}
		if p.Phase != phase {
			if phase != "" {
				phases = append(phases, store.Phase{Name: phase, Duration: time.Since(since)})
			}
			phase, since = p.Phase, time.Now()
		}
	})
	var res *bus.ApplyResult
	if dir != nil {
		res, err = c.ApplyDir(ctx, dir)
	} else {
		res, err = c.Apply(ctx, src)
	}
	stop()
	if pp != nil {
		pp.done()
	}
	if err != nil {
		return noCaged("apply", busError(err))
	}
	if phase != "" {
		phases = append(phases, store.Phase{Name: phase, Duration: time.Since(since)})
	}
	defer func() {
		if verbose {
			for _, p := range phases {
				fmt.Fprintf(env.Out, "  %-16s %v\n", p.Name, p.Duration.Round(time.Millisecond))
			}
		}
	}()
	printWarnings(env, res.Warnings)
	fmt.Fprintf(env.Out, "generation %d (channel %s) is current, was %d: %s; %d paths added (%s), %d reused\n",
		res.Generation, res.Channel, res.Previous, res.Top, res.Added, mib(res.Bytes), res.Reused)
	return nil
}

// printWarnings reports what failed after an apply's commit point: the
// apply succeeded (exit 0), the operator still has something to look at.
func printWarnings(env *Env, ws []string) {
	for _, w := range ws {
		fmt.Fprintln(env.Err, "cagectl: warning:", w)
	}
}

func rollbackViaCaged(ctx context.Context, env *Env, addr string, to uint64, force bool) error {
	c, err := dialCaged(ctx, addr)
	if err != nil {
		return noCaged("rollback", err)
	}
	defer c.Close()
	from, now, err := c.Rollback(ctx, to, force)
	if err != nil {
		return noCaged("rollback", busError(err))
	}
	fmt.Fprintf(env.Out, "rolled back from generation %d to %d\n", from, now)
	return nil
}

// noCaged adds the offline alternative to "caged is not reachable".
func noCaged(cmd string, err error) error {
	var ee *ExitError
	if errors.As(err, &ee) && ee.Code == ExitNoConn {
		return &ExitError{Code: ExitNoConn, Err: fmt.Errorf("%w; as root, `cagectl %s --offline --store ROOT ...` acts on the store directly", ee.Err, cmd)}
	}
	return err
}
