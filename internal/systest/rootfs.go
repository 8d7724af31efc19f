// Package systest boots disposable Debian machines with a real systemd for
// nixcage's system tests and its demo.
//
// The development and CI machines run Debian 12 without systemd as PID 1, so
// a test that needs systemd makes one: a bookworm tree built once with
// debootstrap and cached, booted with systemd-nspawn on a throw-away overlay.
// Nothing a test does inside a machine reaches the host: the machine has its
// own network namespace holding only what the harness puts there (a fake
// internet on TEST-NET addresses), and it dies with the test process.
package systest

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
)

// Suite is the Debian release machines run: the one the design was checked on
// (systemd 252).
const Suite = "bookworm"

// Packages are installed on top of debootstrap's minbase. Why each is here:
// systemd+systemd-sysv+dbus boot the machine; libnss-systemd names DynamicUser
// accounts; iproute2 manages namespaces and the fake internet; curl and
// ca-certificates give the demo a familiar client and update-ca-certificates;
// systemd-container runs the nspawn backend; podman+runc+uidmap run the podman
// backend (containernetworking-plugins satisfies podman's virtual
// container-network-stack dependency, which debootstrap cannot resolve);
// procps and netbase make the machine usable by hand (`--keep`); nginx
// serves a release channel to caged (checks/system TestChannelOnSystemd;
// masked below, the test starts it with its own configuration).
var Packages = []string{
	"ca-certificates",
	"containernetworking-plugins",
	"curl",
	"dbus",
	"iproute2",
	"libnss-systemd",
	"netbase",
	"nginx",
	"podman",
	"procps",
	"runc",
	"systemd",
	"systemd-container",
	"systemd-sysv",
	"uidmap",
}

// rootfsRevision changes the cache key when customize changes.
const rootfsRevision = "3"

// DefaultCacheDir keeps built trees between runs. Override with
// NIXCAGE_SYSTEST_CACHE.
const DefaultCacheDir = "/var/cache/nixcage-systest"

// CacheDir is where trees and downloaded packages are kept.
func CacheDir() string {
	if d := os.Getenv("NIXCAGE_SYSTEST_CACHE"); d != "" {
		return d
	}
	return DefaultCacheDir
}

// Mirror is the Debian mirror debootstrap uses: NIXCAGE_SYSTEST_MIRROR, or the
// first Debian mirror apt on this host is configured with, so a machine that
// reaches Debian only through its apt configuration builds the tree the same way.
func Mirror() string {
	if m := os.Getenv("NIXCAGE_SYSTEST_MIRROR"); m != "" {
		return m
	}
	if m := aptMirror("/etc/apt"); m != "" {
		return m
	}
	return "http://deb.debian.org/debian"
}

// aptMirror finds the URI of the main Debian archive in apt's sources, in
// one-line or deb822 format. Security and third-party repositories are skipped:
// debootstrap needs the archive that carries the suite itself.
func aptMirror(etcApt string) string {
	files := []string{filepath.Join(etcApt, "sources.list")}
	more, _ := filepath.Glob(filepath.Join(etcApt, "sources.list.d", "*"))
	sort.Strings(more)
	files = append(files, more...)
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		if m := mirrorFromSources(string(data)); m != "" {
			return m
		}
	}
	return ""
}

func mirrorFromSources(text string) string {
	isArchive := func(uri string, suites []string) bool {
		if strings.Contains(uri, "security") {
			return false
		}
		for _, s := range suites {
			if s == Suite {
				return strings.HasPrefix(uri, "http://") || strings.HasPrefix(uri, "https://")
			}
		}
		return false
	}
	// deb822 stanzas.
	for _, stanza := range strings.Split(text, "\n\n") {
		var uris, suites []string
		deb := false
		for _, line := range strings.Split(stanza, "\n") {
			k, v, ok := strings.Cut(line, ":")
			if !ok || strings.HasPrefix(strings.TrimSpace(line), "#") {
				continue
			}
			switch strings.ToLower(strings.TrimSpace(k)) {
			case "types":
				deb = strings.Contains(" "+v+" ", " deb ")
			case "uris":
				uris = strings.Fields(v)
			case "suites":
				suites = strings.Fields(v)
			}
		}
		if deb {
			for _, u := range uris {
				if isArchive(u, suites) {
					return strings.TrimRight(u, "/")
				}
			}
		}
	}
	// One-line format: deb [opts] URI SUITE COMPONENTS...
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 3 || f[0] != "deb" {
			continue
		}
		f = f[1:]
		if strings.HasPrefix(f[0], "[") {
			for len(f) > 0 && !strings.HasSuffix(f[0], "]") {
				f = f[1:]
			}
			if len(f) > 0 {
				f = f[1:]
			}
		}
		if len(f) >= 2 && isArchive(f[0], f[1:2]) {
			return strings.TrimRight(f[0], "/")
		}
	}
	return ""
}

// ProxyEnv returns http_proxy/https_proxy settings from apt's
// configuration, so debootstrap (which runs wget, not apt) goes the same way.
func ProxyEnv(ctx context.Context) []string { return aptProxyEnv(ctx) }

func aptProxyEnv(ctx context.Context) []string {
	var env []string
	for _, kv := range [][2]string{{"Acquire::http::Proxy", "http_proxy"}, {"Acquire::https::Proxy", "https_proxy"}} {
		out, err := exec.CommandContext(ctx, "apt-config", "shell", "V", kv[0]).Output()
		if err != nil {
			continue
		}
		// Output is V='value'.
		s := strings.TrimSpace(string(out))
		if v, ok := strings.CutPrefix(s, "V='"); ok {
			v = strings.TrimSuffix(v, "'")
			if v != "" && v != "DIRECT" {
				env = append(env, kv[1]+"="+v)
			}
		}
	}
	return env
}

