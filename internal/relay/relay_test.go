package relay_test

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/relay"
	"github.com/nixcage/nixcage/internal/relay/tg"
	"github.com/nixcage/nixcage/internal/relay/tgfake"
)

const (
	token    = "4242:relay-test-token"
	owner    = 1001
	chatA    = -100111 // alice, the whole chat
	forum    = -100222 // bob, topic 5 of a forum group
	topicB   = 5
	stranger = 666
)

// fakeCaged stands in for caged's bus API in this tier (the system test
// drives the real caged): it records calls and answers as told.
type fakeCaged struct {
	mu       sync.Mutex
	calls    []string
	records  []bus.RelayAction
	deny     map[string]bool // agent -> access denied
	turnGate chan struct{}   // when set, Turn waits for it
	turnOut  string
	running  int
	maxRun   int
	files    map[string][]byte
	applied  map[string]string // unpacked release, path -> content
	events   chan bus.Event
}

func newFake() *fakeCaged {
	return &fakeCaged{deny: map[string]bool{}, files: map[string][]byte{}, turnOut: "the answer", events: make(chan bus.Event, 4)}
}

func (f *fakeCaged) call(s string) {
	f.mu.Lock()
	f.calls = append(f.calls, s)
	f.mu.Unlock()
}

func (f *fakeCaged) Calls() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.calls...)
}

func (f *fakeCaged) Records() []bus.RelayAction {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]bus.RelayAction(nil), f.records...)
}

func (f *fakeCaged) check(agent string) error {
	if f.deny[agent] {
		return &bus.RemoteError{Name: bus.ErrorAccessDenied, Message: "access denied: cage-relay (uid 990) may not control agent " + agent}
	}
	return nil
}

