package inspect

import (
	"fmt"
	"slices"

	"github.com/nixcage/nixcage/internal/egress/redact"
	"github.com/nixcage/nixcage/internal/policy"
)

// Stream inspects one part (a request body, a WebSocket message) as it
// arrives, in bounded memory, and says which bytes may leave.
//
// Every check works on a window instead of the whole part, and a byte is
// released only once no check can still change its verdict:
//   - real values and near-matches need the longest form after a position
//     (realHold bytes of lookahead);
//   - placeholders are masked before the other checks (phHold lookahead),
//     and the run checks (encoded blobs, entropy) need to have seen a run's
//     start while it is still held (runHold);
//   - secret patterns are re-searched over the last regexSpan bytes.
//
// So a blocked part never lets its offending bytes out: the caller forwards
// only what Write and Close return, and stops at the first blocking finding.
// What is lost against whole-body inspection: a token longer than
// entropyCap is judged on its first entropyCap bytes, and a pattern whose
// shortest match is longer than regexSpan could be missed (none is).
type Stream struct {
	s     *Set
	where string
	name  string // appended to where in reasons (Part.Name)
	fold  bool   // Part.Fold: bytes are lowered, matched lowered

	raw, masked []byte // from absolute offset base
	base        int64
	realScan    int64 // real forms scanned up to here
	phScan      int64 // placeholders masked up to here
	runPos      int64 // run checks fed up to here
	rgFrom      int64 // secret patterns searched from here
	rel         int64 // bytes released
	total       int64
	closed      bool

	findings []Finding
	seen     map[string]bool
	phNames  []string // secrets whose placeholder was seen, each once (a few)

	blobRun  int
	blobDone bool
	tok      []byte
	tokLen   int
	entDone  bool
	sizeDone bool
}

// NewStream starts inspecting one part named where ("body").
func (s *Set) NewStream(where string) *Stream {
	return &Stream{s: s, where: where}
}

// Findings are the findings so far, in inspector order.
func (st *Stream) Findings() []Finding {
	rank := func(name string) int {
		for i, in := range st.s.list {
			if in.Name == name {
				return i + 1
			}
		}
		return 0 // real_values, which is not in the list, runs first
	}
	out := slices.Clone(st.findings)
	slices.SortStableFunc(out, func(a, b Finding) int { return rank(a.Inspector) - rank(b.Inspector) })
	return out
}

// Blocked reports whether a finding so far blocks.
func (st *Stream) Blocked() bool { return Blocked(st.findings) }

// Placeholders lists the secrets whose placeholder the part carries.
func (st *Stream) Placeholders() []string {
	return slices.Clone(st.phNames)
}

// Len is how many bytes were written.
func (st *Stream) Len() int64 { return st.total }

// Write inspects p and returns the bytes now released, valid until the next
// call. Once Blocked, nothing more is released.
func (st *Stream) Write(p []byte) []byte {
	st.compact()
	st.raw = append(st.raw, p...)
	if st.fold {
		lowerASCII(st.raw[len(st.raw)-len(p):])
	}
	st.masked = append(st.masked, st.raw[len(st.raw)-len(p):]...)
	st.total += int64(len(p))
	return st.process()
}

// Close ends the part: everything left is inspected and, unless blocked,
// released.
func (st *Stream) Close() []byte {
	st.compact()
	st.closed = true
	out := st.process()
	st.endToken()
	return out
}

func (st *Stream) compact() {
	if drop := st.rel - st.base; drop > 0 {
		n := copy(st.raw, st.raw[drop:])
		st.raw = st.raw[:n]
		copy(st.masked, st.masked[drop:])
		st.masked = st.masked[:n]
		st.base = st.rel
	}
}

// loc names the part in a finding's reason.
func (st *Stream) loc() string {
	if st.name == "" {
		return st.where
	}
	return st.where + " " + st.name
}

func (st *Stream) add(f Finding) {
	k := f.Inspector + "\x00" + f.Reason
	if st.seen == nil {
		st.seen = map[string]bool{}
	}
	if !st.seen[k] {
		st.seen[k] = true
		st.findings = append(st.findings, f)
	}
}

