// Package bustest starts a private dbus-daemon for tests: the real broker,
// with either a system-bus-like policy (default deny, plus the policy files
// nixcage ships) or a permissive one for fakes.
package bustest

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/godbus/dbus/v5"

	"github.com/nixcage/nixcage/internal/testenv"
)

// systemLike mirrors the defaults of Debian's /usr/share/dbus-1/system.conf:
// everybody may connect and receive, nobody may own names or call methods
// unless a policy file allows it.
const systemLike = `
  <policy context="default">
    <allow user="*"/>
    <deny own="*"/>
    <deny send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_requested_reply="true" send_type="method_return"/>
    <allow send_requested_reply="true" send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
    <allow receive_type="signal"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Introspectable"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Properties"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Peer"/>
    <deny send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus" send_member="UpdateActivationEnvironment"/>
    <deny send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Debug.Stats"/>
  </policy>
`

const permissive = `
  <policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_requested_reply="true" send_type="method_return"/>
    <allow send_requested_reply="true" send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
    <allow receive_type="signal"/>
  </policy>
`

// Bus is a running private dbus-daemon.
type Bus struct {
	Address string
	Dir     string // world-traversable directory holding the socket
}

// Options choose the daemon's policy.
type Options struct {
	// Permissive allows everything (for fakes such as fakesd).
	Permissive bool
	// Include are policy files added after the defaults, as a system bus
	// includes /etc/dbus-1/system.d/*.conf.
	Include []string
}

// Config is the dbus-daemon configuration of a bus listening on socket
// with o's policy (also for a broker a test starts elsewhere, such as in a
// booted machine).
func Config(socket string, o Options) string {
	pol := systemLike
	if o.Permissive {
		pol = permissive
	}
	var inc strings.Builder
	for _, f := range o.Include {
		fmt.Fprintf(&inc, "  <include>%s</include>\n", f)
	}
	return fmt.Sprintf(`<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>custom</type>
  <listen>unix:path=%s</listen>
  <auth>EXTERNAL</auth>
%s%s</busconfig>
`, socket, pol, inc.String())
}

// Start runs dbus-daemon until the test ends.
func Start(t testing.TB, o Options) *Bus {
	t.Helper()
	bin := testenv.LookPath(t, "dbus-daemon")
	dir, err := os.MkdirTemp("", "nixcage-bus-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	// Other uids (subprocess clients) must reach the socket.
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	cf := filepath.Join(dir, "bus.conf")
	if err := os.WriteFile(cf, []byte(Config(filepath.Join(dir, "bus"), o)), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "--config-file="+cf, "--print-address", "--nofork", "--nopidfile")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("dbus-daemon: %v", err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	addrCh := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(out).ReadString('\n')
		addrCh <- strings.TrimSpace(line)
	}()
	select {
	case addr := <-addrCh:
		if addr == "" {
			t.Fatalf("dbus-daemon printed no address (config %s): %s", cf, stderr.String())
		}
		return &Bus{Address: addr, Dir: dir}
	case <-time.After(30 * time.Second):
		t.Fatal("dbus-daemon did not start")
	}
	return nil
}

// Conn opens a new connection to the bus (closed when the test ends).
func (b *Bus) Conn(t testing.TB) *dbus.Conn {
	t.Helper()
	c, err := Dial(b.Address)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// Dial connects and authenticates to address.
func Dial(address string) (*dbus.Conn, error) {
	c, err := dbus.Dial(address)
	if err != nil {
		return nil, err
	}
	if err := c.Auth(nil); err != nil {
		c.Close()
		return nil, err
	}
	if err := c.Hello(); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}