func (f *fakeCaged) Status(ctx context.Context) (*bus.Status, error) {
	f.call("status")
	return &bus.Status{Generation: 3, Channel: "stable", Freshness: "ok", Agents: []bus.AgentStatus{
		{Name: "alice", Backend: "service", ActiveState: "active", SubState: "running", EgressState: "active", Allowed: 4},
		{Name: "bob", Backend: "nspawn", ActiveState: "inactive", SubState: "dead", EgressState: "inactive"},
	}}, nil
}
func (f *fakeCaged) Start(ctx context.Context, a string) error {
	f.call("start " + a)
	return f.check(a)
}
func (f *fakeCaged) Stop(ctx context.Context, a string) error { f.call("stop " + a); return f.check(a) }
func (f *fakeCaged) Kill(ctx context.Context, a string) error { f.call("kill " + a); return f.check(a) }
func (f *fakeCaged) Quarantine(ctx context.Context, a, reason string) (string, error) {
	f.call("quarantine " + a + " " + reason)
	return "/var/lib/nixcage/evidence/" + a + "-1", f.check(a)
}
func (f *fakeCaged) ReadLogs(ctx context.Context, a string, n uint32, cursor string) ([]string, string, error) {
	f.call(fmt.Sprintf("logs %s %d", a, n))
	return []string{"line one", "line \x1b[2Jtwo"}, "c", f.check(a)
}
func (f *fakeCaged) ReadAudit(ctx context.Context, a string, off int64, max uint32) ([]string, int64, error) {
	f.call(fmt.Sprintf("audit %s %d %d", a, off, max))
	return []string{`{"schema":1,"ts":"2026-12-01T12:00:00Z","decision":"blocked","method":"CONNECT","host":"evil.example.org","port":443,"reason":"not allowed"}`}, 10, f.check(a)
}
func (f *fakeCaged) ApplyDir(ctx context.Context, dir *os.File) (*bus.ApplyResult, error) {
	f.call("apply")
	f.mu.Lock()
	defer f.mu.Unlock()
	f.applied = map[string]string{}
	root := fmt.Sprintf("/proc/self/fd/%d/", dir.Fd())
	filepath.Walk(root, func(p string, info os.FileInfo, err error) error {
		if err == nil && info.Mode().IsRegular() {
			b, _ := os.ReadFile(p)
			rel, _ := filepath.Rel(filepath.Clean(root), p)
			f.applied[rel] = string(b)
		}
		return nil
	})
	if _, ok := f.applied["release.json"]; !ok {
		return nil, &bus.RemoteError{Name: bus.ErrorFailed, Message: "release: no release.json"}
	}
	return &bus.ApplyResult{Generation: 4, Previous: 3, Channel: "stable", Added: 2}, nil
}
func (f *fakeCaged) AllowHost(ctx context.Context, a, host string, port int, d time.Duration, reason string) (*bus.Grant, error) {
	f.call(fmt.Sprintf("allow %s %s %d %s %s", a, host, port, d, reason))
	return &bus.Grant{ID: "g1", Agent: a, Host: host, Port: int32(port), ExpiresUnix: time.Now().Add(d).Unix()}, f.check(a)
}
func (f *fakeCaged) ListGrants(ctx context.Context, a string) ([]bus.Grant, error) {
	f.call("grants " + a)
	return []bus.Grant{{ID: "g1", Agent: a, Host: "api.example.com", ExpiresUnix: 2e9, By: "x", Reason: "r"}}, f.check(a)
}
func (f *fakeCaged) ListApprovals(ctx context.Context, a string) ([]bus.Approval, error) {
	f.call("approvals " + a)
	if a != "alice" {
		return []bus.Approval{}, f.check(a)
	}
	now := time.Now().Unix()
	return []bus.Approval{{ID: "a-3f2a9c01b7de", Agent: a, Host: "registry.npmjs.org", Port: 443, Method: "CONNECT", Path: "/x\x1b[31m", SinceUnix: now, ExpiresUnix: now + 30}}, f.check(a)
}
func (f *fakeCaged) Decide(ctx context.Context, id, verdict string) (string, error) {
	f.call("decide " + id + " " + verdict)
	if verdict == "host" {
		return "g-1234", nil
	}
	return "", nil
}
func (f *fakeCaged) Events(ctx context.Context) (<-chan bus.Event, error) {
	out := make(chan bus.Event)
	go func() {
		defer close(out)
		for {
			select {
			case <-ctx.Done():
				return
			case ev := <-f.events:
				out <- ev
			}
		}
	}()
	return out, nil
}
func (f *fakeCaged) RecordRelayAction(ctx context.Context, a bus.RelayAction) error {
	f.mu.Lock()
	f.records = append(f.records, a)
	f.mu.Unlock()
	return nil
}
func (f *fakeCaged) Turn(ctx context.Context, a, msg string) (bus.TurnResult, error) {
	f.mu.Lock()
	f.calls = append(f.calls, "turn "+a+" "+msg)
	f.running++
	if f.running > f.maxRun {
		f.maxRun = f.running
	}
	gate, out := f.turnGate, f.turnOut
	f.mu.Unlock()
	if gate != nil {
		<-gate
	}
	f.mu.Lock()
	f.running--
	f.mu.Unlock()
	if strings.HasPrefix(msg, "fail") {
		return bus.TurnResult{Reply: "partial\n--- stderr ---\nboom", Status: bus.TurnFailed, Exit: 2}, nil
	}
	return bus.TurnResult{Reply: out + " to " + msg, Status: bus.TurnSuccess}, f.check(a)
}
func (f *fakeCaged) GetFile(ctx context.Context, a, p string, max uint64) (*os.File, uint64, error) {
	f.call("get " + a + " " + p)
	if err := f.check(a); err != nil {
		return nil, 0, err
	}
	data, ok := f.files[p]
	if !ok {
		return nil, 0, &bus.RemoteError{Name: bus.ErrorInvalid, Message: "no file " + p + " in the workspace"}
	}
	tmp, _ := os.CreateTemp("", "fakeget")
	os.Remove(tmp.Name())
	tmp.Write(data)
	tmp.Seek(0, 0)
	return tmp, uint64(len(data)), nil
}
func (f *fakeCaged) PutFile(ctx context.Context, a, name string, file *os.File) (string, error) {
	b, _ := io.ReadAll(file)
	f.call("put " + a + " " + name)
	f.mu.Lock()
	f.files["inbox/"+name] = b
	f.mu.Unlock()
	return "inbox/" + name, f.check(a)
}

type harness struct {
	tg    *tgfake.Server
	caged *fakeCaged
	relay *relay.Relay
}

func start(t *testing.T) *harness {
	t.Helper()
	fc := newFake()
	h := startWith(t, fc)
	h.caged = fc
	return h
}

