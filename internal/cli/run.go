package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/policy"
	termpkg "github.com/nixcage/nixcage/internal/term"
)

func init() {
	register(&command{
		name:  "run",
		args:  "[--policy NAME | --allow HOST...] [--secret NAME=FILE...] [--bind DIR[:ro]...] [--backend service|nspawn] [--name NAME] [--learn [--learn-for DUR]] -- COMMAND [ARGS...]",
		short: "run COMMAND in a throw-away cage (an agent's walls) attached to this terminal; its exit status is cagectl's (operator)",
		run:   runRun,
	})
}

// runSpec is a parsed `cagectl run` command line.
type runSpec struct {
	addr        string
	req         bus.RunRequest
	secrets     []secretArg
	binds       []bindArg
	workspace   string // "" with noWorkspace
	noWorkspace bool
}

type secretArg struct{ name, env, file string }
type bindArg struct {
	dir, dest string
	ro        bool
}

var secretNameRE = regexp.MustCompile(`^[a-z][a-z0-9_-]{0,63}$`)

func parseRun(env *Env, args []string) (*runSpec, error) {
	fs := newFlags(env, "run")
	addr := addBusFlag(fs, env)
	policyName := fs.String("policy", "", "egress policy `NAME` (declared in caged's config or shipped: claude-code, codex, github, none)")
	var allow, secrets, binds listFlag
	fs.Var(&allow, "allow", "allow egress to `HOST` (repeat; instead of --policy)")
	fs.Var(&secrets, "secret", "`NAME[:ENV]=FILE` the gateway holds FILE's value for the policy's credential NAME; the cage sees a placeholder in ENV (default NAME_API_KEY, upper case); repeat")
	fs.Var(&binds, "bind", "also mount `DIR[:ro]` in the cage at /mnt/BASENAME (:ro read-only); repeat")
	backend := fs.String("backend", "nspawn", "service or nspawn (nspawn: own PID namespace, and files written in /workspace are yours)")
	name := fs.String("name", "", "the cage's `NAME` (default: run-XXXXXXXX)")
	workspace := fs.String("workspace", "", "bind `DIR` read-write at /workspace instead of the current directory")
	noWorkspace := fs.Bool("no-workspace", false, "an empty, throw-away /workspace instead of the current directory")
	learn := fs.Bool("learn", false, "learn mode: requests outside the policy are allowed and flagged for a while (never private or metadata addresses, IP literals, denied names); then `cagectl policy suggest NAME` (docs/grants.md)")
	learnFor := fs.Duration("learn-for", 0, "length of the learn window (default 30m, at most 24h); needs --learn")
	if err := fs.Parse(args); err != nil {
		return nil, &ExitError{Code: ExitUsage}
	}
	cmd := fs.Args()
	if len(cmd) == 0 {
		return nil, usageError("usage: cagectl run [FLAGS] -- COMMAND [ARGS...]")
	}
	if *policyName != "" && len(allow) > 0 {
		return nil, usageError("give --policy or --allow, not both")
	}
	if *backend != "service" && *backend != "nspawn" {
		return nil, usageError("--backend %q: use service or nspawn", *backend)
	}
	if *name != "" {
		if err := checkAgent(*name); err != nil {
			return nil, err
		}
	}
	if *noWorkspace && *workspace != "" {
		return nil, usageError("give --workspace or --no-workspace, not both")
	}
	if *learnFor != 0 && !*learn {
		return nil, usageError("--learn-for needs --learn")
	}
	if *learnFor < 0 || *learnFor > policy.MaxLearnDuration || (*learnFor != 0 && *learnFor < time.Minute) {
		return nil, usageError("--learn-for %s: use 1m to %s", *learnFor, policy.MaxLearnDuration)
	}
	s := &runSpec{addr: *addr, workspace: *workspace, noWorkspace: *noWorkspace,
		req: bus.RunRequest{Name: *name, Backend: *backend, Policy: *policyName, Allow: allow, Command: cmd,
			Learn: *learn, LearnSeconds: int64(*learnFor / time.Second)}}
	for _, a := range secrets {
		sa, err := parseSecretArg(a)
		if err != nil {
			return nil, err
		}
		s.secrets = append(s.secrets, sa)
	}
	seen := map[string]string{}
	for _, b := range binds {
		ba := bindArg{dir: b}
		if d, ok := strings.CutSuffix(b, ":ro"); ok {
			ba.dir, ba.ro = d, true
		}
		ba.dest = "/mnt/" + filepath.Base(filepath.Clean(ba.dir))
		if prev, dup := seen[ba.dest]; dup {
			return nil, usageError("--bind %s and %s would both appear at %s; rename one", prev, ba.dir, ba.dest)
		}
		seen[ba.dest] = ba.dir
		s.binds = append(s.binds, ba)
	}
	if n := 3 + len(s.binds) + len(s.secrets) + 1; n > bus.MaxRunFDs {
		return nil, usageError("too many --bind and --secret flags: the bus carries at most %d descriptors per call", bus.MaxRunFDs)
	}
	return s, nil
}

