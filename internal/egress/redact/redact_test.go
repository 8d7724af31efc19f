package redact

import (
	"bytes"
	"encoding/base64"
	"encoding/hex"
	"io"
	"math/rand/v2"
	"net/url"
	"strings"
	"testing"
	"testing/iotest"
)

const (
	real = "sk-ant-api03-REALrealREAL0123456789abcdefghij-xyz"
	ph   = "sk-ant-api03-PHphPHphPHxq8z1k2m3n4b5v6c7x8z9l-qwe"
)

func matcher(t testing.TB) *Matcher {
	t.Helper()
	fs, err := Forms("anthropic", real, ph)
	if err != nil {
		t.Fatal(err)
	}
	return New(fs)
}

// Every encoding an agent could decode is rewritten, embedded in other
// text at any alignment, and what is left decodes to the placeholder.
func TestFormsCoverEncodings(t *testing.T) {
	m := matcher(t)
	b64 := func(e *base64.Encoding, s string) string { return e.EncodeToString([]byte(s)) }
	cases := []struct {
		name   string
		in     string
		decode func(string) string
	}{
		{"raw", "key=" + real + ";", func(s string) string { return s }},
		{"basic pair", "Basic " + b64(base64.StdEncoding, "user:"+real), func(s string) string {
			d, _ := base64.StdEncoding.DecodeString(strings.TrimPrefix(s, "Basic "))
			return string(d)
		}},
		{"key as user", b64(base64.StdEncoding, real+":"), dec(base64.StdEncoding)},
		{"std shift 0", b64(base64.StdEncoding, real), dec(base64.StdEncoding)},
		{"std shift 1", b64(base64.StdEncoding, "x"+real), dec(base64.StdEncoding)},
		{"std shift 2", b64(base64.StdEncoding, "xy"+real+"tail"), dec(base64.StdEncoding)},
		{"raw std", b64(base64.RawStdEncoding, "abc"+real), dec(base64.RawStdEncoding)},
		{"url", b64(base64.URLEncoding, "{\"k\":\""+real+"\"}"), dec(base64.URLEncoding)},
		{"raw url", b64(base64.RawURLEncoding, "q"+real), dec(base64.RawURLEncoding)},
		{"hex", hex.EncodeToString([]byte(real)), func(s string) string { d, _ := hex.DecodeString(s); return string(d) }},
		{"HEX", strings.ToUpper(hex.EncodeToString([]byte(real))), func(s string) string { d, _ := hex.DecodeString(s); return string(d) }},
		{"percent all", pctAll(real, "%%%02X"), func(s string) string { d, _ := url.PathUnescape(s); return d }},
		{"percent lower", pctAll(real, "%%%02x"), func(s string) string { d, _ := url.PathUnescape(s); return d }},
		{"reversed", reverse(real), reverse},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var res Result
			out := m.String(c.in, &res)
			if len(out) != len(c.in) {
				t.Fatalf("length changed: %d -> %d", len(c.in), len(out))
			}
			got := c.decode(out)
			// At most the first and last value bytes share a base64 char
			// with neighbours; the secret-specific middle must be gone.
			if strings.Contains(got, real[13:len(real)-2]) || strings.Contains(got, "REALrealREAL") {
				t.Fatalf("decoded output still holds the secret: %q", got)
			}
			if !res.Redacted["anthropic"] {
				t.Fatalf("not reported as redacted: %+v", res)
			}
		})
	}
}

func dec(e *base64.Encoding) func(string) string {
	return func(s string) string { d, _ := e.DecodeString(s); return string(d) }
}

// The streaming reader agrees with the whole-buffer rewrite for any input
// and any read sizes.
func TestReaderMatchesWhole(t *testing.T) {
	m := matcher(t)
	rng := rand.New(rand.NewPCG(3, 4))
	pieces := []string{real, base64.StdEncoding.EncodeToString([]byte("u:" + real)), hex.EncodeToString([]byte(real)), real[:30], "sk-ant-", "hello ", "\n", strings.Repeat("z", 100)}
	for range 2000 {
		var sb strings.Builder
		for range rng.IntN(12) {
			sb.WriteString(pieces[rng.IntN(len(pieces))])
		}
		in := sb.String()
		var res Result
		want := m.String(in, &res)
		for _, wrap := range []func(io.Reader) io.Reader{iotest.OneByteReader, iotest.HalfReader, func(r io.Reader) io.Reader { return r }} {
			r := m.NewReader(wrap(strings.NewReader(in)))
			got, err := io.ReadAll(r)
			r.Release()
			if err != nil || string(got) != want {
				t.Fatalf("in %q:\ngot  %q\nwant %q %v", in, got, want, err)
			}
		}
	}
}