// startWith runs the relay against c (the fake, or a real caged's client).
func startWith(t *testing.T, cg relay.Caged) *harness {
	t.Helper()
	s := tgfake.New(token)
	hs := httptest.NewServer(s.Handler())
	t.Cleanup(hs.Close)
	doc := config.RelayDoc{Schema: config.RelayDocSchema, Owners: []int64{owner}, APIURL: hs.URL, MaxFileBytes: 1 << 20,
		Chats: []config.RelayChat{{Agent: "alice", ChatID: chatA}, {Agent: "bob", ChatID: forum, Topic: topicB}}}
	if err := doc.Check(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	lim := tg.NewLimiter(nil)
	lim.ChatInterval = 5 * time.Millisecond // the limits themselves are TestLimiter's
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	c, err := tg.New(ctx, token, tg.Options{APIURL: hs.URL, PollTimeout: 2 * time.Second, Limiter: lim, Log: log})
	if err != nil {
		t.Fatal(err)
	}
	r := relay.New(doc, c, cg, log)
	r.TypingEvery = 30 * time.Millisecond
	r.Tmp = t.TempDir()
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); c.Run(ctx) }()
	go func() { defer wg.Done(); r.Serve(ctx) }()
	t.Cleanup(func() { cancel(); wg.Wait() })
	return &harness{tg: s, relay: r}
}

func (h *harness) say(from int64, chat int64, topic int64, text string) int {
	n := len(h.tg.Sent(0))
	h.tg.AddMessage(tgfake.Message{From: &tgfake.User{ID: from, FirstName: "u", Username: "user" + fmt.Sprint(from)},
		Chat: tgfake.Chat{ID: chat, Type: "supergroup"}, MessageThreadID: topic, Text: text})
	return n
}

// reply waits for the next message sent from seq on.
func (h *harness) reply(t *testing.T, from int, method string) tgfake.Sent {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := h.tg.WaitSent(ctx, from, func(s tgfake.Sent) bool { return s.Method == method && s.Refused == 0 })
	if err != nil {
		t.Fatalf("no %s: %v (sent: %+v)", method, err, h.tg.Sent(from))
	}
	return s
}

