package auditlog

import (
	"strconv"
	"unicode/utf8"
)

// AppendJSON appends r as encoding/json's Marshal writes it, byte for
// byte (the same field order, names, omitempty on count, HTML-safe string
// escaping, invalid UTF-8 as U+FFFD), without reflection: the gateway
// writes one record per request, and json.Marshal was a twentieth of its
// CPU per intercepted request (docs/performance.md, issue 20). The field
// names are the struct tags' (the schema); TestAppendJSONIsMarshal fills
// every field of Record by reflection and compares with json.Marshal, so a
// field added to Record and not here fails it.
func (r *Record) AppendJSON(b []byte) []byte {
	b = append(b, `{"schema":`...)
	b = strconv.AppendInt(b, int64(r.Schema), 10)
	b = appendField(b, `,"ts":`, r.TS)
	b = appendField(b, `,"agent":`, r.Agent)
	b = appendField(b, `,"event":`, r.Event)
	b = appendField(b, `,"method":`, r.Method)
	b = appendField(b, `,"host":`, r.Host)
	b = append(b, `,"port":`...)
	b = strconv.AppendInt(b, int64(r.Port), 10)
	b = appendField(b, `,"path":`, r.Path)
	b = appendField(b, `,"decision":`, r.Decision)
	b = appendField(b, `,"reason":`, r.Reason)
	b = appendField(b, `,"rule":`, r.Rule)
	b = appendList(b, `,"inspectors":`, r.Inspectors)
	b = appendList(b, `,"secrets_injected":`, r.SecretsInjected)
	b = appendList(b, `,"secrets_redacted":`, r.SecretsRedacted)
	b = append(b, `,"bytes_out":`...)
	b = strconv.AppendInt(b, r.BytesOut, 10)
	b = append(b, `,"bytes_in":`...)
	b = strconv.AppendInt(b, r.BytesIn, 10)
	b = append(b, `,"duration_ms":`...)
	b = strconv.AppendInt(b, r.DurationMS, 10)
	if r.Count != 0 {
		b = append(b, `,"count":`...)
		b = strconv.AppendInt(b, r.Count, 10)
	}
	return append(b, '}')
}

func appendField(b []byte, key, v string) []byte {
	return appendJSONString(append(b, key...), v)
}

// appendList writes a nil list as null, as json.Marshal does.
func appendList(b []byte, key string, l []string) []byte {
	b = append(b, key...)
	if l == nil {
		return append(b, "null"...)
	}
	b = append(b, '[')
	for i, s := range l {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendJSONString(b, s)
	}
	return append(b, ']')
}

const hexDigits = "0123456789abcdef"

// appendJSONString quotes s as encoding/json does with HTML escaping on
// (its default): '"' and '\' escaped, \b \f \n \r \t by name, other
// control bytes and < > & as \u00XX, an invalid UTF-8 byte as \ufffd,
// U+2028 and U+2029 as \u2028 and \u2029.
func appendJSONString(b []byte, s string) []byte {
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' && c != '<' && c != '>' && c != '&' {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '"', '\\':
				b = append(b, '\\', c)
			case '\b':
				b = append(b, '\\', 'b')
			case '\f':
				b = append(b, '\\', 'f')
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			default:
				b = append(b, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, s[start:i]...)
			b = append(b, `\ufffd`...)
			i++
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			b = append(b, s[start:i]...)
			b = append(b, '\\', 'u', '2', '0', '2', hexDigits[r&0xf])
			i += size
			start = i
			continue
		}
		i += size
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}
