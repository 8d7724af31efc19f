package tgfake

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
)

// Run serves a fake Bot API on --listen (TCP) and its control API on
// --control (a unix socket, so a test on the host reaches it through the
// machine's root), until ctx ends: checks/system/tgfake inside a test
// machine.
func Run(ctx context.Context, args []string, stderr io.Writer) error {
	fs := flag.NewFlagSet("tgfake", flag.ContinueOnError)
	fs.SetOutput(stderr)
	listen := fs.String("listen", "127.0.0.1:8081", "Bot API address")
	control := fs.String("control", "/run/tgfake/control.sock", "control socket")
	token := fs.String("token", "", "the bot token the fake accepts")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *token == "" {
		return errors.New("--token is required")
	}
	s := New(*token)
	api, err := net.Listen("tcp", *listen)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(*control), 0o700); err != nil {
		return err
	}
	os.Remove(*control)
	ctl, err := net.Listen("unix", *control)
	if err != nil {
		return err
	}
	errc := make(chan error, 2)
	go func() { errc <- http.Serve(api, s.Handler()) }()
	go func() { errc <- http.Serve(ctl, s.Control()) }()
	select {
	case <-ctx.Done():
		api.Close()
		ctl.Close()
		return nil
	case err := <-errc:
		return fmt.Errorf("tgfake: %w", err)
	}
}