// record waits for an audit record of action.
func (h *harness) record(t *testing.T, action string, n int) bus.RelayAction {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		var got []bus.RelayAction
		for _, r := range h.caged.Records() {
			if r.Action == action {
				got = append(got, r)
			}
		}
		if len(got) >= n {
			return got[n-1]
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("no audit record %d of %s: %+v", n, action, h.caged.Records())
	return bus.RelayAction{}
}

func TestStrangerRefusedAndAudited(t *testing.T) {
	h := start(t)
	seq := h.say(stranger, chatA, 0, "/stop")
	got := h.reply(t, seq, "sendMessage")
	if !strings.Contains(got.Text, "Refused") || got.ChatID != chatA {
		t.Fatalf("reply %+v", got)
	}
	rec := h.record(t, "stop", 1)
	if rec.Outcome != bus.RelayRefused || rec.Agent != "alice" || !strings.Contains(rec.Actor, "telegram:666") || rec.Detail != "not an owner" {
		t.Fatalf("record %+v", rec)
	}
	// Again: audited again, but not answered again (the bot's send budget
	// is the owners').
	seq = h.say(stranger, chatA, 0, "hello agent")
	h.record(t, "message", 1)
	time.Sleep(100 * time.Millisecond)
	if s := h.tg.Sent(seq); len(s) != 0 {
		t.Fatalf("second refusal answered: %+v", s)
	}
	for _, c := range h.caged.Calls() {
		t.Errorf("a stranger's message reached caged: %s", c)
	}
}

func TestOwnerCommands(t *testing.T) {
	h := start(t)
	for _, c := range []struct {
		text, call, reply string
		chat, topic       int64
	}{
		{"/status", "status", "alice: active/running (service backend)", chatA, 0},
		{"/status", "status", "bob: inactive/dead", forum, topicB},
		{"/start", "start alice", "alice: start done", chatA, 0},
		{"/stop@nixcage_test_bot", "stop bob", "bob: stop done", forum, topicB},
		{"/kill", "kill alice", "kill done", chatA, 0},
		{"/quarantine leaked a key", "quarantine alice leaked a key (from Telegram by telegram:1001 (@user1001))", "evidence: /var/lib/nixcage/evidence/alice-1", chatA, 0},
		{"/logs 5", "logs alice 5", `line \x1b[2Jtwo`, chatA, 0},
		{"/audit", "audit alice -1 30", "blocked CONNECT evil.example.org:443 — not allowed", chatA, 0},
		{"/allow api.example.com:8443 30m", "allow alice api.example.com 8443 30m0s from Telegram by telegram:1001 (@user1001)", "may reach api.example.com:8443", chatA, 0},
		{"/grants", "grants alice", "g1 api.example.com until", chatA, 0},
	} {
		t.Run(c.text, func(t *testing.T) {
			before := len(h.caged.Calls())
			seq := h.say(owner, c.chat, c.topic, c.text)
			got := h.reply(t, seq, "sendMessage")
			if !strings.Contains(got.Text, c.reply) {
				t.Errorf("reply %q, want it to contain %q", got.Text, c.reply)
			}
			if got.ChatID != c.chat || got.ThreadID != c.topic {
				t.Errorf("answered in chat %d topic %d", got.ChatID, got.ThreadID)
			}
			calls := h.caged.Calls()[before:]
			if len(calls) != 1 || calls[0] != c.call {
				t.Errorf("caged calls %q, want %q", calls, c.call)
			}
		})
	}
	if r := h.record(t, "quarantine", 1); r.Outcome != bus.RelayOK || !strings.Contains(r.Detail, "evidence") {
		t.Errorf("quarantine record %+v", r)
	}
}

// caged's refusal is shown to the owner and audited as refused.
func TestCagedRefusalShown(t *testing.T) {
	h := start(t)
	h.caged.deny["alice"] = true
	seq := h.say(owner, chatA, 0, "/stop")
	got := h.reply(t, seq, "sendMessage")
	if !strings.HasPrefix(got.Text, "Refused: stop alice: access denied") {
		t.Fatalf("reply %q", got.Text)
	}
	if r := h.record(t, "stop", 1); r.Outcome != bus.RelayRefused || !strings.Contains(r.Detail, "access denied") {
		t.Fatalf("record %+v", r)
	}
}

func TestUnboundChatAndOtherBots(t *testing.T) {
	h := start(t)
	seq := h.say(owner, forum, 9, "/status")
	got := h.reply(t, seq, "sendMessage")
	if !strings.Contains(got.Text, "bound to no agent") || got.ThreadID != 9 {
		t.Fatalf("reply %+v", got)
	}
	seq = h.say(owner, chatA, 0, "/status@some_other_bot")
	h.say(owner, chatA, 0, "/help")
	got = h.reply(t, seq, "sendMessage")
	if !strings.Contains(got.Text, "This chat is agent alice") {
		t.Fatalf("a command for another bot was answered: %q", got.Text)
	}
	for _, c := range h.caged.Calls() {
		if c == "status" {
			t.Errorf("status called: %v", h.caged.Calls())
		}
	}
}

func TestTurnTypingAndSplit(t *testing.T) {
	h := start(t)
	gate := make(chan struct{})
	h.caged.turnGate = gate
	seq := h.say(owner, chatA, 0, "write a poem")
	// Typing shows while the turn runs, again and again.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for i := 0; i < 3; i++ {
		s, err := h.tg.WaitSent(ctx, seq, func(s tgfake.Sent) bool { return s.Method == "sendChatAction" })
		if err != nil {
			t.Fatal(err)
		}
		if s.Action != "typing" || s.ChatID != chatA {
			t.Fatalf("action %+v", s)
		}
		seq = s.Seq + 1
	}
	close(gate)
	got := h.reply(t, seq, "sendMessage")
	if got.Text != "the answer to write a poem" {
		t.Fatalf("reply %q", got.Text)
	}
	if r := h.record(t, "turn", 1); r.Outcome != bus.RelayOK {
		t.Fatalf("record %+v", r)
	}

	// A long answer is split at Telegram's limit; a longer one is a file.
	h.caged.turnGate = nil
	h.caged.turnOut = strings.Repeat("word ", 1200) // 6000 characters
	seq = h.say(owner, chatA, 0, "more")
	first := h.reply(t, seq, "sendMessage")
	second := h.reply(t, first.Seq+1, "sendMessage")
	if len(first.Text)+len(second.Text) != 6000+len(" to more") {
		t.Fatalf("split into %d + %d", len(first.Text), len(second.Text))
	}
	h.caged.turnOut = strings.Repeat("x", 20000)
	seq = h.say(owner, chatA, 0, "everything")
	doc := h.reply(t, seq, "sendDocument")
	if len(doc.Data) != 20000+len(" to everything") || doc.FileName != "answer.txt" {
		t.Fatalf("document %q of %d bytes", doc.FileName, len(doc.Data))
	}
}

