package system

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/events"
	"github.com/nixcage/nixcage/internal/relay/tgfake"
	"github.com/nixcage/nixcage/internal/systest"
	"github.com/nixcage/nixcage/internal/testenv"
)

// relayConfig: alpha answers in its group and runs a scripted harness for
// its turns (the text on stdin, the reply on stdout), claude (the real
// Claude Code CLI) in its own; beta is outside the relay's account. ${role} and ${agents} are the relay account's scope.
const relayConfig = `
agent "alpha" {
  command      = ["/bin/sh", "-c", "exec sleep 600"]
  ${turn}
  autostart    = false
}
agent "beta" {
  command   = ["/bin/sh", "-c", "exec sleep 600"]
  autostart = false
}` + claudeTurnAgent + `
account "relay" {
  user = "cage-relay"
  role = "${role}"
  ${agents}
}
relay {
  token_file = "/etc/nixcage/secrets/telegram-token"
  owners     = [1001]
  account    = "relay"
  api_url    = "http://127.0.0.1:8081"
  chat "alpha" {
    chat_id = -100111
  }
  chat "claude" {
    chat_id = -100222
  }
}
store {
  channel = "stable"
  keys    = ["/etc/nixcage/release.pub"]
}
`

const (
	relayToken  = "4242:system-test-token"
	relayOwner  = 1001
	relayChat   = -100111
	claudeChat  = -100222
	tgfakeBin   = "/usr/local/libexec/nixcage-systest/tgfake"
	tgfakeCtl   = "/run/tgfake/control.sock"
	relayUnit   = "cage-relay.service"
	relayTokenF = "/etc/nixcage/secrets/telegram-token"
)

// relayTurn is alpha's scripted harness: the text on stdin, the reply on
// stdout, and what it has seen in its inbox.
const relayTurn = `turn_command = ["/bin/sh", "-c", "read -r line; case $line in *slowly*) sleep 5;; esac; n=$(cat /workspace/turns 2>/dev/null | wc -l); echo x >> /workspace/turns; echo \"turn $n heard: $line\"; ls /workspace/inbox 2>/dev/null"]`

func relayHCL(role, agents string) string {
	return strings.NewReplacer("${role}", role, "${agents}", agents, "${turn}", relayTurn).Replace(relayConfig)
}

