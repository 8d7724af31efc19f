// Package inspect runs content checks on what a cage sends out.
//
// Inspectors see a request exactly as the agent wrote it, with placeholders
// and never with real credential values (injection happens after every
// inspector passed). Placeholders are masked before pattern, entropy and
// blob checks, because they are made to look like real keys and would
// otherwise flag every legitimate call. Findings carry the inspector, the
// part and a pattern name, never the matched text.
//
// Bodies are inspected as they stream (Stream), in bounded memory; whole
// parts (URL, headers) go through the same code (Inspect). Real values are
// looked for in every form redact.Forms lists, with the same Matcher the
// response redactor uses.
package inspect

import (
	"bytes"
	"fmt"
	"math"
	"regexp"
	"strings"
	"sync"

	"github.com/nixcage/nixcage/internal/egress/redact"
	"github.com/nixcage/nixcage/internal/policy"
)

// Finding is one inspector hit.
type Finding struct {
	Inspector string
	Action    string // policy.ActionFlag or policy.ActionBlock
	Reason    string
}

// Part is one piece of a request: "url", "header Name", "body". Name,
// when set, is appended to Where (with a space) in a finding's reason: a
// header's part is {Where: "header", Name: "X-Api-Key"}, so no string is
// built per header unless a finding names it.
//
// Fold marks a part whose letters' case is not the sender's: a header
// name, which net/http canonicalizes before anything here sees it (HTTP/2
// sends it lowered). Such a part is inspected with its ASCII letters
// lowered, against the real values, placeholders and secret patterns
// lowered too: an agent can pick any case for a key it writes into a name,
// so what the key is but for its letters' case counts as the key.
type Part struct {
	Where string
	Name  string
	Data  []byte
	Fold  bool
}

// Set is a configured list of inspectors. Immutable after New.
type Set struct {
	list []policy.Inspector
	// real finds every form of every real value (the same list the
	// response redactor uses); a whole form blocks, a near-match flags.
	real *redact.Matcher
	// ph finds placeholders, to mask them and to report which secret's
	// placeholder a request carries.
	ph *redact.Matcher
	// realFold and phFold are real and ph lowered, for Fold parts.
	realFold, phFold *redact.Matcher
	// hold is how many bytes a Stream keeps back (see Stream).
	realHold, phHold, runHold int
	// names is what Names returns; patIdx is the secret_patterns entry
	// of list, -1 when it is not listed.
	names  []string
	patIdx int
	// streams holds the Streams Inspect reuses (their buffers grow once).
	streams sync.Pool
}

// Defaults used when an inspector leaves its parameter at zero.
const (
	DefaultEntropyBits   = policy.DefaultEntropyBits
	DefaultEntropyMinLen = policy.DefaultEntropyMinLength
	DefaultBlobMinLen    = policy.DefaultBlobMinLength
)

// entropyCap is the longest token the entropy check judges whole; a longer
// one is judged on its first entropyCap bytes, so a stream need hold no more.
const entropyCap = 1024

// maxPooledStream bounds the buffers of a Stream kept for reuse: a huge
// header once must not stay in memory for good.
const maxPooledStream = 64 << 10

// regexSpan bounds how far back a secret pattern is re-searched across
// chunk boundaries; every pattern's shortest match is shorter.
const regexSpan = 256

// New validates the inspector list. The real_values check always runs and
// always blocks, whether listed or not: a real value outbound is never
// acceptable (THREATS.md). real holds every form of every real value;
// placeholders maps a secret's name to its placeholder.
func New(list []policy.Inspector, real *redact.Matcher, placeholders map[string]string) (*Set, error) {
	s := &Set{real: real}
	if s.real == nil {
		s.real = redact.New(nil)
	}
	var phForms []redact.Form
	for name, p := range placeholders {
		phForms = append(phForms, redact.Form{Secret: name, Kind: "placeholder", Real: []byte(p), Placeholder: bytes.Repeat([]byte(" "), len(p))})
	}
	s.ph = redact.New(phForms)
	s.runHold = max(regexSpan, entropyCap)
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
		case policy.InspectEncodedBlobs:
			s.runHold = max(s.runHold, orInt(in.MinLength, DefaultBlobMinLen))
		case policy.InspectEntropy:
			s.runHold = max(s.runHold, orInt(in.MinLength, DefaultEntropyMinLen))
		case policy.InspectSecretPatterns:
		default:
			return nil, fmt.Errorf("unknown inspector %q; known: %s", in.Name, strings.Join(policy.InspectorNames, ", "))
		}
		s.list = append(s.list, in)
	}
	s.realFold, s.phFold = s.real.Folded(), s.ph.Folded()
	s.realHold = max(0, s.real.MaxLen()-1)
	s.phHold = max(0, s.ph.MaxLen()-1)
	s.names = []string{policy.InspectRealValues}
	s.patIdx = -1
	for i, in := range s.list {
		s.names = append(s.names, in.Name)
		if in.Name == policy.InspectSecretPatterns {
			s.patIdx = i
		}
	}
	return s, nil
}

func orInt(v, d int) int {
	if v == 0 {
		return d
	}
	return v
}

// Names lists the inspectors that run, for the audit record. The slice is
// the Set's own, the same on every call: callers must not modify it.
func (s *Set) Names() []string { return s.names }