// Turns of one agent run one at a time, in order.
func TestTurnsQueue(t *testing.T) {
	h := start(t)
	gate := make(chan struct{})
	h.caged.turnGate = gate
	for i := 0; i < 3; i++ {
		h.say(owner, chatA, 0, fmt.Sprintf("m%d", i))
	}
	time.Sleep(200 * time.Millisecond)
	for i := 0; i < 3; i++ {
		gate <- struct{}{}
	}
	h.record(t, "turn", 3)
	var turns []string
	for _, c := range h.caged.Calls() {
		if strings.HasPrefix(c, "turn ") {
			turns = append(turns, c)
		}
	}
	if strings.Join(turns, ",") != "turn alice m0,turn alice m1,turn alice m2" || h.caged.maxRun != 1 {
		t.Fatalf("turns %v, at most %d at once", turns, h.caged.maxRun)
	}
}

func (h *harness) sendDoc(chat int64, name, caption string, data []byte) int {
	n := len(h.tg.Sent(0))
	d := h.tg.AddFile(name, data)
	h.tg.AddMessage(tgfake.Message{From: &tgfake.User{ID: owner}, Chat: tgfake.Chat{ID: chat, Type: "supergroup"}, Document: d, Caption: caption})
	return n
}

func TestFileRoundTrip(t *testing.T) {
	h := start(t)
	seq := h.sendDoc(chatA, "notes.txt", "", []byte("please read"))
	got := h.reply(t, seq, "sendMessage")
	if !strings.Contains(got.Text, "Saved as inbox/notes.txt") {
		t.Fatalf("reply %q", got.Text)
	}
	seq = h.say(owner, chatA, 0, "/get inbox/notes.txt")
	doc := h.reply(t, seq, "sendDocument")
	if string(doc.Data) != "please read" || doc.FileName != "notes.txt" {
		t.Fatalf("got %q %q", doc.FileName, doc.Data)
	}
	// Names that are paths, hidden or too big are refused before caged.
	for _, name := range []string{"../x", ".bashrc"} {
		seq = h.sendDoc(chatA, name, "", []byte("x"))
		if got := h.reply(t, seq, "sendMessage"); !strings.HasPrefix(got.Text, "Refused") {
			t.Errorf("%s: %q", name, got.Text)
		}
	}
	seq = h.sendDoc(chatA, "big.bin", "", make([]byte, 2<<20))
	if got := h.reply(t, seq, "sendMessage"); !strings.Contains(got.Text, "at most 1048576") {
		t.Errorf("oversized: %q", got.Text)
	}
	for _, c := range h.caged.Calls() {
		if strings.HasPrefix(c, "put") && c != "put alice notes.txt" {
			t.Errorf("refused upload reached caged: %s", c)
		}
	}
}

func tarball(t *testing.T, gz bool, entries ...tar.Header) []byte {
	var buf bytes.Buffer
	var w io.Writer = &buf
	var zw *gzip.Writer
	if gz {
		zw = gzip.NewWriter(&buf)
		w = zw
	}
	tw := tar.NewWriter(w)
	for _, e := range entries {
		body := "content of " + e.Name
		if e.Typeflag == tar.TypeReg {
			e.Size = int64(len(body))
		}
		e.Mode = 0o644
		if err := tw.WriteHeader(&e); err != nil {
			t.Fatal(err)
		}
		if e.Typeflag == tar.TypeReg {
			tw.Write([]byte(body))
		}
	}
	tw.Close()
	if zw != nil {
		zw.Close()
	}
	return buf.Bytes()
}

