// Package inspect runs content checks on what a cage sends out.
//
// Inspectors see a request exactly as the agent wrote it, with placeholders
// and never with real credential values (injection happens after every
// inspector passed). Placeholders are masked before pattern, entropy and
// blob checks, because they are made to look like real keys and would
// otherwise flag every legitimate call. Findings carry the inspector, the
// part and a pattern name, never the matched text.
package inspect

import (
	"encoding/base64"
	"fmt"
	"math"
	"net/url"
	"regexp"
	"strings"

	"github.com/nixcage/nixcage/internal/policy"
)

// Finding is one inspector hit.
type Finding struct {
	Inspector string
	Action    string // policy.ActionFlag or policy.ActionBlock
	Reason    string
}

// Part is one piece of a request: "url", "header Name", "body".
type Part struct {
	Where string
	Data  []byte
}

// Value is a real credential to watch for, by name.
type Value struct {
	Name  string
	Value string
}

// Set is a configured list of inspectors. Immutable after New.
type Set struct {
	list         []policy.Inspector
	realForms    []Value // each real value in every form we look for
	placeholders []string
}

// Defaults used when an inspector leaves its parameter at zero.
const (
	DefaultEntropyBits   = policy.DefaultEntropyBits
	DefaultEntropyMinLen = policy.DefaultEntropyMinLength
	DefaultBlobMinLen    = policy.DefaultBlobMinLength
)

// New validates the inspector list. The real_values check always runs and
// always blocks, whether listed or not: a real value outbound is never
// acceptable (THREATS.md).
func New(list []policy.Inspector, real []Value, placeholders []string) (*Set, error) {
	s := &Set{placeholders: placeholders}
	for _, in := range list {
		if in.Action != policy.ActionFlag && in.Action != policy.ActionBlock {
			return nil, fmt.Errorf("inspector %s: action %q, want %q or %q", in.Name, in.Action, policy.ActionFlag, policy.ActionBlock)
		}
		switch in.Name {
		case policy.InspectRealValues:
			continue
		case policy.InspectBodySize:
			if in.MaxBytes <= 0 {
				return nil, fmt.Errorf("inspector body_size: set max_bytes to a positive limit")
			}
		case policy.InspectSecretPatterns, policy.InspectEntropy, policy.InspectEncodedBlobs:
		default:
			return nil, fmt.Errorf("unknown inspector %q; known: %s", in.Name, strings.Join(policy.InspectorNames, ", "))
		}
		s.list = append(s.list, in)
	}
	for _, v := range real {
		forms := []string{v.Value, base64.StdEncoding.EncodeToString([]byte(v.Value)), base64.RawURLEncoding.EncodeToString([]byte(v.Value))}
		if q := url.QueryEscape(v.Value); q != v.Value {
			forms = append(forms, q)
		}
		for _, f := range forms {
			s.realForms = append(s.realForms, Value{Name: v.Name, Value: f})
		}
	}
	return s, nil
}

// Names lists the inspectors that run, for the audit record.
func (s *Set) Names() []string {
	out := []string{policy.InspectRealValues}
	for _, in := range s.list {
		out = append(out, in.Name)
	}
	return out
}

// pattern is a known secret format.
type pattern struct {
	name string
	re   *regexp.Regexp
}

var patterns = []pattern{
	{"anthropic-key", regexp.MustCompile(`sk-ant-[A-Za-z0-9_-]{20,}`)},
	{"openai-key", regexp.MustCompile(`sk-(?:proj|svcacct|admin)-[A-Za-z0-9_-]{40,}|sk-[A-Za-z0-9]{20}T3BlbkFJ[A-Za-z0-9]{20}`)},
	{"aws-access-key-id", regexp.MustCompile(`\b(?:AKIA|ASIA)[0-9A-Z]{16}\b`)},
	{"github-token", regexp.MustCompile(`\bgh[pousr]_[A-Za-z0-9]{36,}`)},
	{"github-fine-grained-token", regexp.MustCompile(`github_pat_[A-Za-z0-9_]{60,}`)},
	{"gitlab-token", regexp.MustCompile(`glpat-[A-Za-z0-9_-]{20,}`)},
	{"slack-token", regexp.MustCompile(`xox[abprs]-[A-Za-z0-9-]{10,}`)},
	{"google-api-key", regexp.MustCompile(`AIza[0-9A-Za-z_-]{35}`)},
	{"stripe-key", regexp.MustCompile(`[rs]k_live_[0-9A-Za-z]{20,}`)},
	{"huggingface-token", regexp.MustCompile(`\bhf_[A-Za-z]{34,}`)},
	{"private-key", regexp.MustCompile(`-----BEGIN (?:[A-Z]+ )?PRIVATE KEY-----`)},
}

