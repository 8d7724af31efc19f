package inspect

import (
	"encoding/base64"
	"net/http"
	"strings"
	"testing"

	"github.com/nixcage/nixcage/internal/egress/redact"
	"github.com/nixcage/nixcage/internal/policy"
)

func realMatcher(t testing.TB, real, ph string) *redact.Matcher {
	t.Helper()
	fs, err := redact.Forms("anthropic", real, ph)
	if err != nil {
		t.Fatal(err)
	}
	return redact.New(fs)
}

func TestInspect(t *testing.T) {
	real := "sk-ant-api03-REALVALUEabcdefghijklmnopqrstuvwxyz012345"
	ph := "sk-ant-api03-PLACEHOLDERqwertyuiopasdfghjklzxcvbnm0123"
	set, err := New([]policy.Inspector{
		{Name: policy.InspectSecretPatterns, Action: policy.ActionBlock},
		{Name: policy.InspectBodySize, Action: policy.ActionFlag, MaxBytes: 100},
		{Name: policy.InspectEntropy, Action: policy.ActionFlag},
		{Name: policy.InspectEncodedBlobs, Action: policy.ActionFlag, MinLength: 64},
	}, realMatcher(t, real, ph), map[string]string{"anthropic": ph})
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name, where, data string
		want              []string // inspector names, in order
		block             bool
	}{
		{"clean", "body", `{"a":"hello"}`, nil, false},
		{"placeholder is masked", "header X-Api-Key", ph, nil, false},
		{"real value", "header X-Api-Key", real, []string{"real_values", "secret_patterns", "entropy"}, true},
		{"real value base64", "body", base64.StdEncoding.EncodeToString([]byte(real)), []string{"real_values", "entropy", "encoded_blobs"}, true},
		{"github token", "url", "/x?t=ghp_" + strings.Repeat("a1B2", 9), []string{"secret_patterns"}, true},
		{"body too big", "body", strings.Repeat("ab ", 40), []string{"body_size"}, false},
		{"openai project key", "body", "sk-proj-" + strings.Repeat("Ab3_", 12), []string{"secret_patterns"}, true},
		{"hex blob", "body", strings.Repeat("0123456789abcdef", 5), []string{"encoded_blobs"}, false},
		{"git sha is not high entropy", "url", "/commit/4b825dc642cb6eb9a060e54bf8d69288fbee4904", nil, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			fs, _ := set.Inspect([]Part{{Where: c.where, Data: []byte(c.data)}})
			var got []string
			for _, f := range fs {
				got = append(got, f.Inspector)
				if strings.Contains(f.Reason, real) || (len(c.data) > 20 && strings.Contains(f.Reason, c.data)) {
					t.Fatalf("finding reason leaks the matched text: %q", f.Reason)
				}
			}
			if strings.Join(got, ",") != strings.Join(c.want, ",") || Blocked(fs) != c.block {
				t.Fatalf("findings %+v, want %v block=%v", fs, c.want, c.block)
			}
		})
	}
}

