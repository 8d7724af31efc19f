package inspect

import (
	"encoding/base64"
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