// pattern is a known secret format. A regexp runs only where one of its
// literal anchors occurs: most bodies contain none, and the regexps (with
// \b) cost far more than a substring search. Anchors are 2 bytes or longer
// (patternSet indexes their first two).
type pattern struct {
	name    string
	anchors []string
	re      *regexp.Regexp
}

var patterns = patternsInit[:]

// patternSet is a pattern list and an index of its anchors: the anchors'
// first two bytes (a bitset, so most bytes cost one lookup; lowered names
// are full of "a" and "s", which start folded anchors) and, per first byte,
// the anchors starting with it.
type patternSet struct {
	list    []pattern
	first2  [1 << 16 / 64]uint64
	byFirst [256][]anchorRef
}

type anchorRef struct {
	pat int
	a   string
}

func newPatternSet(list []pattern) *patternSet {
	ps := &patternSet{list: list}
	for i, p := range list {
		for _, a := range p.anchors {
			k := uint16(a[0])<<8 | uint16(a[1])
			ps.first2[k/64] |= 1 << (k % 64)
			ps.byFirst[a[0]] = append(ps.byFirst[a[0]], anchorRef{i, a})
		}
	}
	return ps
}

// exact is patterns as written; folded is them for Fold parts: anchors
// lowered, regexps without case (the part's bytes are lowered).
var exact, folded = newPatternSet(patterns), func() *patternSet {
	list := make([]pattern, len(patterns))
	for i, p := range patterns {
		list[i] = pattern{name: p.name, re: regexp.MustCompile("(?i)" + p.re.String())}
		for _, a := range p.anchors {
			list[i].anchors = append(list[i].anchors, strings.ToLower(a))
		}
	}
	return newPatternSet(list)
}()

var patternsInit = [...]pattern{
	{"anthropic-key", []string{"sk-ant-"}, regexp.MustCompile(`sk-ant-[A-Za-z0-9_-]{20,}`)},
	{"openai-key", []string{"sk-"}, regexp.MustCompile(`sk-(?:proj|svcacct|admin)-[A-Za-z0-9_-]{40,}|sk-[A-Za-z0-9]{20}T3BlbkFJ[A-Za-z0-9]{20}`)},
	{"aws-access-key-id", []string{"AKIA", "ASIA"}, regexp.MustCompile(`\b(?:AKIA|ASIA)[0-9A-Z]{16}\b`)},
	{"github-token", []string{"ghp_", "gho_", "ghu_", "ghs_", "ghr_"}, regexp.MustCompile(`\bgh[pousr]_[A-Za-z0-9]{36,}`)},
	{"github-fine-grained-token", []string{"github_pat_"}, regexp.MustCompile(`github_pat_[A-Za-z0-9_]{60,}`)},
	{"gitlab-token", []string{"glpat-"}, regexp.MustCompile(`glpat-[A-Za-z0-9_-]{20,}`)},
	{"slack-token", []string{"xoxa-", "xoxb-", "xoxp-", "xoxr-", "xoxs-"}, regexp.MustCompile(`xox[abprs]-[A-Za-z0-9-]{10,}`)},
	{"google-api-key", []string{"AIza"}, regexp.MustCompile(`AIza[0-9A-Za-z_-]{35}`)},
	{"stripe-key", []string{"k_live_"}, regexp.MustCompile(`[rs]k_live_[0-9A-Za-z]{20,}`)},
	{"huggingface-token", []string{"hf_"}, regexp.MustCompile(`\bhf_[A-Za-z]{34,}`)},
	{"private-key", []string{"-----BEGIN "}, regexp.MustCompile(`-----BEGIN (?:[A-Z]+ )?PRIVATE KEY-----`)},
}

// anchoredIn sets hit[i] when some anchor of ps.list[i] occurs in b: one
// pass over b for every pattern, rather than one search per anchor (a
// request head is a dozen short parts, where the searches' set-up cost
// dominated).
func (ps *patternSet) anchoredIn(b []byte, hit *[len(patternsInit)]bool) bool {
	found := false
	for i := 0; i+1 < len(b); i++ {
		if k := uint16(b[i])<<8 | uint16(b[i+1]); ps.first2[k/64]&(1<<(k%64)) == 0 {
			continue
		}
		for _, r := range ps.byFirst[b[i]] {
			if !hit[r.pat] && len(b)-i >= len(r.a) && string(b[i:i+len(r.a)]) == r.a {
				hit[r.pat], found = true, true
			}
		}
	}
	return found
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

// Inspect runs every inspector over whole parts (URL, headers) and returns
// the findings. An empty result means the request may proceed. Placeholder
// names seen are in the second result.
func (s *Set) Inspect(parts []Part) ([]Finding, []string) {
	var out []Finding
	var phs []string
	st, _ := s.streams.Get().(*Stream)
	if st == nil {
		st = s.NewStream("")
	}
	for _, p := range parts {
		// One stream, reset per part, so its buffers are reused (and
		// kept for the next call: what it returns are copies).
		*st = Stream{s: s, where: p.Where, name: p.Name, fold: p.Fold, raw: st.raw[:0], masked: st.masked[:0], tok: st.tok[:0]}
		st.Write(p.Data)
		st.Close()
		if len(st.findings) > 0 {
			out = append(out, st.Findings()...)
		}
		if len(st.phNames) > 0 {
			phs = append(phs, st.Placeholders()...)
		}
	}
	if cap(st.raw) <= maxPooledStream {
		*st = Stream{raw: st.raw[:0], masked: st.masked[:0], tok: st.tok[:0]}
		s.streams.Put(st)
	}
	return out, phs
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
