package cli

import (
	"context"
	"errors"
	"flag"
	"regexp"

	"github.com/nixcage/nixcage/internal/bus"
)

// BusEnv names the environment variable that selects a bus other than the
// system bus (tests, a second appliance on one host).
const BusEnv = "NIXCAGE_BUS_ADDRESS"

// addBusFlag adds --bus ADDRESS, defaulting to $NIXCAGE_BUS_ADDRESS.
func addBusFlag(fs *flag.FlagSet, env *Env) *string {
	return fs.String("bus", env.Getenv(BusEnv), "D-Bus `ADDRESS` where caged is (default: the system bus, or $"+BusEnv+")")
}

// dialCaged connects to caged; unreachable is ExitNoConn.
func dialCaged(ctx context.Context, addr string) (*bus.Client, error) {
	c, err := bus.Dial(ctx, addr)
	if err != nil {
		return nil, &ExitError{Code: ExitNoConn, Err: err}
	}
	return c, nil
}

// busError turns a caged error into the exit code scripts rely on.
func busError(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, bus.ErrDenied):
		return &ExitError{Code: ExitDenied, Err: err}
	case errors.Is(err, bus.ErrUnavailable):
		return &ExitError{Code: ExitNoConn, Err: err}
	case errors.Is(err, bus.ErrIO):
		return &ExitError{Code: ExitIO, Err: err}
	}
	var ee *ExitError
	if errors.As(err, &ee) {
		return err
	}
	return &ExitError{Code: ExitFailure, Err: err}
}

var agentNameRE = regexp.MustCompile(`^[a-z][a-z0-9-]*$`)

// checkAgent refuses names that cannot be agents before they reach a bus
// call or a command line.
func checkAgent(name string) error {
	if !agentNameRE.MatchString(name) {
		return usageError("%q is not an agent name (lowercase letters, digits and '-', starting with a letter)", name)
	}
	return nil
}
