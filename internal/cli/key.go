package cli

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/nixcage/nixcage/internal/release"
)

func init() {
	register(&command{
		name:  "key generate",
		args:  "--out PREFIX [--type ed25519|ecdsa-p256]",
		short: "create a release signing key (PREFIX.key, PREFIX.pub)",
		run:   runKeyGenerate,
	})
}

func runKeyGenerate(_ context.Context, env *Env, args []string) error {
	fl := newFlags(env, "key generate")
	out := fl.String("out", "", "write `PREFIX`.key (private, 0600) and PREFIX.pub")
	typ := fl.String("type", release.AlgEd25519, "key type: ed25519 or ecdsa-p256")
	pos, err := parseFlags(fl, args)
	if err != nil {
		return err
	}
	if len(pos) != 0 || *out == "" {
		return usageError("usage: cagectl key generate --out PREFIX [--type ed25519|ecdsa-p256]")
	}
	priv, pub, err := release.GenerateKey(*typ)
	if err != nil {
		return usageError("%v", err)
	}
	// O_EXCL: never overwrite a key; losing a signing key is not undoable.
	f, err := os.OpenFile(*out+".key", os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if errors.Is(err, fs.ErrExist) {
		return failure(fmt.Errorf("%s.key exists; choose another --out or remove it deliberately", *out))
	}
	if err != nil {
		return failure(err)
	}
	if _, err := f.Write(priv); err != nil {
		f.Close()
		return failure(err)
	}
	if err := f.Close(); err != nil {
		return failure(err)
	}
	if err := os.WriteFile(*out+".pub", pub, 0o644); err != nil {
		return failure(err)
	}
	k, err := release.ParsePublicKey(pub)
	if err != nil {
		return failure(err)
	}
	fmt.Fprintf(env.Out, "wrote %s.key and %s.pub (%s, key id %s)\n", *out, *out, k.Alg, k.ID)
	return nil
}

func init() {
	register(&command{
		name:  "key rotate",
		args:  "--root-key KEY... --version N --release-key PUB... [--threshold T] [--new-root PUB... --root-threshold T] [--generation-floor N] [--expires 365d] --out DIR",
		short: "sign a new key set (release keys, next root keys) with the root keys: DIR/keys/N.json",
		run:   runKeyRotate,
	})
}

// runKeyRotate signs key set N with the root keys given. The set names the
// release keys trusted from then on (a key left out is revoked), and the
// root keys that will sign set N+1: --new-root rotates the root itself, in
// which case the new root's private keys must sign too (pass them as more
// --root-key). The output goes into DIR/keys/, the layout a release ships,
// so DIR is typically the next release directory.
func runKeyRotate(_ context.Context, env *Env, args []string) error {
	fl := newFlags(env, "key rotate")
	var rootPriv, relPub, newRoot listFlag
	fl.Var(&rootPriv, "root-key", "root private key `PEM` that signs this set (repeatable: the current root keys, and the new ones when the root rotates)")
	fl.Var(&relPub, "release-key", "release public key `PEM` trusted by this set (repeatable; keys left out are revoked)")
	fl.Var(&newRoot, "new-root", "root public key `PEM` of this set, signing the next one (repeatable; default: the public halves of --root-key)")
	version := fl.Uint64("version", 0, "key set version: one above the store's current one (the configuration is version 0)")
	threshold := fl.Int("threshold", 1, "release keys that must sign a release")
	rootThreshold := fl.Int("root-threshold", 1, "root keys of this set that must sign the next set")
	floor := fl.Uint64("generation-floor", 0, "releases must be above generation `N` from this set on (restores rollback protection when the rotation revokes the keys that signed the newest generations)")
	expires := fl.String("expires", "365d", "when this key set (the root role) expires: RFC 3339, days (365d) or a duration")
	out := fl.String("out", "", "write `DIR`/keys/N.json and N.json.sig")
	pos, err := parseFlags(fl, args)
	if err != nil {
		return err
	}
	if len(pos) != 0 || len(rootPriv) == 0 || len(relPub) == 0 || *version == 0 || *out == "" {
		return usageError("usage: cagectl key rotate --root-key KEY... --version N --release-key PUB... [--threshold T] [--new-root PUB... --root-threshold T] [--generation-floor N] [--expires 365d] --out DIR")
	}
	now := time.Now().UTC().Truncate(time.Second)
	exp, err := parseExpires(*expires, now)
	if err != nil {
		return usageError("%v", err)
	}
	var signers []*release.PrivateKey
	for _, p := range rootPriv {
		k, err := release.LoadPrivateKey(p)
		if err != nil {
			return failure(err)
		}
		signers = append(signers, k)
	}
	rel, err := release.LoadPublicKeys(relPub)
	if err != nil {
		return failure(err)
	}
	var roots []*release.PublicKey
	if len(newRoot) > 0 {
		if roots, err = release.LoadPublicKeys(newRoot); err != nil {
			return failure(err)
		}
	} else {
		for _, k := range signers {
			roots = append(roots, k.Public())
		}
	}
	ks := &release.KeySet{Schema: release.Schema, Version: *version, Created: now, Expires: exp.UTC(), GenerationFloor: *floor}
	if ks.Root, err = release.NewRole(roots, *rootThreshold); err != nil {
		return failure(err)
	}
	if ks.Release, err = release.NewRole(rel, *threshold); err != nil {
		return failure(err)
	}
	raw, rawSig, err := release.SignKeySet(ks, signers)
	if err != nil {
		return usageError("%v", err)
	}
	dir := filepath.Join(*out, release.KeySetDir)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return failure(err)
	}
	name := filepath.Join(dir, release.KeySetFile(*version))
	if _, err := os.Lstat(name); err == nil {
		return failure(fmt.Errorf("%s exists: a key set version is signed once; remove it deliberately or pick the next version", name))
	}
	if err := os.WriteFile(name+".sig", rawSig, 0o644); err != nil {
		return failure(err)
	}
	if err := os.WriteFile(name, raw, 0o644); err != nil {
		return failure(err)
	}
	fmt.Fprintf(env.Out, "wrote %s (+.sig): version %d, %d release key(s) threshold %d, %d root key(s) threshold %d, expires %s\n",
		name, *version, len(rel), *threshold, len(roots), *rootThreshold, exp.UTC().Format(time.RFC3339))
	return nil
}