// The oracle of issue 21: a reflected guess that ends at a read boundary.
// Whether the guess is a prefix of the secret must not change how many
// bytes each Read returns.
func TestReaderChunksIndependentOfContent(t *testing.T) {
	m := matcher(t)
	hold := 0
	lengths := func(body string) []int {
		pr, pw := io.Pipe()
		r := m.NewReader(pr)
		defer r.Release()
		hold = r.Hold()
		go func() {
			// Two writes: the first ends exactly after the guess.
			pw.Write([]byte(body))
			pw.Write([]byte("\nrest of the response\n"))
			pw.Close()
		}()
		var out []int
		buf := make([]byte, 64<<10)
		for {
			n, err := r.Read(buf)
			if n > 0 {
				out = append(out, n)
			}
			if err != nil {
				return out
			}
		}
	}
	pad := strings.Repeat("p", 500)
	right := lengths(pad + "X-Reflect: " + real[:20])
	wrong := lengths(pad + "X-Reflect: " + real[:19] + "#")
	if len(right) != len(wrong) {
		t.Fatalf("chunk counts differ: right guess %v, wrong guess %v", right, wrong)
	}
	for i := range right {
		if right[i] != wrong[i] {
			t.Fatalf("chunk lengths differ: right guess %v, wrong guess %v", right, wrong)
		}
	}
	if first := len(pad+"X-Reflect: ") + 20 - hold; right[0] != first {
		t.Fatalf("first chunk %d bytes, want the first write less the fixed hold-back (%d)", right[0], first)
	}
}

func TestNearMatch(t *testing.T) {
	m := matcher(t)
	for _, c := range []struct {
		in   string
		near bool
	}{
		{"x" + real[:13+NearMin] + "!", true},
		{"x" + real[:13+NearMin-1] + "!", false},
		{ph, false},
		{real, false}, // a whole match is a redaction, not a near-match
	} {
		var res Result
		m.String(c.in, &res)
		if res.Near["anthropic"] != c.near {
			t.Errorf("%q: near %v, want %v", c.in, res.Near, c.near)
		}
	}
}

func TestFormsRejectLengthMismatch(t *testing.T) {
	if _, err := Forms("x", "abc", "ab"); err == nil {
		t.Fatal("accepted")
	}
}

func BenchmarkReader(b *testing.B) {
	m := matcher(b)
	data := bytes.Repeat([]byte("The quick brown fox jumps over the lazy dog; sk-ant- 0123456789\n"), 1<<14)
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		r := m.NewReader(bytes.NewReader(data))
		io.Copy(io.Discard, r)
		r.Release()
	}
}

// The push Stream agrees with the whole rewrite and releases, after each
// write, everything but the fixed hold-back.
func TestStreamMatchesWhole(t *testing.T) {
	m := matcher(t)
	in := "a " + real + " b " + base64.StdEncoding.EncodeToString([]byte("u:"+real)) + strings.Repeat(" c", 300)
	var res Result
	want := m.String(in, &res)
	for _, step := range []int{1, 5, 64, 1000} {
		s := m.NewStream()
		var out []byte
		total := 0
		for i := 0; i < len(in); i += step {
			chunk := in[i:min(i+step, len(in))]
			total += len(chunk)
			got := s.Write([]byte(chunk))
			out = append(out, got...)
			if len(out) != max(0, total-m.MaxLen()+1) {
				t.Fatalf("step %d: released %d of %d, want all but the hold-back", step, len(out), total)
			}
		}
		out = append(out, s.Close()...)
		if string(out) != want || !s.Result().Redacted["anthropic"] {
			t.Fatalf("step %d: got %q", step, out)
		}
	}
}

// Name matches a header name without case: net/http hands names on
// canonicalized, the key's letters' case changed.
func TestNameMatchesCanonicalizedKey(t *testing.T) {
	real, ph := "sk-ant-api03-REALrealREAL0123456789abcdef", "sk-ant-api03-PLACEholder987654321zyxwvuts"
	forms, err := Forms("k", real, ph)
	if err != nil {
		t.Fatal(err)
	}
	m := New(forms)
	canon := "X-Sk-Ant-Api03-Realrealreal0123456789abcdef"
	var res Result
	got := m.Name(canon, &res)
	if strings.Contains(strings.ToLower(got), strings.ToLower(real)) || !strings.Contains(got, strings.ToLower(ph)) || !res.Redacted["k"] {
		t.Fatalf("Name(%q) = %q, redacted %v: want the placeholder, case folded, where the key was", canon, got, res.Redacted)
	}
	var none Result
	if got := m.Name("Content-Type", &none); got != "Content-Type" || len(none.Redacted) != 0 {
		t.Fatalf("Name changed a name with no key in it: %q", got)
	}
	if got := m.Name("X-"+real, &none); strings.Contains(got, real) {
		t.Fatalf("Name kept an exact-case key: %q", got)
	}
}
