package egress

import (
	"io"
	"math/rand/v2"
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

// The streaming redactor must agree with a whole-buffer replacement for any
// input and any read sizes.
func FuzzRedactor(f *testing.F) {
	f.Add([]byte("a SECRETVALUE1 b XY"), uint8(3))
	f.Add([]byte("SECRETSECRETVALUE1XYX"), uint8(1))
	f.Fuzz(func(t *testing.T, in []byte, step uint8) {
		pairs := []pair{{name: "a", from: []byte("SECRETVALUE1"), to: []byte("placeholder1")}, {name: "b", from: []byte("XY"), to: []byte("ab")}}
		want := redactRef(string(in))
		n := int(step%16) + 1
		r := newRedactor(&chunkReader{b: in, n: n}, pairs)
		got, err := io.ReadAll(r)
		if err != nil || string(got) != want {
			t.Fatalf("in %q step %d: got %q, want %q", in, n, got, want)
		}
	})
}

type chunkReader struct {
	b []byte
	n int
}

func (c *chunkReader) Read(p []byte) (int, error) {
	if len(c.b) == 0 {
		return 0, io.EOF
	}
	k := min(c.n, len(p), len(c.b))
	copy(p, c.b[:k])
	c.b = c.b[k:]
	return k, nil
}

// redactRef is the whole-buffer reference: leftmost match first.
func redactRef(in string) string {
	var sb strings.Builder
	for i := 0; i < len(in); {
		switch {
		case strings.HasPrefix(in[i:], "SECRETVALUE1"):
			sb.WriteString("placeholder1")
			i += 12
		case strings.HasPrefix(in[i:], "XY"):
			sb.WriteString("ab")
			i += 2
		default:
			sb.WriteByte(in[i])
			i++
		}
	}
	return sb.String()
}

// Random inputs over the values' own alphabet, so partial and overlapping
// matches are frequent, at every read size.
func TestRedactorMatchesReference(t *testing.T) {
	alpha := []byte("SECRETVALUE1XYa")
	rng := rand.New(rand.NewPCG(1, 2))
	for range 20000 {
		in := make([]byte, rng.IntN(40))
		for i := range in {
			in[i] = alpha[rng.IntN(len(alpha))]
		}
		n := rng.IntN(16) + 1
		r := newRedactor(&chunkReader{b: in, n: n}, []pair{{name: "a", from: []byte("SECRETVALUE1"), to: []byte("placeholder1")}, {name: "b", from: []byte("XY"), to: []byte("ab")}})
		got, err := io.ReadAll(r)
		if want := redactRef(string(in)); err != nil || string(got) != want {
			t.Fatalf("in %q step %d: got %q, want %q", in, n, got, want)
		}
	}
}
