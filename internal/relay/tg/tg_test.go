package tg_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
	"unicode/utf16"

	"github.com/nixcage/nixcage/internal/relay/tg"
	"github.com/nixcage/nixcage/internal/relay/tgfake"
)

const token = "123456:TEST-token-AAAA"

func fake(t *testing.T) (*tgfake.Server, *tg.Client) {
	t.Helper()
	s := tgfake.New(token)
	hs := httptest.NewServer(s.Handler())
	t.Cleanup(hs.Close)
	ctx, cancel := context.WithCancel(context.Background())
	c, err := tg.New(ctx, token, tg.Options{APIURL: hs.URL, PollTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { c.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return s, c
}

func next(t *testing.T, c *tg.Client) string {
	t.Helper()
	select {
	case u := <-c.Updates():
		return u.Message.Text
	case <-time.After(10 * time.Second):
		t.Fatal("no update")
	}
	return ""
}

// Long polling delivers each update once, in order, and confirms what it
// got with the next offset (the fake then forgets it).
func TestLongPollingOffsets(t *testing.T) {
	s, c := fake(t)
	if c.Username != "nixcage_test_bot" {
		t.Errorf("username from getMe = %q", c.Username)
	}
	first := s.AddMessage(tgfake.Message{From: &tgfake.User{ID: 1}, Chat: tgfake.Chat{ID: -5, Type: "group"}, Text: "one"})
	s.AddMessage(tgfake.Message{From: &tgfake.User{ID: 1}, Chat: tgfake.Chat{ID: -5, Type: "group"}, Text: "two"})
	if a, b := next(t, c), next(t, c); a != "one" || b != "two" {
		t.Fatalf("got %q, %q", a, b)
	}
	s.AddMessage(tgfake.Message{From: &tgfake.User{ID: 1}, Chat: tgfake.Chat{ID: -5, Type: "group"}, Text: "three"})
	if got := next(t, c); got != "three" {
		t.Fatalf("got %q", got)
	}
	// The poll after "two" carried offset first+2: both confirmed.
	deadline := time.Now().Add(5 * time.Second)
	for s.Pending() != 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if s.Pending() != 0 {
		t.Fatalf("%d updates never confirmed", s.Pending())
	}
	found := false
	for _, o := range s.Offsets {
		if o == first+2 {
			found = true
		}
	}
	if !found {
		t.Errorf("no poll confirmed up to %d: offsets %v", first+1, s.Offsets)
	}
}

func TestSendsAndDownload(t *testing.T) {
	s, c := fake(t)
	ctx := context.Background()
	to := tg.Target{ChatID: -100, Topic: 7}
	if err := c.SendText(ctx, to, "hello <b>world</b>"); err != nil {
		t.Fatal(err)
	}
	if err := c.Typing(ctx, tg.Target{ChatID: -200}); err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte("x"), 100000)
	if err := c.SendDocument(ctx, to, "out.bin", "cap", func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil }); err != nil {
		t.Fatal(err)
	}
	sent := s.Sent(0)
	if len(sent) != 3 {
		t.Fatalf("sent %+v", sent)
	}
	if m := sent[0]; m.Method != "sendMessage" || m.ChatID != -100 || m.ThreadID != 7 || m.Text != "hello <b>world</b>" {
		t.Errorf("message %+v", m)
	}
	if a := sent[1]; a.Method != "sendChatAction" || a.Action != "typing" {
		t.Errorf("action %+v", a)
	}
	if d := sent[2]; d.Method != "sendDocument" || d.FileName != "out.bin" || !bytes.Equal(d.Data, data) || d.Caption != "cap" || d.ThreadID != 7 {
		t.Errorf("document %s %q %d bytes", d.Method, d.FileName, len(d.Data))
	}

	doc := s.AddFile("in.txt", []byte("file body"))
	var buf bytes.Buffer
	if n, err := c.Download(ctx, doc.FileID, 100, &buf); err != nil || n != 9 || buf.String() != "file body" {
		t.Fatalf("download: %d %v %q", n, err, buf.String())
	}
	buf.Reset()
	if _, err := c.Download(ctx, doc.FileID, 4, &buf); !errors.Is(err, tg.ErrTooLarge) || buf.Len() != 0 {
		t.Fatalf("oversized download: %v, %d bytes written", err, buf.Len())
	}
}

// A 429 is waited out for its retry_after, then the message goes.
func TestRetryAfterHonoured(t *testing.T) {
	s, c := fake(t)
	s.Inject(tgfake.Fault{Method: "sendMessage", Code: 429, Description: "Too Many Requests: retry after 2", RetryAfter: 2, Times: 1})
	if err := c.SendText(context.Background(), tg.Target{ChatID: 42}, "after the wait"); err != nil {
		t.Fatal(err)
	}
	sent := s.Sent(0)
	if len(sent) != 2 || sent[0].Refused != 429 || sent[1].Refused != 0 || sent[1].Text != "after the wait" {
		t.Fatalf("sent %+v", sent)
	}
	if gap := sent[1].At.Sub(sent[0].At); gap < 2*time.Second {
		t.Fatalf("retried %v after a 429 with retry_after 2s", gap)
	}
}

// A wrong token fails at start, and the error does not carry the token.
func TestWrongTokenRedacted(t *testing.T) {
	s := tgfake.New("other:token")
	hs := httptest.NewServer(s.Handler())
	defer hs.Close()
	_, err := tg.New(context.Background(), token, tg.Options{APIURL: hs.URL})
	if err == nil || !strings.Contains(err.Error(), "Unauthorized") {
		t.Fatalf("err = %v", err)
	}
	if strings.Contains(err.Error(), token) {
		t.Fatalf("error shows the token: %v", err)
	}
	_, err = tg.New(context.Background(), token, tg.Options{APIURL: "http://127.0.0.1:1"})
	if err == nil || strings.Contains(err.Error(), token) {
		t.Fatalf("dial error shows the token or is nil: %v", err)
	}
}

func TestSplit(t *testing.T) {
	long := strings.Repeat("a", 5000)
	lines := strings.Repeat("line of text\n", 400) // 5200 bytes
	emoji := strings.Repeat("😀", 2100)             // 4200 UTF-16 units
	for _, c := range []struct {
		name  string
		in    string
		parts int
	}{
		{"empty", "", 0},
		{"short", "hi", 1},
		{"exact", strings.Repeat("b", 4096), 1},
		{"long", long, 2},
		{"lines", lines, 2},
		{"surrogates", emoji, 2},
	} {
		t.Run(c.name, func(t *testing.T) {
			ps := tg.Split(c.in, tg.MaxMessage)
			if len(ps) != c.parts || strings.Join(ps, "") != c.in {
				t.Fatalf("%d parts (want %d), rejoin equal %v", len(ps), c.parts, strings.Join(ps, "") == c.in)
			}
			for _, p := range ps {
				if n := len(utf16.Encode([]rune(p))); n > tg.MaxMessage {
					t.Errorf("part of %d units", n)
				}
			}
			if c.name == "lines" && !strings.HasSuffix(ps[0], "\n") {
				t.Errorf("cut inside a line: %q", ps[0][len(ps[0])-20:])
			}
		})
	}
}

type clock struct{ t time.Time }

func (c *clock) now() time.Time { return c.t }

func TestLimiter(t *testing.T) {
	c := &clock{t: time.Unix(1e9, 0)}
	l := tg.NewLimiter(c.now)
	// A chat: one message a second.
	if d := l.Reserve(5); d != 0 {
		t.Fatalf("first wait %v", d)
	}
	if d := l.Reserve(5); d != time.Second {
		t.Fatalf("second wait %v", d)
	}
	// Another chat is not held back by the first.
	if d := l.Reserve(6); d != 0 {
		t.Fatalf("other chat waits %v", d)
	}
	// A group: 20 a minute.
	var last time.Duration
	for i := 0; i < 21; i++ {
		last = l.Reserve(-9)
	}
	if last != time.Minute {
		t.Fatalf("21st message in a group waits %v, want 1m", last)
	}
	// Globally: 30 a second over all chats.
	l2 := tg.NewLimiter(c.now)
	for i := int64(0); i < 30; i++ {
		if d := l2.Reserve(100 + i); d != 0 {
			t.Fatalf("message %d waits %v", i, d)
		}
	}
	if d := l2.Reserve(999); d != time.Second {
		t.Fatalf("31st message in a second waits %v", d)
	}
	// A 429 blocks the chat for retry_after, and typing is skipped then.
	l3 := tg.NewLimiter(c.now)
	l3.Block(7, 3*time.Second)
	if l3.TryReserve(7) {
		t.Fatal("typing allowed in a blocked chat")
	}
	if d := l3.Reserve(7); d != 3*time.Second {
		t.Fatalf("wait in blocked chat %v", d)
	}
	c.t = c.t.Add(10 * time.Second)
	if !l3.TryReserve(7) {
		t.Fatal("typing refused once the block passed")
	}
}
