package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/relay/tg"
	"github.com/nixcage/nixcage/internal/stdio"
)

// options are cage-relay's flags.
type options struct {
	config    string
	busAddr   string
	tokenFile string
	verbose   bool
}

func parseFlags(args []string, s stdio.Stdio) (*options, error) {
	fs := flag.NewFlagSet("cage-relay", flag.ContinueOnError)
	fs.SetOutput(s.Err)
	o := &options{}
	fs.StringVar(&o.config, "config", filepath.Join(paths.DefaultPrefix, paths.RelayConfig), "the relay's runtime document (cagectl render writes it)")
	fs.StringVar(&o.busAddr, "bus", "", "D-Bus address of caged's bus (default: the system bus)")
	fs.StringVar(&o.tokenFile, "token-file", "", "bot token file (default: the "+paths.RelayTokenCredential+" credential, $CREDENTIALS_DIRECTORY/"+paths.RelayTokenCredential+")")
	fs.BoolVar(&o.verbose, "v", false, "log debug messages")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() != 0 {
		return nil, fmt.Errorf("unexpected arguments %q; cage-relay takes only flags", fs.Args())
	}
	if o.tokenFile == "" {
		dir := os.Getenv("CREDENTIALS_DIRECTORY")
		if dir == "" {
			return nil, errors.New("no bot token: run under systemd with LoadCredential=" + paths.RelayTokenCredential + ":PATH (the rendered cage-relay.service does), or pass --token-file")
		}
		o.tokenFile = filepath.Join(dir, paths.RelayTokenCredential)
	}
	return o, nil
}

// LoadDoc reads and checks the relay's runtime document; unknown fields
// are errors.
func LoadDoc(p string) (config.RelayDoc, error) {
	var d config.RelayDoc
	b, err := os.ReadFile(p)
	if err != nil {
		return d, fmt.Errorf("relay config: %w", err)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&d); err != nil {
		return d, fmt.Errorf("relay config %s: %w", p, err)
	}
	if err := d.Check(); err != nil {
		return d, fmt.Errorf("relay config %s: %w", p, err)
	}
	return d, nil
}

func readToken(p string) (string, error) {
	b, err := os.ReadFile(p)
	if err != nil {
		return "", fmt.Errorf("bot token: %w", err)
	}
	t := strings.TrimSpace(string(b))
	if t == "" || strings.ContainsAny(t, " \t\r\n/") {
		return "", fmt.Errorf("bot token %s: want one line such as 123456:ABC-DEF (as @BotFather gives it)", p)
	}
	return t, nil
}

// Run is cage-relay: it serves until SIGTERM, or fails when caged's bus
// goes away (systemd restarts it; agents are not affected either way).
func Run(ctx context.Context, args []string, s stdio.Stdio) error {
	o, err := parseFlags(args, s)
	if err != nil {
		return err
	}
	lv := slog.LevelInfo
	if o.verbose {
		lv = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(s.Err, &slog.HandlerOptions{Level: lv}))
	doc, err := LoadDoc(o.config)
	if err != nil {
		return err
	}
	token, err := readToken(o.tokenFile)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM, os.Interrupt)
	defer stop()
	c, err := bus.Dial(ctx, o.busAddr)
	if err != nil {
		return err
	}
	defer c.Close()
	t, err := tg.New(ctx, token, tg.Options{APIURL: doc.APIURL, Log: log})
	if err != nil {
		return err
	}
	log.Info("relay started", "bot", t.Username, "chats", len(doc.Chats), "owners", len(doc.Owners))
	r := New(doc, t, c, log)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	polled := make(chan struct{})
	go func() { t.Run(ctx); close(polled) }()
	busGone := c.Conn().Context().Done()
	go func() {
		select {
		case <-busGone:
			cancel()
		case <-ctx.Done():
		}
	}()
	err = r.Serve(ctx)
	cancel()
	<-polled
	select {
	case <-busGone:
		return fmt.Errorf("lost the connection to caged's bus; exiting so systemd restarts the relay")
	default:
	}
	return err
}