// Byte classes for the scanners below (hand-written rather than regexps:
// they run over every body and dominate inspection cost otherwise).
var tokenByte, b64Byte, hexByte [256]bool

func init() {
	for c := 0; c < 256; c++ {
		alnum := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
		tokenByte[c] = alnum || strings.IndexByte("+/=_.-", byte(c)) >= 0
		b64Byte[c] = alnum || strings.IndexByte("+/_-=", byte(c)) >= 0
		hexByte[c] = c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F' || c >= '0' && c <= '9'
	}
}

// runs calls f for every maximal run of bytes in class; f returns false to
// stop.
func runs(b []byte, class *[256]bool, f func([]byte) bool) {
	start := -1
	for i := 0; i <= len(b); i++ {
		in := i < len(b) && class[b[i]]
		if in && start < 0 {
			start = i
		} else if !in && start >= 0 {
			if !f(b[start:i]) {
				return
			}
			start = -1
		}
	}
}

func longest(b []byte, class *[256]bool) int {
	n := 0
	runs(b, class, func(r []byte) bool { n = max(n, len(r)); return true })
	return n
}

// Inspect runs every inspector over parts and returns the findings in
// inspector order. An empty result means the request may proceed.
func (s *Set) Inspect(parts []Part) []Finding {
	var out []Finding
	// Real values first, on the unmasked text.
	for _, p := range parts {
		for _, v := range s.realForms {
			if strings.Contains(string(p.Data), v.Value) {
				out = append(out, Finding{policy.InspectRealValues, policy.ActionBlock, fmt.Sprintf("real value of secret %s in %s", v.Name, p.Where)})
				break
			}
		}
	}
	masked := make([]Part, len(parts))
	for i, p := range parts {
		masked[i] = Part{p.Where, s.mask(p.Data)}
	}
	for _, in := range s.list {
		switch in.Name {
		case policy.InspectSecretPatterns:
			for _, p := range masked {
				for _, pat := range patterns {
					if pat.re.Match(p.Data) {
						out = append(out, Finding{in.Name, in.Action, fmt.Sprintf("%s pattern in %s", pat.name, p.Where)})
					}
				}
			}
		case policy.InspectBodySize:
			for _, p := range masked {
				if p.Where == "body" && int64(len(p.Data)) > in.MaxBytes {
					out = append(out, Finding{in.Name, in.Action, fmt.Sprintf("body of %d bytes exceeds %d", len(p.Data), in.MaxBytes)})
				}
			}
		case policy.InspectEntropy:
			bits := in.Threshold
			if bits == 0 {
				bits = DefaultEntropyBits
			}
			minLen := in.MinLength
			if minLen == 0 {
				minLen = DefaultEntropyMinLen
			}
			for _, p := range masked {
				runs(p.Data, &tokenByte, func(tok []byte) bool {
					if len(tok) >= minLen {
						if e := Entropy(tok); e >= bits {
							out = append(out, Finding{in.Name, in.Action, fmt.Sprintf("high-entropy token (%.1f bits/byte, %d bytes) in %s", e, len(tok), p.Where)})
							return false
						}
					}
					return true
				})
			}
		case policy.InspectEncodedBlobs:
			minLen := in.MinLength
			if minLen == 0 {
				minLen = DefaultBlobMinLen
			}
			for _, p := range masked {
				if n := longest(p.Data, &hexByte); n >= minLen {
					out = append(out, Finding{in.Name, in.Action, fmt.Sprintf("hex run of %d bytes in %s", n, p.Where)})
				} else if n := longest(p.Data, &b64Byte); n >= minLen {
					out = append(out, Finding{in.Name, in.Action, fmt.Sprintf("base64 run of %d bytes in %s", n, p.Where)})
				}
			}
		}
	}
	return out
}

// Blocked reports whether any finding blocks.
func Blocked(fs []Finding) bool {
	for _, f := range fs {
		if f.Action == policy.ActionBlock {
			return true
		}
	}
	return false
}

func (s *Set) mask(b []byte) []byte {
	str := string(b)
	changed := false
	for _, p := range s.placeholders {
		if strings.Contains(str, p) {
			str = strings.ReplaceAll(str, p, " ")
			changed = true
		}
	}
	if !changed {
		return b
	}
	return []byte(str)
}

// Entropy is the Shannon entropy of b in bits per byte.
func Entropy(b []byte) float64 {
	if len(b) == 0 {
		return 0
	}
	var counts [256]int
	for _, c := range b {
		counts[c]++
	}
	var h float64
	n := float64(len(b))
	for _, c := range counts {
		if c > 0 {
			p := float64(c) / n
			h -= p * math.Log2(p)
		}
	}
	return h
}