func TestReleaseThroughChat(t *testing.T) {
	h := start(t)
	good := tarball(t, true,
		tar.Header{Name: "./", Typeflag: tar.TypeDir},
		tar.Header{Name: "./release.json", Typeflag: tar.TypeReg},
		tar.Header{Name: "./nar/abc.nar", Typeflag: tar.TypeReg})
	seq := h.sendDoc(chatA, "release.tar.gz", "/apply", good)
	got := h.reply(t, seq, "sendMessage")
	if !strings.Contains(got.Text, "generation 4 (channel stable) is current, was 3") {
		t.Fatalf("reply %q", got.Text)
	}
	if h.caged.applied["release.json"] != "content of ./release.json" || h.caged.applied["nar/abc.nar"] == "" {
		t.Fatalf("caged saw %v", h.caged.applied)
	}
	if r := h.record(t, "apply", 1); r.Outcome != bus.RelayOK {
		t.Fatalf("record %+v", r)
	}
	// caged's refusal reason is shown.
	seq = h.sendDoc(chatA, "r.tar", "/apply", tarball(t, false, tar.Header{Name: "x", Typeflag: tar.TypeReg}))
	if got := h.reply(t, seq, "sendMessage"); !strings.Contains(got.Text, "no release.json") {
		t.Fatalf("reply %q", got.Text)
	}
	// Archives that could reach out of the unpack directory never get to
	// caged.
	applies := 0
	for _, c := range h.caged.Calls() {
		if c == "apply" {
			applies++
		}
	}
	for _, bad := range [][]byte{
		tarball(t, false, tar.Header{Name: "../escape", Typeflag: tar.TypeReg}),
		tarball(t, false, tar.Header{Name: "link", Typeflag: tar.TypeSymlink, Linkname: "/etc/passwd"}),
		tarball(t, false, tar.Header{Name: "/abs", Typeflag: tar.TypeReg}),
		[]byte("not a tar at all"),
	} {
		seq = h.sendDoc(chatA, "bad.tar", "/apply", bad)
		if got := h.reply(t, seq, "sendMessage"); !strings.Contains(got.Text, "not a release archive") {
			t.Errorf("reply %q", got.Text)
		}
	}
	n := 0
	for _, c := range h.caged.Calls() {
		if c == "apply" {
			n++
		}
	}
	if n != applies {
		t.Fatalf("a bad archive reached caged (%d applies, want %d)", n, applies)
	}
}

// A 429 on the answer is waited out, and the answer still arrives.
func TestRateLimitedAnswer(t *testing.T) {
	h := start(t)
	h.tg.Inject(tgfake.Fault{Method: "sendMessage", Code: 429, Description: "Too Many Requests: retry after 1", RetryAfter: 1, Times: 1})
	seq := h.say(owner, chatA, 0, "/status")
	got := h.reply(t, seq, "sendMessage")
	sent := h.tg.Sent(seq)
	if len(sent) < 2 || sent[0].Refused != 429 || got.At.Sub(sent[0].At) < time.Second {
		t.Fatalf("sent %+v", sent)
	}
}

// The relay's file limit is caged's: a larger max_file_bytes would only
// move the refusal from validation to every transfer.
func TestFileLimitIsCaged(t *testing.T) {
	if config.MaxRelayFileBytes != bus.MaxFileBytes {
		t.Fatalf("config.MaxRelayFileBytes %d, bus.MaxFileBytes %d", config.MaxRelayFileBytes, bus.MaxFileBytes)
	}
}

// A turn that did not succeed is posted with its status, and audited as
// failed.
func TestFailedTurnShown(t *testing.T) {
	h := start(t)
	seq := h.say(owner, chatA, 0, "fail please")
	got := h.reply(t, seq, "sendMessage")
	if !strings.Contains(got.Text, "boom") || !strings.HasSuffix(got.Text, "[turn failed, exit status 2]") {
		t.Fatalf("reply %q", got.Text)
	}
	if r := h.record(t, "turn", 1); r.Outcome != bus.RelayFailed || !strings.HasPrefix(r.Detail, "failed, exit status 2") {
		t.Fatalf("record %+v", r)
	}
}

