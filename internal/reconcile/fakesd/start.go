package fakesd

import (
	"path/filepath"
	"testing"

	sdbus "github.com/coreos/go-systemd/v22/dbus"
	"github.com/godbus/dbus/v5"

	"github.com/nixcage/nixcage/internal/bus/bustest"
)

// Start runs a private dbus-daemon with a fake systemd on it that reads
// units from root/etc/systemd/system and root/run/systemd/system, and
// returns the fake and a go-systemd client connected to it.
func Start(t testing.TB, root string) (*Systemd, *sdbus.Conn, *bustest.Bus) {
	t.Helper()
	b := bustest.Start(t, bustest.Options{Permissive: true})
	dirs := []string{filepath.Join(root, "etc/systemd/system"), filepath.Join(root, "run/systemd/system")}
	sd, err := Export(b.Conn(t), dirs, root)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := sdbus.NewConnection(func() (*dbus.Conn, error) { return bustest.Dial(b.Address) })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(conn.Close)
	return sd, conn, b
}
