// Package secrets holds the credentials a gateway injects and the
// placeholders a cage sees instead.
//
// Invariants: a placeholder has exactly the real value's length (so
// Content-Length and header sizes do not change on injection) and is random
// apart from a well-known provider prefix kept so harness-side format checks
// pass; placeholders are not secret (the file is 0644); real values are read
// only from $CREDENTIALS_DIRECTORY and never written anywhere else.
package secrets

import (
	"crypto/rand"
	"encoding/json"
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"strings"

	"github.com/nixcage/nixcage/internal/policy"
)

// Secret is one credential with its real value and placeholder.
type Secret struct {
	policy.Secret
	Real        string
	Placeholder string
	// PlaceholderBytes is Placeholder as bytes, for scanning request bodies
	// without a conversion per request.
	PlaceholderBytes []byte
}

// FileSchema versions the placeholder file.
const FileSchema = 1

// File is the placeholder file prepare writes and the gateway reads.
type File struct {
	Schema  int              `json:"schema"`
	Secrets map[string]Entry `json:"secrets"`
}

// Entry is one placeholder.
type Entry struct {
	Env         string `json:"env"`
	Placeholder string `json:"placeholder"`
}

// prefixes are kept verbatim in placeholders; longest first.
var prefixes = []string{
	"sk-ant-api03-", "sk-ant-admin01-", "sk-ant-", "sk-proj-", "sk-svcacct-", "sk-",
	"github_pat_", "ghp_", "gho_", "ghu_", "ghs_", "ghr_", "glpat-",
	"xoxb-", "xoxp-", "xoxa-", "xapp-", "AKIA", "ASIA", "AIza", "hf_",
	"sk_live_", "rk_live_", "sk_test_", "pk_live_",
}

// KnownPrefix returns the provider prefix of v kept in its placeholder.
func KnownPrefix(v string) string {
	for _, p := range prefixes {
		if strings.HasPrefix(v, p) && len(v) > len(p)+8 {
			return p
		}
	}
	return ""
}

const (
	lower  = "abcdefghijklmnopqrstuvwxyz"
	upper  = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
	digits = "0123456789"
)

// NewPlaceholder makes a random stand-in for real: same length, same known
// prefix, and each other byte replaced by a random byte of the same class
// (lower, upper, digit; anything else becomes a random letter or digit), so
// the result has the shape of a real key and none of its content.
func NewPlaceholder(real string) (string, error) {
	if real == "" {
		return "", fmt.Errorf("empty secret value")
	}
	pre := KnownPrefix(real)
	for range 8 {
		b := []byte(pre)
		for i := len(pre); i < len(real); i++ {
			c := real[i]
			set := lower + upper + digits
			switch {
			case c >= 'a' && c <= 'z':
				set = lower
			case c >= 'A' && c <= 'Z':
				set = upper
			case c >= '0' && c <= '9':
				set = digits
			case c == '-' || c == '_':
				// Keep separators: some formats check their positions.
				b = append(b, c)
				continue
			}
			n, err := rand.Int(rand.Reader, big.NewInt(int64(len(set))))
			if err != nil {
				return "", fmt.Errorf("placeholder: %w", err)
			}
			b = append(b, set[n.Int64()])
		}
		if p := string(b); p != real {
			return p, nil
		}
	}
	return "", fmt.Errorf("placeholder: value too short to disguise")
}

// ReadReal reads a credential from dir/name, stripping one trailing newline.
func ReadReal(dir, name string) (string, error) {
	if dir == "" {
		return "", fmt.Errorf("secret %s: $CREDENTIALS_DIRECTORY is not set; run under systemd with LoadCredential=%s:... or set it for a standalone run", name, name)
	}
	b, err := os.ReadFile(filepath.Join(dir, name))
	if err != nil {
		return "", fmt.Errorf("secret %s: %w", name, err)
	}
	s := strings.TrimSuffix(string(b), "\n")
	if s == "" {
		return "", fmt.Errorf("secret %s: credential file is empty", name)
	}
	if strings.ContainsAny(s, "\r\n") {
		return "", fmt.Errorf("secret %s: value spans several lines; credentials must be one line", name)
	}
	return s, nil
}

// LoadFile reads a placeholder file.
func LoadFile(path string) (*File, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read placeholders: %w; run `cage-egress prepare` first", err)
	}
	var f File
	if err := json.Unmarshal(b, &f); err != nil {
		return nil, fmt.Errorf("parse placeholders %s: %w", path, err)
	}
	if f.Schema != FileSchema {
		return nil, fmt.Errorf("placeholders %s: schema %d, want %d; re-run `cage-egress prepare`", path, f.Schema, FileSchema)
	}
	return &f, nil
}

// Load pairs each configured secret with its real value and placeholder.
// Every configured secret must be present and consistent: a gateway that
// cannot inject what the cage expects refuses to start (fail closed).
func Load(rt *policy.Runtime, credDir string) ([]*Secret, error) {
	if len(rt.Secrets) == 0 {
		return nil, nil
	}
	if rt.PlaceholderFile == "" {
		return nil, fmt.Errorf("egress config has secrets but no placeholder_file")
	}
	f, err := LoadFile(rt.PlaceholderFile)
	if err != nil {
		return nil, err
	}
	var out []*Secret
	for _, s := range rt.Secrets {
		real, err := ReadReal(credDir, s.Name)
		if err != nil {
			return nil, err
		}
		e, ok := f.Secrets[s.Name]
		if !ok {
			return nil, fmt.Errorf("secret %s has no placeholder in %s; re-run `cage-egress prepare`", s.Name, rt.PlaceholderFile)
		}
		if len(e.Placeholder) != len(real) || e.Placeholder == real {
			return nil, fmt.Errorf("secret %s: placeholder does not fit the current value; re-run `cage-egress prepare`", s.Name)
		}
		hosts := make([]string, len(s.Hosts))
		for i, h := range s.Hosts {
			if err := policy.CheckPattern(h); err != nil {
				return nil, fmt.Errorf("secret %s: %w", s.Name, err)
			}
			hosts[i] = h
		}
		out = append(out, &Secret{Secret: s, Real: real, Placeholder: e.Placeholder, PlaceholderBytes: []byte(e.Placeholder)})
	}
	return out, nil
}