func (st *Stream) process() []byte {
	s := st.s
	a := st.base + int64(len(st.raw))
	realTo, m := a-int64(s.realHold), a-int64(s.phHold)
	r := min(realTo, m-int64(s.runHold))
	if st.closed {
		realTo, m, r = a, a, a
	}
	off := func(x int64) int { return int(x - st.base) }
	real, ph := s.real, s.ph
	if st.fold {
		real, ph = s.realFold, s.phFold
	}
	if realTo > st.realScan {
		end := real.Scan(st.raw, off(max(st.realScan, st.base)), off(realTo), func(x redact.Match) {
			st.add(Finding{policy.InspectRealValues, policy.ActionBlock, fmt.Sprintf("real value of secret %s (%s form) in %s", x.Form.Secret, x.Form.Kind, st.loc())})
		}, func(f *redact.Form, n int) {
			st.add(Finding{policy.InspectRealValues, policy.ActionFlag, fmt.Sprintf("near-match of secret %s (a %d-byte prefix of its %s form) in %s", f.Secret, n, f.Kind, st.loc())})
		})
		st.realScan = st.base + int64(end)
	}
	if m > st.phScan {
		end := ph.Scan(st.masked, off(max(st.phScan, st.base)), off(m), func(x redact.Match) {
			copy(st.masked[x.Offset:], x.Form.Placeholder)
			if !slices.Contains(st.phNames, x.Form.Secret) {
				st.phNames = append(st.phNames, x.Form.Secret)
			}
		}, nil)
		st.phScan = st.base + int64(end)
	}
	if m > st.runPos {
		st.runs(st.masked[off(st.runPos):off(m)])
		st.patterns(m)
		st.runPos = m
	}
	for _, in := range s.list {
		if in.Name == policy.InspectBodySize && !st.sizeDone && st.total > in.MaxBytes {
			st.sizeDone = true
			st.add(Finding{in.Name, in.Action, fmt.Sprintf("%s exceeds %d bytes", st.loc(), in.MaxBytes)})
		}
	}
	if st.Blocked() || r <= st.rel {
		return nil
	}
	out := st.raw[off(st.rel):off(r)]
	st.rel = r
	return out
}

// patterns searches for known secret formats in masked bytes up to m,
// starting one byte before the unsearched part so \b sees its neighbour.
func (st *Stream) patterns(m int64) {
	if st.s.patIdx < 0 {
		return
	}
	in := &st.s.list[st.s.patIdx]
	from := max(st.rgFrom, st.base)
	lead := int64(0)
	if from > st.base {
		lead = 1
	}
	win := st.masked[from-lead-st.base : m-st.base]
	ps := exact
	if st.fold {
		ps = folded
	}
	var hit [len(patternsInit)]bool
	if !ps.anchoredIn(win, &hit) {
		st.rgFrom = max(st.rgFrom, m-regexSpan)
		return
	}
	for i := range ps.list {
		pat := &ps.list[i]
		if !hit[i] {
			continue
		}
		for _, loc := range pat.re.FindAllIndex(win, -1) {
			if int64(loc[0]) >= lead {
				st.add(Finding{in.Name, in.Action, fmt.Sprintf("%s pattern in %s", pat.name, st.loc())})
				break
			}
		}
	}
	st.rgFrom = max(st.rgFrom, m-regexSpan)
}

// runs feeds masked bytes to the run checks: encoded blobs (a base64 or hex
// run of min_length) and entropy (a token of min_length or more).
func (st *Stream) runs(b []byte) {
	for _, in := range st.s.list {
		switch in.Name {
		case policy.InspectEncodedBlobs:
			if st.blobDone {
				continue
			}
			minLen := orInt(in.MinLength, DefaultBlobMinLen)
			for _, c := range b {
				if !b64Byte[c] {
					st.blobRun = 0
					continue
				}
				if st.blobRun++; st.blobRun >= minLen {
					st.blobDone = true
					st.add(Finding{in.Name, in.Action, fmt.Sprintf("base64 or hex run of %d+ bytes in %s", minLen, st.loc())})
					break
				}
			}
		case policy.InspectEntropy:
			for _, c := range b {
				if st.entDone {
					break
				}
				if !tokenByte[c] {
					st.endToken()
					continue
				}
				st.tokLen++
				if len(st.tok) < entropyCap {
					st.tok = append(st.tok, c)
					if len(st.tok) == entropyCap {
						st.judgeToken()
					}
				}
			}
		}
	}
}

func (st *Stream) endToken() {
	if st.tokLen == 0 {
		// No token since the last end: nothing to judge (most bytes
		// between tokens, a space or a colon, end an empty one).
		return
	}
	if len(st.tok) < entropyCap {
		st.judgeToken()
	}
	st.tok, st.tokLen = st.tok[:0], 0
}

func (st *Stream) judgeToken() {
	for _, in := range st.s.list {
		if in.Name != policy.InspectEntropy || st.entDone {
			continue
		}
		bits := in.Threshold
		if bits == 0 {
			bits = DefaultEntropyBits
		}
		if len(st.tok) < orInt(in.MinLength, DefaultEntropyMinLen) {
			continue
		}
		if e := Entropy(st.tok); e >= bits {
			st.entDone = true
			st.add(Finding{in.Name, in.Action, fmt.Sprintf("high-entropy token (%.1f bits/byte, %d+ bytes) in %s", e, len(st.tok), st.loc())})
		}
	}
}

// lowerASCII lowers b's ASCII letters in place (a Fold part's bytes).
func lowerASCII(b []byte) {
	for i, c := range b {
		if 'A' <= c && c <= 'Z' {
			b[i] = c + 'a' - 'A'
		}
	}
}