func TestNewRejects(t *testing.T) {
	for name, in := range map[string]policy.Inspector{
		"bad action":        {Name: policy.InspectEntropy, Action: "warn"},
		"unknown name":      {Name: "magic", Action: policy.ActionFlag},
		"body size, no max": {Name: policy.InspectBodySize, Action: policy.ActionBlock},
	} {
		if _, err := New([]policy.Inspector{in}, nil, nil); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

// A part fed in small chunks gets the verdict it gets whole, and what a
// Stream releases is exactly what was written, in order, unless blocked.
func TestStreamChunkedAgreesWithWhole(t *testing.T) {
	real := "sk-ant-api03-REALVALUEabcdefghijklmnopqrstuvwxyz012345"
	ph := "sk-ant-api03-PLACEHOLDERqwertyuiopasdfghjklzxcvbnm0123"
	set, err := New([]policy.Inspector{
		{Name: policy.InspectSecretPatterns, Action: policy.ActionBlock},
		{Name: policy.InspectEntropy, Action: policy.ActionFlag},
		{Name: policy.InspectEncodedBlobs, Action: policy.ActionFlag, MinLength: 64},
	}, realMatcher(t, real, ph), map[string]string{"anthropic": ph})
	if err != nil {
		t.Fatal(err)
	}
	pad := strings.Repeat("plain words and more words ", 200)
	for _, data := range []string{
		pad + ph + pad,
		pad + real + pad,
		pad + base64.StdEncoding.EncodeToString([]byte("u:"+real)) + pad,
		pad + "AKIAIOSFODNN7EXAMPLE " + pad,
		pad + strings.Repeat("0123456789abcdef", 8) + pad,
		pad + "q7Lk2mZ9vR4tW8yB1nC6xJ3hF5gD0sA2pE7uI9oK4" + pad,
	} {
		whole, _ := set.Inspect([]Part{{Where: "body", Data: []byte(data)}})
		for _, step := range []int{1, 7, 100, 4096} {
			st := set.NewStream("body")
			var out []byte
			for i := 0; i < len(data); i += step {
				out = append(out, st.Write([]byte(data[i:min(i+step, len(data))]))...)
			}
			out = append(out, st.Close()...)
			if got, want := names(st.Findings()), names(whole); got != want {
				t.Fatalf("step %d: findings %s, whole %s", step, got, want)
			}
			if st.Blocked() {
				if strings.Contains(string(out), "AKIAIOSF") || strings.Contains(string(out), real[13:30]) {
					t.Fatalf("step %d: a blocked stream released its offending bytes", step)
				}
			} else if string(out) != data {
				t.Fatalf("step %d: released %d bytes, not the %d written", step, len(out), len(data))
			}
		}
	}
}

func names(fs []Finding) string {
	var out []string
	for _, f := range fs {
		out = append(out, f.Inspector+"/"+f.Action)
	}
	return strings.Join(out, ",")
}

// BenchmarkStream is the streaming inspector over prose (docs/performance.md).
func BenchmarkStream(b *testing.B) {
	real := "sk-ant-api03-REALVALUEabcdefghijklmnopqrstuvwxyz012345"
	ph := "sk-ant-api03-PLACEHOLDERqwertyuiopasdfghjklzxcvbnm0123"
	set, err := New([]policy.Inspector{
		{Name: policy.InspectSecretPatterns, Action: policy.ActionBlock},
		{Name: policy.InspectBodySize, Action: policy.ActionFlag, MaxBytes: 1 << 30},
		{Name: policy.InspectEntropy, Action: policy.ActionFlag},
		{Name: policy.InspectEncodedBlobs, Action: policy.ActionFlag, MinLength: 512},
	}, realMatcher(b, real, ph), map[string]string{"anthropic": ph})
	if err != nil {
		b.Fatal(err)
	}
	chunk := []byte(strings.Repeat("lorem ipsum dolor sit amet, consectetur adipiscing elit\n", 600)[:32<<10])
	b.SetBytes(int64(len(chunk)) * 100)
	for b.Loop() {
		st := set.NewStream("body")
		for range 100 {
			st.Write(chunk)
		}
		st.Close()
	}
}

// A Fold part (a header name, canonicalized by net/http) is matched
// without ASCII case: a key whose letters' case net/http changed still
// counts as the key, for patterns, real values and placeholders alike. The
// same bytes in an exact part are not a pattern match (the patterns are
// case-sensitive there: "akia…" in a body is no AWS key). A name with no
// anchor in it costs no allocation.
func TestInspectFoldedName(t *testing.T) {
	real := "sk-ant-api03-REALVALUEabcdefghijklmnopqrstuvwxyz012345"
	ph := "sk-ant-api03-PLACEHOLDERqwertyuiopasdfghjklzxcvbnm0123"
	set, err := New([]policy.Inspector{{Name: policy.InspectSecretPatterns, Action: policy.ActionBlock}},
		realMatcher(t, real, ph), map[string]string{"anthropic": ph})
	if err != nil {
		t.Fatal(err)
	}
	canon := func(s string) string { return http.CanonicalHeaderKey(s) }
	for _, tc := range []struct{ name, data, want string }{
		{"aws", canon("AKIAIOSFODNN7EXAMPLE"), "aws-access-key-id pattern in header name"},
		{"anthropic", canon("sk-ant-api03-" + strings.Repeat("Zq9", 20)), "anthropic-key pattern in header name"},
		{"real value", canon(real), "real value of secret anthropic (raw form) in header name"},
	} {
		fs, _ := set.Inspect([]Part{{Where: "header name", Data: []byte(tc.data), Fold: true}})
		if len(fs) == 0 || fs[0].Reason != tc.want || !Blocked(fs) {
			t.Errorf("%s: folded findings %+v, want first %q", tc.name, fs, tc.want)
		}
		if tc.name != "real value" {
			if fs, _ := set.Inspect([]Part{{Where: "body", Data: []byte(tc.data)}}); len(fs) != 0 {
				t.Errorf("%s: exact part %q gave %+v, want none", tc.name, tc.data, fs)
			}
		}
	}
	fs, phs := set.Inspect([]Part{{Where: "header name", Data: []byte(canon(ph)), Fold: true}})
	if len(fs) != 0 || len(phs) != 1 || phs[0] != "anthropic" {
		t.Errorf("placeholder as a name: findings %+v placeholders %v, want none and anthropic", fs, phs)
	}
	parts := []Part{{Where: "header name", Data: []byte("Accept-Encoding"), Fold: true}, {Where: "header name", Data: []byte("X-Request-Id"), Fold: true}}
	set.Inspect(parts)
	if n := testing.AllocsPerRun(100, func() { set.Inspect(parts) }); n != 0 {
		t.Errorf("inspecting ordinary names allocates %v times, want 0", n)
	}
}
