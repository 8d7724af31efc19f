package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/nixcage/nixcage/internal/control"
	"github.com/nixcage/nixcage/internal/release"
)

func init() {
	register(&command{
		name:  "control sign",
		args:  "--key KEY... --action ACTION --host HOST|'*' --agent AGENT|'*' [--ban HOST] [--reason TEXT] [--expires 1h] --out FILE",
		short: "create and sign a control command (kill, quarantine, release, pause, resume, ban-host, unban-host)",
		run:   runControlSign,
	})
	register(&command{
		name:  "control cosign",
		args:  "FILE --key KEY...",
		short: "add signatures to a control command (towards control.threshold)",
		run:   runControlCosign,
	})
	register(&command{
		name:  "control apply",
		args:  "FILE [--json] [--bus ADDR]",
		short: "hand a signed control command to caged, which verifies and executes it at most once (admin)",
		run:   runControlApply,
	})
	register(&command{
		name:  "control acks",
		args:  "[-n N] [--json] [--bus ADDR]",
		short: "list the acknowledgements of control commands on this host (viewer over all agents)",
		run:   runControlAcks,
	})
}

func loadPrivateKeys(paths []string) ([]*release.PrivateKey, error) {
	var keys []*release.PrivateKey
	for _, p := range paths {
		k, err := release.LoadPrivateKey(p)
		if err != nil {
			return nil, err
		}
		keys = append(keys, k)
	}
	return keys, nil
}

// runControlSign builds a command and signs it. It checks the command as
// a host would (Validate), so a typo fails here, not on every host.
func runControlSign(_ context.Context, env *Env, args []string) error {
	fl := newFlags(env, "control sign")
	var keys listFlag
	fl.Var(&keys, "key", "control private key `PEM` to sign with (repeatable, for control.threshold)")
	action := fl.String("action", "", "one of "+strings.Join(control.Actions, ", "))
	host := fl.String("host", "", "target host id (control.host_id, default the host name) or '*' for every host")
	agent := fl.String("agent", "", "target agent or '*' for every agent of the host")
	ban := fl.String("ban", "", "the host `NAME` to ban or unban (ban-host, unban-host): exact (covers subdomains) or *.suffix")
	reason := fl.String("reason", "", "why (one line; recorded in the ack, the quarantine mark, the ban)")
	expires := fl.String("expires", "1h", "how long the command is valid: a duration (at most 24h) or an RFC 3339 time")
	out := fl.String("out", "", "write the signed command to `FILE` (- for standard output)")
	pos, err := parseFlags(fl, args)
	if err != nil {
		return err
	}
	if len(pos) != 0 || len(keys) == 0 || *action == "" || *host == "" || *agent == "" || *out == "" {
		return usageError("usage: cagectl control sign --key KEY... --action ACTION --host HOST|'*' --agent AGENT|'*' [--ban HOST] [--reason TEXT] [--expires 1h] --out FILE")
	}
	now := time.Now().UTC().Truncate(time.Second)
	exp, err := parseExpires(*expires, now)
	if err != nil {
		return usageError("%v", err)
	}
	nonce, err := control.NewNonce()
	if err != nil {
		return failure(err)
	}
	c := &control.Command{Schema: control.Schema, Action: *action, Host: *host, Agent: *agent, Ban: *ban,
		Issued: now, Expires: exp.UTC(), Nonce: nonce, Reason: *reason}
	if err := c.Validate(); err != nil {
		return usageError("%s", control.AsRefusal(err).Reason)
	}
	priv, err := loadPrivateKeys(keys)
	if err != nil {
		return failure(err)
	}
	s, err := control.Sign(c, priv)
	if err != nil {
		return usageError("%v", err)
	}
	if err := writeSigned(env, *out, s, true); err != nil {
		return err
	}
	fmt.Fprintf(env.Err, "signed %s %s on host %s, agent %s (command %s, nonce %s, expires %s, %d signature(s))\n",
		c.Action, c.Ban, c.Host, c.Agent, c.Hash()[:16], c.Nonce, c.Expires.Format(time.RFC3339), len(s.Signatures))
	return nil
}

func writeSigned(env *Env, out string, s *control.Signed, exclusive bool) error {
	b, err := s.Marshal()
	if err != nil {
		return failure(err)
	}
	if out == "-" {
		_, err := env.Out.Write(b)
		return err
	}
	flags := os.O_WRONLY | os.O_CREATE | os.O_TRUNC
	if exclusive {
		flags |= os.O_EXCL
	}
	f, err := os.OpenFile(out, flags, 0o644)
	if errors.Is(err, fs.ErrExist) {
		return failure(fmt.Errorf("%s exists: a command is signed once (cosign adds signatures to it)", out))
	}
	if err != nil {
		return failure(err)
	}
	if _, err := f.Write(b); err != nil {
		f.Close()
		return failure(err)
	}
	if err := f.Close(); err != nil {
		return failure(err)
	}
	return nil
}

