package egress

import (
	"io"
	"strings"
	"testing"
	"testing/iotest"
	"time"

	"github.com/nixcage/nixcage/internal/policy"
)

func TestRedactor(t *testing.T) {
	pairs := []pair{{name: "a", from: []byte("SECRETVALUE1"), to: []byte("placeholder1")}, {name: "b", from: []byte("XY"), to: []byte("ab")}}
	cases := []struct{ name, in, want string }{
		{"none", "hello world", "hello world"},
		{"one", "key=SECRETVALUE1;", "key=placeholder1;"},
		{"at start and end", "SECRETVALUE1 SECRETVALUE1", "placeholder1 placeholder1"},
		{"adjacent", "SECRETVALUE1SECRETVALUE1XYXY", "placeholder1placeholder1abab"},
		{"partial prefix at end", "abc SECRETVALUE", "abc SECRETVALUE"},
		{"overlap of prefix and value", "SECRETSECRETVALUE1", "SECRETplaceholder1"},
	}
	for _, c := range cases {
		for _, rd := range []struct {
			name string
			wrap func(io.Reader) io.Reader
		}{{"whole", func(r io.Reader) io.Reader { return r }}, {"one byte", iotest.OneByteReader}, {"half", iotest.HalfReader}} {
			t.Run(c.name+"/"+rd.name, func(t *testing.T) {
				r := newRedactor(rd.wrap(strings.NewReader(c.in)), pairs)
				out, err := io.ReadAll(r)
				if err != nil || string(out) != c.want {
					t.Fatalf("got %q %v, want %q", out, err, c.want)
				}
				if hit := r.hits["a"]; hit != strings.Contains(c.in, "SECRETVALUE1") {
					t.Fatalf("hits %v", r.hits)
				}
			})
		}
	}
}

func TestLimiter(t *testing.T) {
	now := time.Unix(1000, 0)
	l := newLimiter(policy.RateLimit{PerSecond: 2, Burst: 3})
	l.now = func() time.Time { return now }
	for i := range 3 {
		if !l.allow("a") {
			t.Fatalf("request %d within burst refused", i)
		}
	}
	if l.allow("a") {
		t.Fatal("request beyond burst allowed")
	}
	if !l.allow("b") {
		t.Fatal("buckets are not per host")
	}
	now = now.Add(500 * time.Millisecond) // one token at 2/s
	if !l.allow("a") || l.allow("a") {
		t.Fatal("refill is not rate-based")
	}
	if off := newLimiter(policy.RateLimit{}); !off.allow("a") {
		t.Fatal("zero rate must not limit")
	}
}

// A streamed response must not be held back unless its tail could be the
// start of a secret.
func TestRedactorStreams(t *testing.T) {
	pr, pw := io.Pipe()
	r := newRedactor(pr, []pair{{name: "a", from: []byte("SECRETVALUE1"), to: []byte("placeholder1")}})
	go pw.Write([]byte("data: event one\n\n"))
	buf := make([]byte, 100)
	n, err := r.Read(buf)
	if err != nil || string(buf[:n]) != "data: event one\n\n" {
		t.Fatalf("first event held back: %q %v", buf[:n], err)
	}
	go func() {
		pw.Write([]byte("data: SECRET")) // the tail may start the value: held
		pw.Write([]byte("VALUE1 done"))
		pw.Close()
	}()
	out, _ := io.ReadAll(r)
	if string(out) != "data: placeholder1 done" {
		t.Fatalf("got %q", out)
	}
}
