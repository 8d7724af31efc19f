package redact

import "slices"

// Matcher finds forms in bytes in one pass. Immutable after New; safe for
// concurrent use.
type Matcher struct {
	forms  []Form
	maxLen int
	// first2 has a bit per two-byte prefix some form starts with; cands
	// lists the forms per prefix, longest first (leftmost-longest wins).
	first2 [1 << 16 / 64]uint64
	cands  map[uint16][]int
	// fold matches the forms with ASCII letters lowered, for header
	// names (see Name); nil in fold itself.
	fold *Matcher
}

// New compiles forms. Every form must be at least 2 bytes long.
func New(forms []Form) *Matcher {
	m := newMatcher(forms)
	var folded []Form
	for _, f := range forms {
		r, p := lowerASCII(string(f.Real)), lowerASCII(string(f.Placeholder))
		if len(r) >= 2 && r != p {
			folded = append(folded, Form{Secret: f.Secret, Kind: f.Kind, Real: []byte(r), Placeholder: []byte(p), Public: commonPrefix([]byte(r), []byte(p))})
		}
	}
	m.fold = newMatcher(folded)
	return m
}

func newMatcher(forms []Form) *Matcher {
	m := &Matcher{forms: forms, cands: map[uint16][]int{}}
	for i, f := range forms {
		if len(f.Real) < 2 {
			continue
		}
		k := uint16(f.Real[0])<<8 | uint16(f.Real[1])
		m.first2[k/64] |= 1 << (k % 64)
		m.cands[k] = append(m.cands[k], i)
		m.maxLen = max(m.maxLen, len(f.Real))
	}
	for _, c := range m.cands {
		slices.SortStableFunc(c, func(a, b int) int { return len(forms[b].Real) - len(forms[a].Real) })
	}
	return m
}

// Forms returns the compiled forms.
func (m *Matcher) Forms() []Form { return m.forms }

// MaxLen is the longest form: a stream must hold back MaxLen-1 bytes so a
// form split across reads is still found.
func (m *Matcher) MaxLen() int { return m.maxLen }

// Match is one form found at Offset.
type Match struct {
	Offset int
	Form   *Form
}

// Scan reports forms starting at positions [from, to) of b, leftmost first,
// skipping past each match, and returns where scanning stopped (the end of
// the last match if it runs past to). near is called for a partial match of
// at least Public+NearMin bytes that is not a whole form; either callback
// may be nil.
func (m *Matcher) Scan(b []byte, from, to int, match func(Match), near func(f *Form, n int)) int {
	i := from
	for i < to && i+1 < len(b) {
		k := uint16(b[i])<<8 | uint16(b[i+1])
		if m.first2[k/64]&(1<<(k%64)) == 0 {
			i++
			continue
		}
		hit, nearF, nearN := -1, -1, 0
		for _, fi := range m.cands[k] {
			f := &m.forms[fi]
			n := commonPrefix(b[i:], f.Real)
			if n == len(f.Real) {
				hit = fi
				break
			}
			if n >= f.Public+NearMin && n > nearN {
				nearF, nearN = fi, n
			}
		}
		if hit < 0 {
			// A near-match only counts where no whole form matched (a
			// form's prefix is often another, longer form's prefix).
			if near != nil && nearF >= 0 {
				near(&m.forms[nearF], nearN)
			}
			i++
			continue
		}
		if match != nil {
			match(Match{Offset: i, Form: &m.forms[hit]})
		}
		i += len(m.forms[hit].Real)
	}
	return max(i, to)
}

// Result says what a rewrite replaced and what it saw.
type Result struct {
	Redacted map[string]bool // secret names replaced
	Near     map[string]bool // secret names with a near-match (a long partial prefix)
}

func (r *Result) add(name string, near bool) {
	mp := &r.Redacted
	if near {
		mp = &r.Near
	}
	if *mp == nil {
		*mp = map[string]bool{}
	}
	(*mp)[name] = true
}

// Merge adds o's findings to r.
func (r *Result) Merge(o Result) {
	for k := range o.Redacted {
		r.add(k, false)
	}
	for k := range o.Near {
		r.add(k, true)
	}
}

// Rewrite replaces, in place, every form in b with its placeholder form.
func (m *Matcher) Rewrite(b []byte, res *Result) {
	m.Scan(b, 0, len(b), func(x Match) {
		copy(b[x.Offset:], x.Form.Placeholder)
		res.add(x.Form.Secret, false)
	}, func(f *Form, _ int) { res.add(f.Secret, true) })
}

// String is Rewrite for a string (a header value); s is returned unchanged
// when nothing matched.
func (m *Matcher) String(s string, res *Result) string {
	if m == nil || len(m.forms) == 0 || !m.mayMatch(s) {
		return s
	}
	var before Result
	b := []byte(s)
	m.Rewrite(b, &before)
	res.Merge(before)
	if len(before.Redacted) == 0 {
		return s
	}
	return string(b)
}

// mayMatch reports whether some position of s starts with a two-byte
// prefix of a form: where none does, Scan can find neither a form nor a
// near-match, and String need not copy s (most header values).
func (m *Matcher) mayMatch(s string) bool {
	for i := 0; i+1 < len(s); i++ {
		k := uint16(s[i])<<8 | uint16(s[i+1])
		if m.first2[k/64]&(1<<(k%64)) != 0 {
			return true
		}
	}
	return false
}

// Name is String for a header name. net/http canonicalizes the names it
// reads (a response's, a trailer's) before anything here sees them, so a
// form written into a name arrives with its letters' case changed
// ("X-Sk-Ant-Api03-Realreal…"): matched exactly it would pass, and the
// agent would get the key but for its letters' case. A name is matched
// with ASCII letters lowered on both sides; where a form matched, the
// result is the lowered name with the (lowered) placeholder form in it,
// for the caller to canonicalize again. Otherwise it is String's.
func (m *Matcher) Name(k string, res *Result) string {
	if m != nil && m.fold != nil && m.fold.mayMatchLower(k) {
		low := lowerASCII(k)
		if out := m.fold.String(low, res); out != low {
			return out
		}
	}
	return m.String(k, res)
}

// Folded matches the forms with ASCII letters lowered, over bytes lowered
// the same way: for a header name inspected outbound (see Name). It is
// never nil; its own Folded is.
func (m *Matcher) Folded() *Matcher { return m.fold }

// mayMatchLower is mayMatch of s with its ASCII letters lowered.
func (m *Matcher) mayMatchLower(s string) bool {
	for i := 0; i+1 < len(s); i++ {
		k := uint16(lowerByte(s[i]))<<8 | uint16(lowerByte(s[i+1]))
		if m.first2[k/64]&(1<<(k%64)) != 0 {
			return true
		}
	}
	return false
}

func lowerByte(c byte) byte {
	if 'A' <= c && c <= 'Z' {
		return c + 'a' - 'A'
	}
	return c
}

// lowerASCII lowers ASCII letters only, so lengths never change (a form's
// Real and Placeholder must keep the same length).
func lowerASCII(s string) string {
	b := []byte(s)
	for i, c := range b {
		b[i] = lowerByte(c)
	}
	return string(b)
}
