// Package redact finds a credential's real value in every encoding the
// gateway knows (raw, base64 std/url at each alignment, hex, percent, reversed)
// and replaces it with the same encoding of its placeholder.
//
// One Matcher serves both directions: responses are rewritten through it
// (headers, bodies, trailers, WebSocket messages) and the outbound real-value
// check uses the same forms, so "what counts as the secret" is one list.
//
// Invariants:
//   - a form's Real and Placeholder have the same length, so a rewrite never
//     changes a Content-Length, a header's size or a frame's length;
//   - the streaming Reader's output boundaries depend only on how many bytes
//     came in, never on their content (no oracle: issue 21 item 2).
package redact

import (
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"net/url"
	"slices"
	"strings"
)

// Form is one encoding of a secret's real value, paired with the same
// encoding of its placeholder.
type Form struct {
	Secret      string
	Kind        string // "raw", "base64", "base64url", "hex", "HEX", "percent", "reversed"
	Real        []byte
	Placeholder []byte
	// Public is how many leading bytes Real shares with Placeholder: the
	// provider prefix both keep, which says nothing about the secret.
	Public int
}

// NearMin is how many secret-specific bytes past Public a partial match must
// have to count as a near-match: 8 bytes of a random key by chance is ~2^-47.
const NearMin = 8

// minDerived is the shortest derived (encoded) form kept: a shorter one
// would match ordinary text.
const minDerived = 12

// Forms lists every form of real (and the matching placeholder form) the
// gateway looks for. real and placeholder must have the same length.
func Forms(name, real, placeholder string) ([]Form, error) {
	if len(real) != len(placeholder) {
		return nil, fmt.Errorf("secret %s: placeholder length %d differs from value length %d", name, len(placeholder), len(real))
	}
	if len(real) < 2 {
		return nil, fmt.Errorf("secret %s: value shorter than 2 bytes", name)
	}
	var out []Form
	add := func(kind, r, p string) {
		if r == p || len(r) != len(p) || (kind != "raw" && len(r) < minDerived) {
			return
		}
		for _, f := range out {
			if string(f.Real) == r {
				return
			}
		}
		out = append(out, Form{Secret: name, Kind: kind, Real: []byte(r), Placeholder: []byte(p), Public: commonPrefix([]byte(r), []byte(p))})
	}
	add("raw", real, placeholder)
	// Base64 of the value at each of the three byte alignments it can have
	// inside a longer encoded string (a Basic "user:key" pair, a JSON blob
	// encoded whole): only the characters made of the value's bits alone,
	// so padding and neighbours do not matter.
	for _, enc := range []struct {
		kind string
		e    *base64.Encoding
	}{{"base64", base64.RawStdEncoding}, {"base64url", base64.RawURLEncoding}} {
		for shift := range 3 {
			add(enc.kind, b64Core(enc.e, real, shift), b64Core(enc.e, placeholder, shift))
		}
	}
	add("hex", hex.EncodeToString([]byte(real)), hex.EncodeToString([]byte(placeholder)))
	add("HEX", strings.ToUpper(hex.EncodeToString([]byte(real))), strings.ToUpper(hex.EncodeToString([]byte(placeholder))))
	// Percent-encoding: as net/url writes a query value and a path segment
	// (the same as raw for the usual key alphabet, so deduplicated), and
	// every byte escaped, in both hex cases.
	add("percent", url.QueryEscape(real), url.QueryEscape(placeholder))
	add("percent", url.PathEscape(real), url.PathEscape(placeholder))
	add("percent", pctAll(real, "%%%02X"), pctAll(placeholder, "%%%02X"))
	add("percent", pctAll(real, "%%%02x"), pctAll(placeholder, "%%%02x"))
	add("reversed", reverse(real), reverse(placeholder))
	return out, nil
}

// b64Core encodes v as if it began shift bytes into a longer input and
// returns the characters that depend only on v's bits.
func b64Core(e *base64.Encoding, v string, shift int) string {
	full := e.EncodeToString(append(make([]byte, shift), v...))
	from := (8*shift + 5) / 6      // first 6-bit group starting at or after v
	to := 8 * (shift + len(v)) / 6 // groups ending at or before v's end
	if to <= from || to > len(full) {
		return ""
	}
	return full[from:to]
}

func pctAll(v, format string) string {
	var sb strings.Builder
	for i := 0; i < len(v); i++ {
		fmt.Fprintf(&sb, format, v[i])
	}
	return sb.String()
}

func reverse(v string) string {
	b := []byte(v)
	slices.Reverse(b)
	return string(b)
}

func commonPrefix(a, b []byte) int {
	n := 0
	for n < len(a) && n < len(b) && a[n] == b[n] {
		n++
	}
	return n
}