func parseSecretArg(a string) (secretArg, error) {
	key, file, ok := strings.Cut(a, "=")
	if !ok || file == "" {
		return secretArg{}, usageError("--secret %q: write NAME=FILE or NAME:ENV=FILE", a)
	}
	name, env, _ := strings.Cut(key, ":")
	if !secretNameRE.MatchString(name) {
		return secretArg{}, usageError("--secret %q: %q is not a secret name (a-z, 0-9, '_', '-'; the policy's credential name, e.g. anthropic)", a, name)
	}
	if env == "" {
		env = strings.ToUpper(strings.ReplaceAll(name, "-", "_")) + "_API_KEY"
	}
	return secretArg{name: name, env: env, file: file}, nil
}

// runInputs are the descriptors cagectl opened as the caller: that it
// could open them is what grants the cage access, not caged's privileges.
type runInputs struct {
	files   []*os.File
	binds   []bus.RunBind
	secrets []bus.RunSecret
}

func (in *runInputs) Close() {
	for _, f := range in.files {
		f.Close()
	}
}

func openRunInputs(env *Env, s *runSpec) (*runInputs, error) {
	in := &runInputs{}
	fail := func(err error) (*runInputs, error) {
		in.Close()
		return nil, err
	}
	// Secrets first: a missing one is named before anything starts.
	for _, sa := range s.secrets {
		f, err := os.Open(sa.file)
		if err != nil {
			return fail(usageError("--secret %s: %v", sa.name, err))
		}
		in.files = append(in.files, f)
		in.secrets = append(in.secrets, bus.RunSecret{Name: sa.name, Env: sa.env, FD: bus.FD(f)})
	}
	openDir := func(dir, what string) (*os.File, error) {
		f, err := os.OpenFile(dir, os.O_RDONLY|syscall.O_DIRECTORY, 0)
		if err != nil {
			return nil, usageError("%s: %v", what, err)
		}
		in.files = append(in.files, f)
		return f, nil
	}
	if !s.noWorkspace {
		dir, what := s.workspace, "--workspace "+s.workspace
		if dir == "" {
			wd, err := os.Getwd()
			if err != nil {
				return fail(usageError("current directory: %v (use --workspace DIR or --no-workspace)", err))
			}
			dir, what = wd, "the current directory"
		}
		abs, _ := filepath.Abs(dir)
		f, err := openDir(abs, what)
		if err != nil {
			return fail(err)
		}
		in.binds = append(in.binds, bus.RunBind{FD: bus.FD(f), Dest: "/workspace"})
		fmt.Fprintf(env.Err, "cagectl: %s is bound read-write at /workspace (--workspace DIR or --no-workspace to change)\n", abs)
		if s.req.Backend == "service" {
			if st, err := f.Stat(); err == nil && st.Mode().Perm()&0o002 == 0 {
				fmt.Fprintf(env.Err, "cagectl: note: the service backend runs the command as a dynamic user; it can write /workspace only where %s lets others write (the nspawn backend writes as you)\n", abs)
			}
		}
	} else {
		fmt.Fprintln(env.Err, "cagectl: /workspace is an empty directory that vanishes with the cage")
	}
	for _, b := range s.binds {
		abs, _ := filepath.Abs(b.dir)
		f, err := openDir(abs, "--bind "+b.dir)
		if err != nil {
			return fail(err)
		}
		in.binds = append(in.binds, bus.RunBind{FD: bus.FD(f), Dest: b.dest, ReadOnly: b.ro})
		mode := "read-write"
		if b.ro {
			mode = "read-only"
		}
		fmt.Fprintf(env.Err, "cagectl: %s is bound %s at %s\n", abs, mode, b.dest)
	}
	return in, nil
}

func runRun(ctx context.Context, env *Env, args []string) error {
	s, err := parseRun(env, args)
	if err != nil {
		return err
	}
	in, err := openRunInputs(env, s)
	if err != nil {
		return err
	}
	defer in.Close()
	stdio, err := osStdio(env)
	if err != nil {
		return err
	}

	c, err := dialCaged(ctx, s.addr)
	if err != nil {
		return err
	}
	defer c.Close()
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	finished, err := c.WatchRuns(wctx)
	if err != nil {
		return busError(err)
	}

	term, cageIO, err := cageStdio(stdio)
	if err != nil {
		return err
	}
	defer term.Close()
	if term != nil {
		s.req.TTY, s.req.Term = true, env.Getenv("TERM")
	}
	name, err := c.StartRun(ctx, s.req, cageIO, in.binds, in.secrets)
	in.Close()
	if err != nil {
		return busError(fmt.Errorf("run: %w", err))
	}
	if err := term.handOver(); err != nil {
		return err
	}
	sum, err := waitRun(ctx, c, name, finished, term)
	term.finish()
	if err != nil {
		return err
	}
	fmt.Fprintln(env.Err, bus.FormatSummary(*sum))
	if sum.Exit != 0 {
		return &ExitError{Code: int(sum.Exit)}
	}
	return nil
}

