package cli

import (
	"context"
	"fmt"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/nixcage/nixcage/internal/channel"
	"github.com/nixcage/nixcage/internal/release"
)

func init() {
	register(&command{
		name:  "release create",
		args:  "STOREPATH --key K --channel C --generation N --expires D --out DIR",
		short: "copy a closure from the local Nix store into a signed release",
		run:   runReleaseCreate,
	})
	register(&command{
		name:  "release publish",
		args:  "DIR --to CHANNELDIR --key PUB [--threshold N]",
		short: "verify a release and lay it out in a channel directory (docs/fleet.md)",
		run:   runReleasePublish,
	})
	register(&command{
		name:  "release verify",
		args:  "DIR|URL --key PUB [--channel C]",
		short: "verify a release offline: signatures, freshness, every NAR",
		run:   runReleaseVerify,
	})
}

// parseExpires accepts an RFC 3339 time, a Go duration ("720h") or days ("30d").
func parseExpires(s string, now time.Time) (time.Time, error) {
	if t, err := time.Parse(time.RFC3339, s); err == nil {
		return t, nil
	}
	if d, ok := strings.CutSuffix(s, "d"); ok {
		if n, err := strconv.Atoi(d); err == nil && n > 0 {
			return now.Add(time.Duration(n) * 24 * time.Hour), nil
		}
	}
	if d, err := time.ParseDuration(s); err == nil && d > 0 {
		return now.Add(d), nil
	}
	return time.Time{}, fmt.Errorf("--expires %q: use an RFC 3339 time (2027-01-31T00:00:00Z), days (30d) or a duration (720h)", s)
}

func runReleaseCreate(ctx context.Context, env *Env, args []string) error {
	fl := newFlags(env, "release create")
	var keys listFlag
	fl.Var(&keys, "key", "private key `PEM` to sign with (repeatable for k-of-n)")
	channel := fl.String("channel", "", "release channel")
	gen := fl.Uint64("generation", 0, "generation, higher than every earlier release on the channel")
	expires := fl.String("expires", "30d", "expiry: RFC 3339 time, days (30d) or duration (720h)")
	out := fl.String("out", "", "release `DIR`")
	comp := fl.String("compression", "xz", "NAR compression: xz or none")
	pos, err := parseFlags(fl, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 || *out == "" || *channel == "" || *gen == 0 || len(keys) == 0 {
		return usageError("usage: cagectl release create STOREPATH --key K --channel C --generation N --expires D --out DIR")
	}
	exp, err := parseExpires(*expires, time.Now())
	if err != nil {
		return usageError("%v", err)
	}
	var signers []*release.PrivateKey
	for _, k := range keys {
		sk, err := release.LoadPrivateKey(k)
		if err != nil {
			return failure(err)
		}
		signers = append(signers, sk)
	}
	m, err := release.Create(ctx, release.CreateOptions{StorePath: pos[0], Keys: signers, Channel: *channel,
		Generation: *gen, Expires: exp, Out: *out, Compression: *comp})
	if err != nil {
		return failure(err)
	}
	var size uint64
	for _, p := range m.Paths {
		size += p.NarSize
	}
	fmt.Fprintf(env.Out, "release %s generation %d: %s, %d paths, %s, expires %s, %d signature(s)\n",
		m.Channel, m.Generation, m.Top, len(m.Paths), mib(int64(size)), m.Expires.Format(time.RFC3339), len(signers))
	return nil
}

func runReleaseVerify(ctx context.Context, env *Env, args []string) error {
	fl := newFlags(env, "release verify")
	var keys, nixKeys listFlag
	fl.Var(&keys, "key", "trusted public key `PEM` (repeatable)")
	fl.Var(&nixKeys, "nix-key", "trusted Nix public key `name:base64` (repeatable)")
	threshold := fl.Int("threshold", 1, "distinct trusted keys that must have signed")
	channel := fl.String("channel", "", "require this channel")
	after := fl.Uint64("after", 0, "require a generation above this one")
	pos, err := parseFlags(fl, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 || len(keys) == 0 {
		return usageError("usage: cagectl release verify DIR|URL --key PUB [--key PUB...] [--threshold N] [--channel C]")
	}
	pubs, err := release.LoadPublicKeys(keys)
	if err != nil {
		return failure(err)
	}
	nk, err := release.ParseNixKeys(nixKeys)
	if err != nil {
		return usageError("%v", err)
	}
	src, err := release.NewSource(pos[0])
	if err != nil {
		return failure(err)
	}
	rel, err := release.Open(ctx, src, release.Policy{Keys: pubs, Threshold: *threshold, Channel: *channel, After: *after, NixKeys: nk})
	if err != nil {
		return failure(err)
	}
	if err := rel.CheckCacheInfo(ctx); err != nil {
		return failure(err)
	}
	size, err := rel.VerifyAll(ctx, runtime.GOMAXPROCS(0))
	if err != nil {
		return failure(err)
	}
	m := rel.Manifest
	fmt.Fprintf(env.Out, "ok: channel %s generation %d, %s, %d paths (%s) re-hashed, expires %s\n",
		m.Channel, m.Generation, m.Top, len(m.Paths), mib(size), m.Expires.Format(time.RFC3339))
	return nil
}

// runReleasePublish verifies a release as a host would (signatures with
// the keys given, every NAR re-hashed) and only then lays it out in the
// channel directory, index last (channel.Publish).
func runReleasePublish(ctx context.Context, env *Env, args []string) error {
	fl := newFlags(env, "release publish")
	var keys listFlag
	fl.Var(&keys, "key", "public key `PEM` the hosts trust (repeatable); the release is verified with them first")
	threshold := fl.Int("threshold", 1, "distinct trusted keys that must have signed")
	to := fl.String("to", "", "channel `DIR` (what the web server serves)")
	pos, err := parseFlags(fl, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 || *to == "" || len(keys) == 0 {
		return usageError("usage: cagectl release publish DIR --to CHANNELDIR --key PUB [--key PUB...] [--threshold N]")
	}
	pubs, err := release.LoadPublicKeys(keys)
	if err != nil {
		return failure(err)
	}
	rel, err := release.Open(ctx, release.DirSource(pos[0]), release.Policy{Keys: pubs, Threshold: *threshold})
	if err != nil {
		return failure(err)
	}
	if err := rel.CheckCacheInfo(ctx); err != nil {
		return failure(err)
	}
	if _, err := rel.VerifyAll(ctx, runtime.GOMAXPROCS(0)); err != nil {
		return failure(err)
	}
	p, err := channel.Publish(ctx, pos[0], *to)
	if err != nil {
		return failure(err)
	}
	fmt.Fprintf(env.Out, "published channel %s generation %d (was %d) in %s: %d cache files written, %d already there\n",
		p.Channel, p.Generation, p.Previous, *to, p.Copied, p.Present)
	return nil
}