// RootfsKey names a tree by everything that decides its content.
func RootfsKey(mirror string) string {
	h := sha256.New()
	fmt.Fprintf(h, "suite=%s\nmirror=%s\nrev=%s\n", Suite, mirror, rootfsRevision)
	for _, p := range Packages {
		fmt.Fprintf(h, "pkg=%s\n", p)
	}
	io.WriteString(h, customizeScript)
	return hex.EncodeToString(h.Sum(nil))[:16]
}

// EnsureRootfs returns a cached machine tree, building it first if needed.
// Building takes about 90 s; concurrent callers (parallel test packages, the
// demo) wait on a lock instead of building twice. The tree appears under its
// final name only when complete (built in a temporary directory, renamed), so
// an interrupted build never leaves a tree that looks usable.
func EnsureRootfs(ctx context.Context, log io.Writer) (string, error) {
	cache := CacheDir()
	if abs, _ := filepath.Abs(cache); abs == "/tmp" || strings.HasPrefix(abs, "/tmp/") {
		// Machines boot in a mount namespace with a tmpfs over /tmp (see
		// Boot), where a tree under /tmp does not exist.
		return "", fmt.Errorf("machine tree cache %s is under /tmp, which every machine's systemd-nspawn runs behind a tmpfs of its own: set NIXCAGE_SYSTEST_CACHE to a directory elsewhere (default %s)", cache, DefaultCacheDir)
	}
	mirror := Mirror()
	final := filepath.Join(cache, "rootfs-"+RootfsKey(mirror))
	if ok, err := complete(final); err != nil || ok {
		return final, err
	}
	if err := os.MkdirAll(cache, 0o755); err != nil {
		return "", fmt.Errorf("create cache dir: %w", err)
	}
	lock, err := os.OpenFile(filepath.Join(cache, "lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return "", fmt.Errorf("open cache lock: %w", err)
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return "", fmt.Errorf("lock cache: %w", err)
	}
	defer syscall.Flock(int(lock.Fd()), syscall.LOCK_UN)
	if ok, err := complete(final); err != nil || ok {
		return final, err
	}
	// Leftovers of builds that were killed hold nothing worth keeping.
	stale, _ := filepath.Glob(filepath.Join(cache, "building-*"))
	for _, s := range stale {
		os.RemoveAll(s)
	}
	tmp, err := os.MkdirTemp(cache, "building-")
	if err != nil {
		return "", fmt.Errorf("create build dir: %w", err)
	}
	defer os.RemoveAll(tmp)
	debs := filepath.Join(cache, "debs")
	if err := os.MkdirAll(debs, 0o755); err != nil {
		return "", fmt.Errorf("create package cache: %w", err)
	}
	fmt.Fprintf(log, "systest: building %s tree with debootstrap from %s (cached in %s)\n", Suite, mirror, final)
	cmd := exec.CommandContext(ctx, "debootstrap",
		"--variant=minbase",
		"--include="+strings.Join(Packages, ","),
		"--cache-dir="+debs,
		Suite, tmp, mirror)
	cmd.Env = append(os.Environ(), aptProxyEnv(ctx)...)
	var out tailBuffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("debootstrap %s from %s: %w\n%s\n(full log: %s/debootstrap/debootstrap.log is removed with the build dir; rerun by hand to inspect)", Suite, mirror, err, out.String(), tmp)
	}
	if err := customize(ctx, tmp); err != nil {
		return "", err
	}
	if err := os.WriteFile(filepath.Join(tmp, ".nixcage-systest-complete"), []byte(RootfsKey(mirror)+"\n"), 0o644); err != nil {
		return "", fmt.Errorf("mark tree complete: %w", err)
	}
	if err := os.Rename(tmp, final); err != nil {
		return "", fmt.Errorf("publish tree: %w", err)
	}
	fmt.Fprintf(log, "systest: tree ready: %s\n", final)
	return final, nil
}

func complete(dir string) (bool, error) {
	_, err := os.Stat(filepath.Join(dir, ".nixcage-systest-complete"))
	if err == nil {
		return true, nil
	}
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	return false, fmt.Errorf("check cached tree: %w", err)
}

// customizeScript runs chrooted in a fresh tree. It switches off units that
// only cost boot time or fail on a volatile root (podman's timers expect
// persistent storage), and leaves the machine's resolver to the harness.
const customizeScript = `set -e
echo nixcage-systest > /etc/hostname
for u in podman-auto-update.timer podman-auto-update.service podman-restart.service \
         podman.socket podman.service console-getty.service getty@.service \
         e2scrub_all.timer e2scrub_reap.service apt-daily.timer apt-daily-upgrade.timer \
         fstrim.timer systemd-tmpfiles-clean.timer nginx.service; do
  ln -sf /dev/null /etc/systemd/system/$u
done
rm -f /etc/resolv.conf
echo 'nameserver 127.0.0.1' > /etc/resolv.conf
mkdir -p /etc/systemd/journald.conf.d
printf '[Journal]\nStorage=volatile\n' > /etc/systemd/journald.conf.d/nixcage-systest.conf
`

func customize(ctx context.Context, root string) error {
	cmd := exec.CommandContext(ctx, "chroot", root, "/bin/sh", "-c", customizeScript)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("customize tree: %w\n%s", err, out)
	}
	return nil
}

// tailBuffer keeps the last 8 KiB written: enough to show why a command failed.
type tailBuffer struct{ b []byte }

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.b = append(t.b, p...)
	if len(t.b) > 8192 {
		t.b = t.b[len(t.b)-8192:]
	}
	return len(p), nil
}

func (t *tailBuffer) String() string { return string(t.b) }