// TestApprovalsInChat: /approvals lists the chat's agent's waiting
// requests (the agent's words escaped), /approve decides through caged's
// Decide and shows the result, an id not waiting for the chat's agent is
// refused before Decide, and a stranger's /approve reaches nothing and is
// audited as refused.
func TestApprovalsInChat(t *testing.T) {
	h := start(t)
	const id = "a-3f2a9c01b7de"
	seq := h.say(owner, chatA, 0, "/approvals")
	got := h.reply(t, seq, "sendMessage")
	if !strings.Contains(got.Text, id+" CONNECT registry.npmjs.org:443/x\\x1b[31m") || strings.Contains(got.Text, "\x1b") || !strings.Contains(got.Text, "/approve ID once|host|deny") {
		t.Fatalf("approvals reply %q", got.Text)
	}
	if r := h.record(t, "approvals", 1); r.Outcome != bus.RelayOK || r.Detail != "1 waiting" || r.Agent != "alice" {
		t.Fatalf("approvals record %+v", r)
	}
	for _, c := range []struct{ text, call, reply, detail string }{
		{"/approve " + id + " host", "decide " + id + " host", "Approved " + id + " (registry.npmjs.org:443): grant g-1234 lets alice reach the host for 1h0m0s", "host " + id + " registry.npmjs.org:443 grant g-1234"},
		{"/approve " + id + " once", "decide " + id + " once", "Approved " + id + " once", "once " + id + " registry.npmjs.org:443"},
		{"/approve " + id + " deny", "decide " + id + " deny", "Denied " + id, "deny " + id + " registry.npmjs.org:443"},
	} {
		before := len(h.caged.Calls())
		seq := h.say(owner, chatA, 0, c.text)
		if got := h.reply(t, seq, "sendMessage"); !strings.Contains(got.Text, c.reply) {
			t.Errorf("%s: reply %q, want %q", c.text, got.Text, c.reply)
		}
		if calls := h.caged.Calls()[before:]; len(calls) != 2 || calls[0] != "approvals alice" || calls[1] != c.call {
			t.Errorf("%s: caged calls %q", c.text, calls)
		}
	}
	if r := h.record(t, "approve", 1); r.Outcome != bus.RelayOK || r.Detail != "host "+id+" registry.npmjs.org:443 grant g-1234" {
		t.Fatalf("approve record %+v", r)
	}
	// bob's chat: the id is not bob's, so nothing is decided from there.
	before := len(h.caged.Calls())
	seq = h.say(owner, forum, topicB, "/approve "+id+" once")
	if got := h.reply(t, seq, "sendMessage"); !strings.Contains(got.Text, "Refused: no request "+id+" of bob") {
		t.Fatalf("other agent's id: %q", got.Text)
	}
	if calls := h.caged.Calls()[before:]; len(calls) != 1 || calls[0] != "approvals bob" {
		t.Fatalf("other agent's id reached caged: %q", calls)
	}
	// Bad input is refused with the usage, before caged.
	for _, text := range []string{"/approve", "/approve a-nothex once"} {
		before := len(h.caged.Calls())
		seq := h.say(owner, chatA, 0, text)
		if got := h.reply(t, seq, "sendMessage"); !strings.Contains(got.Text, "/approve") {
			t.Errorf("%s: reply %q", text, got.Text)
		}
		if calls := h.caged.Calls()[before:]; len(calls) != 0 {
			t.Errorf("%s reached caged: %q", text, calls)
		}
	}

	// A stranger's /approve: refused, audited, nothing decided.
	before = len(h.caged.Calls())
	seq = h.say(stranger, chatA, 0, "/approve "+id+" once")
	if got := h.reply(t, seq, "sendMessage"); !strings.Contains(got.Text, "Refused") {
		t.Fatalf("stranger reply %q", got.Text)
	}
	var rec bus.RelayAction
	for n := 1; ; n++ {
		if rec = h.record(t, "approve", n); rec.Outcome == bus.RelayRefused && strings.Contains(rec.Actor, "telegram:666") {
			break
		}
	}
	if rec.Detail != "not an owner" || rec.Agent != "alice" {
		t.Fatalf("stranger record %+v", rec)
	}
	for _, c := range h.caged.Calls()[before:] {
		t.Errorf("a stranger's /approve reached caged: %s", c)
	}
}

// TestApprovalAnnounced: an ApprovalPending signal is posted into its
// agent's chat (and only there), the agent's words escaped, with the
// command that decides it.
func TestApprovalAnnounced(t *testing.T) {
	h := start(t)
	seq := len(h.tg.Sent(0))
	h.caged.events <- bus.Event{Kind: bus.SignalApprovalPending, Agent: "bob", Data: map[string]string{
		"id": "a-0123456789ab", "host": "evil\x1b[2J.example", "port": "443", "method": "CONNECT", "path": "", "expires_unix": fmt.Sprint(time.Now().Add(30 * time.Second).Unix())}}
	got := h.reply(t, seq, "sendMessage")
	if got.ChatID != forum || got.ThreadID != topicB || strings.Contains(got.Text, "\x1b") ||
		!strings.HasPrefix(got.Text, `agent bob wants evil\x1b[2J.example:443 (id a-0123456789ab; CONNECT ) — /approve a-0123456789ab once|host|deny (within`) {
		t.Fatalf("announcement %+v", got)
	}
	time.Sleep(50 * time.Millisecond)
	if s := h.tg.Sent(seq); len(s) != 1 {
		t.Fatalf("announced %d times: %+v", len(s), s)
	}
}
