package cli

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"

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