func runControlCosign(_ context.Context, env *Env, args []string) error {
	fl := newFlags(env, "control cosign")
	var keys listFlag
	fl.Var(&keys, "key", "control private key `PEM` to add a signature with (repeatable)")
	pos, err := parseFlags(fl, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 || len(keys) == 0 {
		return usageError("usage: cagectl control cosign FILE --key KEY...")
	}
	raw, err := readCommand(env, pos[0])
	if err != nil {
		return err
	}
	var s control.Signed
	if err := json.Unmarshal(raw, &s); err != nil {
		return failure(fmt.Errorf("%s: %w", pos[0], err))
	}
	priv, err := loadPrivateKeys(keys)
	if err != nil {
		return failure(err)
	}
	if err := s.AddSignatures(priv); err != nil {
		return failure(fmt.Errorf("%s: %w", pos[0], err))
	}
	if err := writeSigned(env, pos[0], &s, false); err != nil {
		return err
	}
	fmt.Fprintf(env.Err, "%s: %d signature(s)\n", pos[0], len(s.Signatures))
	return nil
}

func readCommand(env *Env, name string) ([]byte, error) {
	var r io.Reader
	if name == "-" {
		r = env.In
	} else {
		f, err := os.Open(name)
		if err != nil {
			return nil, failure(err)
		}
		defer f.Close()
		r = f
	}
	b, err := io.ReadAll(io.LimitReader(r, control.MaxSize+1))
	if err != nil {
		return nil, failure(err)
	}
	if len(b) > control.MaxSize {
		return nil, failure(fmt.Errorf("%s is more than %d bytes: not a control command", name, control.MaxSize))
	}
	return b, nil
}

// runControlApply sends the bytes to caged, which does every check; the
// exit status is 0 only if the command was executed.
func runControlApply(ctx context.Context, env *Env, args []string) error {
	fl := newFlags(env, "control apply")
	addr := addBusFlag(fl, env)
	asJSON := fl.Bool("json", false, "print the ack as JSON")
	pos, err := parseFlags(fl, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return usageError("usage: cagectl control apply FILE")
	}
	raw, err := readCommand(env, pos[0])
	if err != nil {
		return err
	}
	c, err := dialCaged(ctx, *addr)
	if err != nil {
		return err
	}
	defer c.Close()
	ack, err := c.ApplyControl(ctx, raw)
	if err != nil {
		return busError(fmt.Errorf("control apply: %w", err))
	}
	if *asJSON {
		if err := json.NewEncoder(env.Out).Encode(ack); err != nil {
			return err
		}
	} else {
		fmt.Fprintf(env.Out, "%s: %s %s %s: %s\n", ack.Status, ack.Action, ack.Agent+ack.Ban, shortHash(ack.SHA256), ack.Reason)
	}
	if ack.Status != control.StatusExecuted {
		return &ExitError{Code: ExitFailure, Err: fmt.Errorf("command %s %s: %s", shortHash(ack.SHA256), ack.Status, ack.Reason)}
	}
	return nil
}

func shortHash(h string) string {
	if len(h) > 16 {
		return h[:16]
	}
	return h
}

func runControlAcks(ctx context.Context, env *Env, args []string) error {
	fl := newFlags(env, "control acks")
	addr := addBusFlag(fl, env)
	n := fl.Uint("n", 50, "show the newest `N` acks (0: every one kept)")
	asJSON := fl.Bool("json", false, "print JSON lines (the ack file's schema)")
	pos, err := parseFlags(fl, args)
	if err != nil {
		return err
	}
	if len(pos) != 0 {
		return usageError("usage: cagectl control acks [-n N] [--json]")
	}
	c, err := dialCaged(ctx, *addr)
	if err != nil {
		return err
	}
	defer c.Close()
	acks, err := c.ControlAcks(ctx, uint32(*n))
	if err != nil {
		return busError(fmt.Errorf("control acks: %w", err))
	}
	if *asJSON {
		enc := json.NewEncoder(env.Out)
		for _, a := range acks {
			if err := enc.Encode(a); err != nil {
				return err
			}
		}
		return nil
	}
	tw := tabwriter.NewWriter(env.Out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "TIME\tSTATUS\tACTION\tTARGET\tCOMMAND\tSOURCE\tREASON")
	for _, a := range slices.Backward(acks) {
		target := a.Agent
		if a.Ban != "" {
			target += " " + a.Ban
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", a.Time, a.Status, a.Action, target, shortHash(a.SHA256), a.Source, a.Reason)
	}
	return tw.Flush()
}
