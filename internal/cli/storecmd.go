package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/store"
)

func init() {
	register(&command{
		name:  "generations",
		args:  "[--store ROOT] [--json]",
		short: "list the kept store generations",
		run:   runGenerations,
	})
	register(&command{
		name:  "store verify",
		args:  "[--store ROOT] [--all] [--key PUB] [--expiry-warning D]",
		short: "re-hash what is live in the store against its manifest",
		run:   runStoreVerify,
	})
	register(&command{
		name:  "store binds",
		args:  "[--store ROOT] [--for service|nspawn|podman]",
		short: "resolve the store's bind sources for a cage start, refusing any link out of the store",
		run:   runStoreBinds,
	})
	register(&command{
		name:  "store gc",
		args:  "--offline [--store ROOT] [--keep N]",
		short: "remove old generations and unreferenced store paths",
		run:   runStoreGC,
	})
}

// Reading the store needs no daemon: the root is world-readable and these
// commands take no lock and change nothing.
func runGenerations(_ context.Context, env *Env, args []string) error {
	fl := newFlags(env, "generations")
	sf := addStoreFlags(fl, sfExpiry)
	asJSON := fl.Bool("json", false, "print JSON")
	pos, err := parseFlags(fl, args)
	if err != nil {
		return err
	}
	if len(pos) != 0 {
		return usageError("usage: cagectl generations [--store ROOT] [--json]")
	}
	opts := sf.options()
	opts.ReadOnly = true
	s, err := store.Open(opts)
	if err != nil {
		return failure(err)
	}
	gens, err := s.Generations()
	if err != nil {
		return failure(err)
	}
	if *asJSON {
		enc := json.NewEncoder(env.Out)
		enc.SetIndent("", "  ")
		if gens == nil {
			gens = []store.Generation{}
		}
		return enc.Encode(gens)
	}
	if len(gens) == 0 {
		fmt.Fprintln(env.Out, "no generations yet")
		return nil
	}
	for _, g := range gens {
		mark := " "
		if g.Current {
			mark = "*"
		}
		fmt.Fprintf(env.Out, "%s %4d  %-10s created %s  expires %s  %d paths  %s\n", mark, g.Number, g.Channel,
			g.Created.Format(time.RFC3339), g.Expires.Format(time.RFC3339), g.Paths, g.Top)
	}
	return nil
}

func runStoreVerify(ctx context.Context, env *Env, args []string) error {
	fl := newFlags(env, "store verify")
	sf := addStoreFlags(fl, sfKeys|sfExpiry)
	all := fl.Bool("all", false, "verify every kept generation, not only the current one")
	pos, err := parseFlags(fl, args)
	if err != nil {
		return err
	}
	if len(pos) != 0 {
		return usageError("usage: cagectl store verify [--store ROOT] [--all] [--key PUB]")
	}
	opts := sf.options()
	opts.ReadOnly = true
	s, err := store.Open(opts)
	if err != nil {
		return failure(err)
	}
	rep, err := s.Verify(ctx, *all)
	if rep != nil {
		for _, p := range rep.Problems {
			fmt.Fprintln(env.Out, "FAIL", p)
		}
	}
	if errors.Is(err, store.ErrExpired) {
		fmt.Fprintln(env.Out, "EXPIRED", rep.Freshness.Message())
		return &ExitError{Code: ExitExpired, Err: err}
	}
	if err != nil {
		return failure(err)
	}
	if msg := rep.Freshness.Message(); msg != "" {
		fmt.Fprintln(env.Out, "WARN", msg)
	}
	sig := "signatures not checked (no --key)"
	if len(sf.keys) > 0 {
		sig = "signatures ok"
	}
	fmt.Fprintf(env.Out, "ok: generation(s) %v, %d paths (%s) re-hashed, %s\n", rep.Generations, rep.Paths, mib(rep.Bytes), sig)
	return nil
}

func runStoreGC(ctx context.Context, env *Env, args []string) error {
	fl := newFlags(env, "store gc")
	sf := addStoreFlags(fl, sfKeep|sfOffline)
	pos, err := parseFlags(fl, args)
	if err != nil {
		return err
	}
	if len(pos) != 0 {
		return usageError("usage: cagectl store gc --offline [--store ROOT] [--keep N]")
	}
	if !sf.offline {
		return errNoBus("store gc")
	}
	opts := sf.options()
	opts.Logger = logger(env)
	s, err := store.Open(opts)
	if err != nil {
		return failure(err)
	}
	gens, paths, err := s.GC(ctx)
	if err != nil {
		return failure(err)
	}
	fmt.Fprintf(env.Out, "removed %d generation(s) %v and %d store path(s)\n", len(gens), gens, len(paths))
	return nil
}

// runStoreBinds is what nspawn and podman agent units run as they start, in
// their ExecStart= wrapper (service cages resolve the store inside the
// cage: render.serviceStoreLinks):
// it resolves ROOT/nix/store and current/top without following any link out
// of the store and prints them as the container manager's bind options. A
// store whose links leave it makes the cage fail to start instead of
// showing it a host directory.
func runStoreBinds(_ context.Context, env *Env, args []string) error {
	fl := newFlags(env, "store binds")
	root := fl.String("store", paths.DefaultStoreRoot, "store root `DIR`")
	backend := fl.String("for", "service", "print options for `BACKEND`: service (SRC:DST lines), nspawn or podman")
	pos, err := parseFlags(fl, args)
	if err != nil {
		return err
	}
	format, ok := map[string]string{"service": "%s\n", "nspawn": "--bind-ro=%s ", "podman": "--volume=%s:ro "}[*backend]
	if len(pos) != 0 || !ok {
		return usageError("usage: cagectl store binds [--store ROOT] [--for service|nspawn|podman]")
	}
	b, err := store.ResolveBinds(*root)
	if err != nil {
		return failure(fmt.Errorf("refusing to start a cage on this store: %w", err))
	}
	for _, m := range [][2]string{{b.Store, paths.CageStoreMount}, {b.Tools, paths.CageTools}} {
		if m[0] != "" {
			fmt.Fprintf(env.Out, format, m[0]+":"+m[1])
		}
	}
	return nil
}
