package cli

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/nixcage/nixcage/internal/bus"
)

// Turns and workspace files (docs/relay.md): the chat relay's methods,
// usable without chat.

func init() {
	register(&command{
		name:  "say",
		args:  "[--bus ADDR] AGENT TEXT...|-",
		short: "one turn of an agent's harness in its cage: TEXT in, the reply out (operator)",
		run:   runSay,
	})
	register(&command{
		name:  "get",
		args:  "AGENT PATH [-o FILE] [--max BYTES] [--bus ADDR]",
		short: "copy a file out of an agent's workspace (operator)",
		run:   runGet,
	})
	register(&command{
		name:  "put",
		args:  "AGENT FILE [--name NAME] [--bus ADDR]",
		short: "copy a file into an agent's workspace inbox/, never overwriting (operator)",
		run:   runPut,
	})
}

// runSay takes flags only before AGENT: everything after it is the text,
// verbatim, so a message may contain words starting with '-'.
func runSay(ctx context.Context, env *Env, args []string) error {
	fs := newFlags(env, "say")
	addr := addBusFlag(fs, env)
	if wantsHelp(args) && env.capture != nil {
		return errHelp
	}
	if err := fs.Parse(args); err != nil {
		return &ExitError{Code: ExitUsage}
	}
	pos := fs.Args()
	if len(pos) < 2 {
		return usageError("usage: cagectl say AGENT TEXT... (or - to read the text from stdin)")
	}
	agent := pos[0]
	if err := checkAgent(agent); err != nil {
		return err
	}
	text := strings.Join(pos[1:], " ")
	if len(pos) == 2 && pos[1] == "-" {
		b, err := io.ReadAll(io.LimitReader(env.In, bus.MaxTurnText+1))
		if err != nil {
			return fmt.Errorf("read the text from stdin: %w", err)
		}
		text = string(b)
	}
	if strings.TrimSpace(text) == "" {
		return usageError("say: the text is empty")
	}
	if len(text) > bus.MaxTurnText {
		return usageError("say: the text is %d bytes or more; a turn takes at most %d", len(text), bus.MaxTurnText)
	}
	c, err := dialCaged(ctx, *addr)
	if err != nil {
		return err
	}
	defer c.Close()
	res, err := c.Turn(ctx, agent, text)
	if err != nil {
		return busError(fmt.Errorf("say %s: %w", agent, err))
	}
	fmt.Fprint(env.Out, res.Reply)
	if res.Reply != "" && !strings.HasSuffix(res.Reply, "\n") {
		fmt.Fprintln(env.Out)
	}
	if res.Status == bus.TurnSuccess {
		return nil
	}
	code := int(res.Exit)
	if code == 0 {
		code = ExitFailure
	}
	return &ExitError{Code: code, Err: fmt.Errorf("turn of %s: %s (exit status %d)", agent, res.Status, res.Exit)}
}

func runGet(ctx context.Context, env *Env, args []string) error {
	fs := newFlags(env, "get")
	addr := addBusFlag(fs, env)
	out := fs.String("o", "", "write to `FILE` (created, never overwritten) instead of stdout")
	max := fs.Uint64("max", 0, "refuse a file larger than `BYTES` (0: caged's ceiling, 50 MiB)")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 2 {
		return usageError("usage: cagectl get AGENT PATH [-o FILE]")
	}
	if err := checkAgent(pos[0]); err != nil {
		return err
	}
	// Open the destination first: a bad -o costs no transfer.
	w := env.Out
	var dst *os.File
	if *out != "" {
		dst, err = os.OpenFile(*out, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
		if err != nil {
			return usageError("get: %v (cagectl never overwrites; choose another -o)", err)
		}
		w = dst
	}
	n, err := getFile(ctx, *addr, pos[0], pos[1], *max, w)
	if dst != nil {
		if cerr := dst.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			os.Remove(dst.Name())
		}
	}
	if err != nil {
		return err
	}
	if dst != nil {
		fmt.Fprintf(env.Err, "cagectl: %s: %d bytes written to %s\n", pos[1], n, dst.Name())
	}
	return nil
}

func getFile(ctx context.Context, addr, agent, path string, max uint64, w io.Writer) (int64, error) {
	c, err := dialCaged(ctx, addr)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	f, size, err := c.GetFile(ctx, agent, path, max)
	if err != nil {
		return 0, busError(fmt.Errorf("get %s %s: %w", agent, path, err))
	}
	defer f.Close()
	n, err := io.Copy(w, io.LimitReader(f, int64(size)))
	if err != nil {
		return n, fmt.Errorf("get %s %s: %w", agent, path, err)
	}
	if uint64(n) != size {
		return n, fmt.Errorf("get %s %s: got %d of %d bytes", agent, path, n, size)
	}
	return n, nil
}

func runPut(ctx context.Context, env *Env, args []string) error {
	fs := newFlags(env, "put")
	addr := addBusFlag(fs, env)
	name := fs.String("name", "", "save as `NAME` in inbox/ (default: FILE's own name)")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 2 {
		return usageError("usage: cagectl put AGENT FILE [--name NAME]")
	}
	if err := checkAgent(pos[0]); err != nil {
		return err
	}
	f, err := os.Open(pos[1])
	if err != nil {
		return usageError("put: %v", err)
	}
	defer f.Close()
	if st, err := f.Stat(); err != nil || !st.Mode().IsRegular() {
		return usageError("put: %s is not a regular file", pos[1])
	}
	if *name == "" {
		*name = filepath.Base(pos[1])
	}
	c, err := dialCaged(ctx, *addr)
	if err != nil {
		return err
	}
	defer c.Close()
	saved, err := c.PutFile(ctx, pos[0], *name, f)
	if err != nil {
		return busError(fmt.Errorf("put %s: %w", pos[0], err))
	}
	fmt.Fprintln(env.Out, saved)
	return nil
}