// tarDir packs a release directory as an owner would send it:
// tar -C DIR -cf release.tar .
func tarDir(t *testing.T, dir string) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	err := filepath.Walk(dir, func(p string, info os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		h, err := tar.FileInfoHeader(info, "")
		if err != nil {
			return err
		}
		h.Name = "./" + filepath.ToSlash(rel)
		if info.IsDir() {
			h.Name += "/"
		}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if info.Mode().IsRegular() {
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			tw.Write(b)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	tw.Close()
	return buf.Bytes()
}

// TestRelayOnSystemd drives the real cage-relay, as its rendered unit runs
// it, against the fake Bot API server in the machine and the real caged on
// the machine's system bus: a stranger refused and audited, /status, a turn
// in the cage with typing shown and the reply posted, a file into the inbox
// and back with /get, a 429 waited out, a release refused while the account
// is scoped and then, as admin, a tampered release refused and a good one
// applied; every action a RelayAction in cagectl events and the journal.
// And what a compromised relay cannot do: read the token's source or a
// gateway's secrets, act on an agent outside its account, enter a cage's
// network. Stopping the relay leaves the agents running.
func TestRelayOnSystemd(t *testing.T) {
	testenv.RequireSystem(t)
	cagectl, bins := cagedBinaries(t)
	bins["cage-relay"] = systest.BuildT(t, "./cmd/cage-relay")
	fake := systest.BuildT(t, "./checks/system/tgfake")
	keys := releaseKey(t, cagectl)
	good := makeRelease(t, cagectl, keys+".key", 2, "hello-from-chat")
	goodTar := tarDir(t, good)
	// The same release with release.json changed after signing.
	bad := filepath.Join(t.TempDir(), "bad")
	if b, err := execCommand("cp", "-a", good, bad); err != nil {
		t.Fatalf("cp: %v\n%s", err, b)
	}
	manifest, _ := os.ReadFile(filepath.Join(bad, "release.json"))
	os.WriteFile(filepath.Join(bad, "release.json"), bytes.Replace(manifest, []byte(`"stable"`), []byte(`"stablf"`), 1), 0o644)
	badTar := tarDir(t, bad)

	m := systest.BootT(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	if err := m.CopyIn(keys+".pub", "/etc/nixcage/release.pub", 0o644); err != nil {
		t.Fatal(err)
	}
	if err := m.CopyIn(fake, tgfakeBin, 0o755); err != nil {
		t.Fatal(err)
	}
	installConfig(t, ctx, m, bins, relayHCL("operator", `agents = ["alpha", "claude"]`), map[string]string{relayTokenF: relayToken + "\n", "/etc/nixcage/secrets/anthropic": realAnthropicKey})
	sh, _ := machineScripts(t, ctx, m)
	fails := func(script string) string {
		t.Helper()
		out, err := m.Shell(ctx, script)
		var re *systest.RunError
		if !errors.As(err, &re) {
			t.Fatalf("%s succeeded (%v):\n%s", script, err, out)
		}
		return re.Stdout + re.Stderr
	}
	waitActive := func(unit string) {
		t.Helper()
		for i := 0; ; i++ {
			st, _ := m.UnitState(ctx, unit)
			if st.Active == "active" {
				return
			}
			if i > 150 {
				j, _ := m.Journal(ctx, unit)
				t.Fatalf("%s is %s/%s\n%s", unit, st.Active, st.Sub, j)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}

	// Why the relay has a declared user (docs/relay.md): a DynamicUser=
	// name exists only through nss-systemd, never in /etc/passwd, which is
	// all caged's os/user (built without cgo) reads.
	sh("systemd-run --quiet --unit=systest-dyn -p DynamicUser=yes -p User=systest-dyn sleep 120 && sleep 0.5 && getent passwd systest-dyn")
	fails("grep systest-dyn /etc/passwd")
	sh("systemctl stop systest-dyn")

	// As an operator installs it: the relay's user from sysusers.d, then
	// the units.
	sh("systemd-sysusers /etc/sysusers.d/cage-relay.conf && getent passwd cage-relay")
	sh("systemd-run --quiet --unit=systest-tgfake " + tgfakeBin + " --listen 127.0.0.1:8081 --control " + tgfakeCtl + " --token " + relayToken)
	sh("systemctl reload dbus && systemctl start nixcage-caged.service")
	waitActive("nixcage-caged.service")
	for i := 0; ; i++ {
		if _, err := os.Stat(m.Path(tgfakeCtl)); err == nil {
			break
		}
		if i > 100 {
			t.Fatal("the fake Bot API never made its control socket")
		}
		time.Sleep(50 * time.Millisecond)
	}
	tg := tgfake.NewRemote(m.Path(tgfakeCtl))

	// cagectl events from before the first message to the end.
	// The shell leaves its pid, so the stream is ended by that id.
	evCmd := m.Command(ctx, "/bin/sh", "-c", "echo $$ > /run/systest-relay-events.pid; exec cagectl events --json")
	evOut, _ := evCmd.StdoutPipe()
	if err := evCmd.Start(); err != nil {
		t.Fatal(err)
	}
	var evMu sync.Mutex
	var relayEvents []bus.Event
	evDone := make(chan struct{})
	go func() {
		defer close(evDone)
		sc := bufio.NewScanner(evOut)
		for sc.Scan() {
			var ev bus.Event
			if json.Unmarshal(sc.Bytes(), &ev) == nil && ev.Kind == bus.SignalRelayAction {
				evMu.Lock()
				relayEvents = append(relayEvents, ev)
				evMu.Unlock()
			}
		}
	}()
	time.Sleep(300 * time.Millisecond) // subscribed

	sh("systemctl start " + relayUnit)
	waitActive(relayUnit)

	seq := 0
	sayIn := func(chat, from int64, text string) {
		t.Helper()
		sent, err := tg.Sent(ctx, 0)
		if err != nil {
			t.Fatal(err)
		}
		seq = len(sent)
		if err := tg.AddMessage(ctx, tgfake.Message{From: &tgfake.User{ID: from, FirstName: "u", Username: "u" + itoa(int(from))},
			Chat: tgfake.Chat{ID: chat, Type: "supergroup"}, Text: text}); err != nil {
			t.Fatal(err)
		}
	}
	say := func(from int64, text string) { t.Helper(); sayIn(relayChat, from, text) }
	sendDoc := func(name, caption string, data []byte) {
		t.Helper()
		sent, _ := tg.Sent(ctx, 0)
		seq = len(sent)
		d, err := tg.AddFile(ctx, name, data)
		if err != nil {
			t.Fatal(err)
		}
		if err := tg.AddMessage(ctx, tgfake.Message{From: &tgfake.User{ID: relayOwner}, Chat: tgfake.Chat{ID: relayChat, Type: "supergroup"}, Document: d, Caption: caption}); err != nil {
			t.Fatal(err)
		}
	}
	reply := func(method string) tgfake.Sent {
		t.Helper()
		wctx, wcancel := context.WithTimeout(ctx, 60*time.Second)
		defer wcancel()
		s, err := tg.WaitSent(wctx, seq, func(s tgfake.Sent) bool { return s.Method == method && s.Refused == 0 })
		if err != nil {
			j, _ := m.Journal(ctx, relayUnit)
			t.Fatalf("no %s: %v\nrelay journal:\n%s", method, err, j)
		}
		return s
	}

	// A stranger is refused; nothing reaches caged but the record.
	say(666, "/start")
	if got := reply("sendMessage"); !strings.Contains(got.Text, "Refused: only the owners") {
		t.Fatalf("stranger answered %q", got.Text)
	}
	if st, _ := m.UnitState(ctx, systest.AgentUnit("alpha")); st.Active == "active" {
		t.Fatal("a stranger's /start started alpha")
	}

	say(relayOwner, "/status")
	if got := reply("sendMessage"); !strings.Contains(got.Text, "alpha: inactive/dead (service backend)") {
		t.Fatalf("/status answered %q", got.Text)
	}
	say(relayOwner, "/start")
	if got := reply("sendMessage"); got.Text != "alpha: start done." {
		t.Fatalf("/start answered %q", got.Text)
	}
	waitActive(systest.AgentUnit("alpha"))

	relayTurnsAndFiles(t, say, sendDoc, reply)

	// A message in claude's chat: a turn of the real Claude Code CLI in its
	// cage against the fake Anthropic API, the reply posted to that chat.
	t.Run("claude", func(t *testing.T) {
		tools := harnessToolsT(t, ctx)
		in := systest.StartInternetT(t, m)
		installTools(t, m, tools)
		defer removeTools(t, m) // the releases below start at generation 1
		claudeTurns(t, ctx, m, in, func(text string) string {
			sayIn(claudeChat, relayOwner, text)
			got := reply("sendMessage")
			if got.ChatID != claudeChat {
				t.Fatalf("the reply went to chat %d, want %d: %q", got.ChatID, claudeChat, got.Text)
			}
			return got.Text
		})
	})

	// 429: the relay waits retry_after, then answers.
	if err := tg.Inject(ctx, tgfake.Fault{Method: "sendMessage", Code: 429, Description: "Too Many Requests: retry after 2", RetryAfter: 2, Times: 1}); err != nil {
		t.Fatal(err)
	}
	say(relayOwner, "/status")
	ok := reply("sendMessage")
	sent, _ := tg.Sent(ctx, seq)
	if len(sent) < 2 || sent[0].Refused != 429 || ok.At.Sub(sent[0].At) < 2*time.Second {
		t.Fatalf("after a 429 with retry_after 2: %+v", sent)
	}

	// Scoped to alpha as an operator, the relay may not apply: caged says so.
	sendDoc("release.tar", "/apply", goodTar)
	if got := reply("sendMessage"); !strings.Contains(got.Text, "Refused: apply release.tar: access denied: cage-relay (uid") {
		t.Fatalf("scoped apply answered %q", got.Text)
	}

	// A compromised relay: as its user, in its mount namespace, with no
	// capabilities.
	pid := strings.TrimSpace(sh("systemctl show -P MainPID " + relayUnit))
	asRelay := "nsenter -t " + pid + " -m -- setpriv --reuid=cage-relay --regid=cage-relay --clear-groups --inh-caps=-all --bounding-set=-all "
	sh("systemctl start " + systest.EgressUnit("alpha"))
	// The probe itself works: what the relay may read, it reads.
	sh(asRelay + "cat /etc/nixcage/relay.json >/dev/null")
	creds := "/run/credentials/" + systest.EgressUnit("alpha") + "/ca.key"
	sh("test -s " + creds + " && test -s /var/lib/nixcage/egress/alpha/ca.key") // the secrets are there
	asUser := "setpriv --reuid=cage-relay --regid=cage-relay --clear-groups --inh-caps=-all --bounding-set=-all "
	for _, p := range []string{relayTokenF, "/var/lib/nixcage/egress/alpha/ca.key", creds} {
		// In the relay's own mount namespace (what its unit sees), and in
		// the host's (its uid alone).
		for _, how := range []string{asRelay, asUser} {
			out := fails(how + "cat " + p)
			t.Logf("relay reading %s: %s", p, strings.TrimSpace(out))
			if strings.Contains(out, "BEGIN") || strings.Contains(out, relayToken) ||
				!(strings.Contains(out, "Permission denied") || strings.Contains(out, "No such file")) {
				t.Fatalf("the relay reading %s: %s", p, out)
			}
		}
	}
	// Its own token it has, as a credential only.
	if got := sh("nsenter -t " + pid + " -m -- cat /run/credentials/" + relayUnit + "/telegram-token"); strings.TrimSpace(got) != relayToken {
		t.Fatalf("the relay's credential holds %q", got)
	}
	// Outside its account caged refuses it; inside, it may.
	if out := fails("setpriv --reuid=cage-relay --regid=cage-relay --clear-groups cagectl stop beta"); !strings.Contains(out, "cage-relay (uid") || !strings.Contains(out, "may not control agent beta") {
		t.Fatalf("stop beta as the relay: %s", out)
	}
	sh("setpriv --reuid=cage-relay --regid=cage-relay --clear-groups cagectl start alpha")
	// No way into a cage's network: it cannot join the namespace, and the
	// cage's gateway listens only inside it.
	out := fails(asRelay + "nsenter --net=/run/netns/nixcage-alpha true")
	t.Logf("relay entering alpha's netns: %s", strings.TrimSpace(out))
	fails("nsenter -t " + pid + " -m -n -- setpriv --reuid=cage-relay --regid=cage-relay --clear-groups bash -c 'exec 3<>/dev/tcp/127.0.0.1/3128'")
	sh("ip netns exec nixcage-alpha bash -c 'exec 3<>/dev/tcp/127.0.0.1/3128'") // it is there, for the cage

	// Relay down: the agents keep running and caged answers.
	sh("systemctl stop " + relayUnit)
	time.Sleep(2 * time.Second)
	if st, _ := m.UnitState(ctx, systest.AgentUnit("alpha")); st.Active != "active" {
		t.Fatalf("alpha is %s/%s with the relay stopped", st.Active, st.Sub)
	}
	sh("cagectl status | grep -q alpha")

	// As admin over every agent, the relay applies releases: a tampered one
	// is refused with caged's reason, a good one applied.
	m.MustWriteFile(t, systest.ConfigInstall, []byte(relayHCL("admin", "")), 0o644)
	sh("cagectl render " + systest.ConfigInstall + " --out /etc --bindir " + systest.BinDir + " && systemctl daemon-reload && systemctl reload dbus && cagectl reload")
	sh("systemctl start " + relayUnit)
	waitActive(relayUnit)
	sendDoc("bad.tar", "/apply", badTar)
	if got := reply("sendMessage"); !strings.HasPrefix(got.Text, "Refused: apply bad.tar:") && !strings.HasPrefix(got.Text, "Failed: apply bad.tar:") || !strings.Contains(got.Text, "signature") {
		t.Fatalf("tampered release answered %q", got.Text)
	}
	sendDoc("release.tar", "/apply", goodTar)
	if got := reply("sendMessage"); !strings.Contains(got.Text, "Release applied: generation 2 (channel stable) is current, was 0") {
		t.Fatalf("good release answered %q", got.Text)
	}
	if st := sh("cagectl status"); !strings.Contains(st, "generation 2") {
		t.Fatalf("status after the chat apply:\n%s", st)
	}

	// Every action is an event, from caged, stamped with the relay.
	time.Sleep(500 * time.Millisecond)
	sh("kill $(cat /run/systest-relay-events.pid)")
	<-evDone
	evCmd.Wait()
	evMu.Lock()
	defer evMu.Unlock()
	want := map[string]bool{"start refused not an owner": false, "status ok": false, "start ok": false, "apply refused": false, "apply ok": false,
		"turn ok": false, "upload ok": false, "get ok": false}
	for _, ev := range relayEvents {
		if !strings.HasPrefix(ev.Data["by"], "cage-relay (uid") {
			t.Errorf("event not stamped with the relay's account: %+v", ev)
		}
		for k := range want {
			f := strings.SplitN(k, " ", 3)
			if ev.Data["action"] == f[0] && ev.Data["outcome"] == f[1] && (len(f) < 3 || ev.Data["detail"] == f[2]) {
				want[k] = true
			}
		}
	}
	for k, seen := range want {
		if !seen {
			t.Errorf("no RelayAction event %q in cagectl events: %+v", k, relayEvents)
		}
	}
	if j := sh("journalctl -b --no-pager -o cat MESSAGE_ID=" + events.RelayAction.ID); !strings.Contains(j, "relay refused: telegram:666 (@u666) start on alpha: not an owner") {
		t.Errorf("journal relay-action entries:\n%s", j)
	}
}

func execCommand(name string, args ...string) ([]byte, error) {
	return exec.Command(name, args...).CombinedOutput()
}

// relayTurnsAndFiles: a file into the inbox, a turn that sees it, the
// file back, and a path outside the workspace refused.
func relayTurnsAndFiles(t *testing.T, say func(int64, string), sendDoc func(string, string, []byte), reply func(string) tgfake.Sent) {
	// A file into the inbox, then a turn that sees it, then the file back.
	sendDoc("notes.txt", "", []byte("read me, agent\n"))
	if got := reply("sendMessage"); !strings.Contains(got.Text, "Saved as /workspace/inbox/notes.txt") {
		t.Fatalf("upload answered %q", got.Text)
	}
	// A turn long enough for the typing indicator (re-sent every 4 s).
	say(relayOwner, "hello from chat, slowly")
	typing := reply("sendChatAction")
	if typing.Action != "typing" {
		t.Fatalf("action %+v", typing)
	}
	if got := reply("sendMessage"); !strings.Contains(got.Text, "turn 0 heard: hello from chat, slowly") || !strings.Contains(got.Text, "notes.txt") {
		t.Fatalf("turn answered %q", got.Text)
	}
	say(relayOwner, "and again")
	if got := reply("sendMessage"); !strings.Contains(got.Text, "turn 1 heard: and again") {
		t.Fatalf("second turn answered %q", got.Text)
	}
	say(relayOwner, "/get inbox/notes.txt")
	if got := reply("sendDocument"); string(got.Data) != "read me, agent\n" || got.FileName != "notes.txt" {
		t.Fatalf("/get sent %q %q", got.FileName, got.Data)
	}
	say(relayOwner, "/get ../../../etc/shadow")
	if got := reply("sendMessage"); !strings.HasPrefix(got.Text, "Refused: get ../../../etc/shadow") {
		t.Fatalf("/get outside the workspace answered %q", got.Text)
	}

}
