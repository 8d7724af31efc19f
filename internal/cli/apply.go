package cli

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"

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
		args:  "[--to N] [--offline --store ROOT]",
		short: "switch the store back to an older kept generation (logged)",
		run:   runRollback,
	})
}

func logger(env *Env) *slog.Logger {
	return slog.New(slog.NewTextHandler(env.Err, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

func runApply(ctx context.Context, env *Env, args []string) error {
	fl := newFlags(env, "apply")
	sf := addStoreFlags(fl, true)
	pos, err := parseFlags(fl, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return usageError("usage: cagectl apply DIR|URL --offline --store ROOT --channel C --key PUB")
	}
	if !sf.offline {
		return errNoBus("apply")
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
	if res != nil && res.Generation != 0 && err != nil {
		fmt.Fprintf(env.Out, "generation %d is current\n", res.Generation)
	}
	if err != nil {
		return failure(err)
	}
	fmt.Fprintf(env.Out, "generation %d (channel %s) is current, was %d: %s; %d paths added (%s), %d reused; pruned %d generation(s), collected %d path(s)\n",
		res.Generation, res.Channel, res.Previous, res.Top, res.Added, mib(res.Bytes), res.Reused, len(res.Pruned), len(res.Collected))
	return nil
}

func runRollback(ctx context.Context, env *Env, args []string) error {
	fl := newFlags(env, "rollback")
	sf := addStoreFlags(fl, true)
	to := fl.Uint64("to", 0, "generation to switch to (default: the newest older one)")
	pos, err := parseFlags(fl, args)
	if err != nil {
		return err
	}
	if len(pos) != 0 {
		return usageError("usage: cagectl rollback [--to N] --offline --store ROOT")
	}
	if !sf.offline {
		return errNoBus("rollback")
	}
	opts := sf.options()
	opts.Logger = logger(env)
	s, err := store.Open(opts)
	if err != nil {
		return failure(err)
	}
	from, n, err := s.Rollback(ctx, *to)
	if err != nil {
		return failure(err)
	}
	h, _ := s.Highest()
	fmt.Fprintf(env.Out, "rolled back from generation %d to %d; new releases must still be above generation %s\n", from, n, strconv.FormatUint(h, 10))
	return nil
}
