// Package podman checks that the rendered podman cage runs for real on this
// host, outside systemd: the test runs the unit's ExecStart= exactly as
// systemd would.
package podman

import (
	"fmt"
	"strconv"
	"strings"
)

// execArgv turns the value of an ExecStart= line into the argv systemd
// passes to execve: "%%" becomes "%" (other specifiers are refused, the
// test renders none), words are split on blanks with double and single
// quotes removed and C escapes decoded, and "$$" becomes "$" in each word
// (a lone "$" would be an environment expansion, refused). The "-@:+!"
// prefixes systemd allows before the path are refused too: the podman unit
// uses none and a silent strip would hide a change.
func execArgv(line string) ([]string, error) {
	var spec strings.Builder
	for i := 0; i < len(line); i++ {
		if line[i] != '%' {
			spec.WriteByte(line[i])
			continue
		}
		if i+1 < len(line) && line[i+1] == '%' {
			spec.WriteByte('%')
			i++
			continue
		}
		return nil, fmt.Errorf("execline: specifier at offset %d not supported (only %%%%)", i)
	}
	s := spec.String()
	var argv []string
	for i := 0; ; {
		for i < len(s) && strings.IndexByte(" \t\n\r", s[i]) >= 0 {
			i++
		}
		if i == len(s) {
			break
		}
		var w strings.Builder
		var quote byte
		for ; i < len(s); i++ {
			c := s[i]
			if quote == 0 && strings.IndexByte(" \t\n\r", c) >= 0 {
				break
			}
			switch {
			case quote == 0 && (c == '"' || c == '\''):
				quote = c
			case quote != 0 && c == quote:
				quote = 0
			case c == '\\':
				if i+1 == len(s) {
					return nil, fmt.Errorf("execline: trailing backslash")
				}
				n, r, err := cEscape(s[i+1:])
				if err != nil {
					return nil, err
				}
				w.WriteString(r)
				i += n
			default:
				w.WriteByte(c)
			}
		}
		if quote != 0 {
			return nil, fmt.Errorf("execline: unterminated %c quote", quote)
		}
		word, err := dollars(w.String())
		if err != nil {
			return nil, err
		}
		argv = append(argv, word)
	}
	if len(argv) == 0 {
		return nil, fmt.Errorf("execline: empty command")
	}
	if strings.ContainsAny(argv[0][:1], "-@:+!") {
		return nil, fmt.Errorf("execline: prefix %q not supported", argv[0][:1])
	}
	return argv, nil
}

// cEscape decodes the escape after a backslash; s starts after it. It
// returns how many bytes of s it used and the decoded text.
func cEscape(s string) (int, string, error) {
	simple := map[byte]string{'a': "\a", 'b': "\b", 'f': "\f", 'n': "\n", 'r': "\r", 't': "\t", 'v': "\v", 's': " ", '\\': "\\", '"': "\"", '\'': "'"}
	if r, ok := simple[s[0]]; ok {
		return 1, r, nil
	}
	base, digits := 0, 0
	switch {
	case s[0] == 'x':
		base, digits = 16, 2
	case s[0] >= '0' && s[0] <= '7':
		base, digits = 8, 3
	default:
		return 0, "", fmt.Errorf("execline: unknown escape \\%c", s[0])
	}
	start := 0
	if base == 16 {
		start = 1
	}
	if len(s) < start+digits {
		return 0, "", fmt.Errorf("execline: short escape \\%s", s)
	}
	v, err := strconv.ParseUint(s[start:start+digits], base, 8)
	if err != nil || v == 0 {
		return 0, "", fmt.Errorf("execline: bad escape \\%s", s[:start+digits])
	}
	return start + digits, string([]byte{byte(v)}), nil
}

func dollars(w string) (string, error) {
	var b strings.Builder
	for i := 0; i < len(w); i++ {
		if w[i] != '$' {
			b.WriteByte(w[i])
			continue
		}
		if i+1 < len(w) && w[i+1] == '$' {
			b.WriteByte('$')
			i++
			continue
		}
		return "", fmt.Errorf("execline: environment expansion in %q not supported", w)
	}
	return b.String(), nil
}