// waitRun waits for the run's summary. Without a terminal, cagectl's own
// SIGINT/SIGTERM/SIGHUP go to the cage's command (with one, Ctrl-C is a
// byte on the pty and the cage's terminal turns it into SIGINT).
func waitRun(ctx context.Context, c *bus.Client, name string, finished <-chan bus.RunSummary, term *terminal) (*bus.RunSummary, error) {
	sigs := make(chan os.Signal, 4)
	forward := []os.Signal{syscall.SIGTERM, syscall.SIGHUP}
	if term == nil {
		forward = append(forward, syscall.SIGINT, syscall.SIGQUIT)
	}
	signal.Notify(sigs, forward...)
	defer signal.Stop(sigs)
	var winch chan os.Signal
	if term != nil {
		winch = make(chan os.Signal, 1)
		signal.Notify(winch, syscall.SIGWINCH)
		defer signal.Stop(winch)
	}
	alive := time.NewTicker(time.Second)
	defer alive.Stop()
	owner := c.Owner(ctx)
	for {
		select {
		case sum, ok := <-finished:
			if !ok {
				return nil, &ExitError{Code: ExitNoConn, Err: errors.New("lost the connection to caged while the cage ran")}
			}
			if sum.Name == name {
				return &sum, nil
			}
		case sig := <-sigs:
			if err := c.SignalRun(ctx, name, int32(sig.(syscall.Signal))); err != nil && !errors.Is(err, bus.ErrNoSuchAgent) {
				return nil, busError(err)
			}
		case <-winch:
			termpkg.CopySize(term.user[0], term.master)
		case <-alive.C:
			if !c.Connected() {
				return nil, &ExitError{Code: ExitNoConn, Err: errors.New("lost the connection to caged while the cage ran")}
			}
			if now := c.Owner(ctx); now != owner {
				// A new caged tears down the runs the old one left.
				return nil, &ExitError{Code: ExitNoConn, Err: fmt.Errorf("caged stopped or restarted while cage %s ran; the cage is torn down (its audit is kept)", name)}
			}
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// terminal connects the user's terminal to a pty whose slave the cage gets.
type terminal struct {
	user          [3]*os.File
	master, slave *os.File
	restore       func()
	out           sync.WaitGroup
}

// cageStdio is what the cage gets as stdin, stdout and stderr: a new pty's
// slave when stdin is a terminal (term is then that pty), else the
// caller's own descriptors (term is nil; its methods do nothing).
func cageStdio(user [3]*os.File) (term *terminal, cage [3]*os.File, err error) {
	if !termpkg.IsTerminal(user[0]) {
		return nil, user, nil
	}
	if term, err = newTerminal(user); err != nil {
		return nil, user, err
	}
	return term, [3]*os.File{term.slave, term.slave, term.slave}, nil
}

// handOver is called once caged has the slave: systemd holds its own copy
// (ours would keep the pty open), and the copying starts.
func (t *terminal) handOver() error {
	if t == nil {
		return nil
	}
	t.slave.Close()
	return t.start()
}

func newTerminal(user [3]*os.File) (*terminal, error) {
	master, slave, err := termpkg.OpenPTY()
	if err != nil {
		return nil, fmt.Errorf("run: %w", err)
	}
	t := &terminal{user: user, master: master, slave: slave}
	termpkg.CopySize(user[0], slave)
	return t, nil
}

// start puts the user's terminal into raw mode (the cage's pty does the
// line discipline: echo, Ctrl-C, Ctrl-Z) and starts copying.
func (t *terminal) start() error {
	restore, err := termpkg.MakeRaw(t.user[0])
	if err != nil {
		return fmt.Errorf("run: raw mode: %w", err)
	}
	t.restore = restore
	termpkg.CopySize(t.user[0], t.master)
	go io.Copy(t.master, t.user[0])
	t.out.Add(1)
	go func() {
		defer t.out.Done()
		io.Copy(t.user[1], t.master)
	}()
	return nil
}

// finish drains what the cage wrote before it ended (systemd keeps the
// slave open while the unit exists, so there is no EOF to wait for) and
// gives the user's terminal back.
func (t *terminal) finish() {
	if t == nil {
		return
	}
	t.master.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	t.out.Wait()
	if t.restore != nil {
		t.restore()
		t.restore = nil
	}
}

func (t *terminal) Close() {
	if t == nil {
		return
	}
	if t.restore != nil {
		t.restore()
	}
	t.master.Close()
	t.slave.Close()
}

// osStdio are the process's real descriptors: they cross the bus to the
// cage, so buffers will not do.
func osStdio(env *Env) ([3]*os.File, error) {
	in, ok1 := env.In.(*os.File)
	out, ok2 := env.Out.(*os.File)
	errf, ok3 := env.Err.(*os.File)
	if !ok1 || !ok2 || !ok3 {
		return [3]*os.File{}, errors.New("stdin, stdout and stderr must be files, pipes or a terminal (they are handed to the cage)")
	}
	return [3]*os.File{in, out, errf}, nil
}
