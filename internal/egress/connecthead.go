package egress

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
)

// The front end (front.go) reads a CONNECT request head itself instead of
// going through net/http's server: a tunnel then costs one goroutine up to
// its relay, no header map, no response writer and no hijack. The parser is
// strict where net/http is lenient on the CONNECT path (a CONNECT carries
// no body and names host:port, nothing else); what it accepts is decided
// by decideConnect exactly like a CONNECT net/http parsed.

// connectHead is a parsed CONNECT request head.
type connectHead struct {
	// authority is the request target, host:port, as net/http would have
	// put it in Request.Host (url.ParseRequestURI's host).
	authority string
	// header holds only the fields the decision and a refusal read: the
	// proxy-chaining ones and Accept/Content-Type (wantsJSON). nil when the
	// request carried none of them, which is the usual case.
	header http.Header
}

// headError is a malformed request head: the status to answer and what is
// wrong, for the agent and the audit record.
type headError struct {
	status int
	msg    string
}

func (e *headError) Error() string {
	return fmt.Sprintf("%d %s: %s", e.status, http.StatusText(e.status), e.msg)
}

func badHead(format string, args ...any) *headError {
	return &headError{status: http.StatusBadRequest, msg: fmt.Sprintf(format, args...)}
}

// keptHeaders are the fields readConnectHead keeps (canonical names).
var keptHeaders = append([]string{"Accept", "Content-Type"}, chainingHeaders...)

// readConnectHead reads one CONNECT request head from br: the request line,
// then header lines up to the empty line, at most max bytes in all
// (http.StatusRequestHeaderFieldsTooLarge beyond). Errors are *headError
// for input that is not a well-formed CONNECT head, or the reader's error
// (EOF, the read deadline) when the head never completes.
func readConnectHead(br *bufio.Reader, max int) (connectHead, error) {
	var h connectHead
	var scratch []byte
	used := 0
	line, err := readHeadLine(br, &scratch, &used, max)
	if err != nil {
		return h, err
	}
	method, rest, ok1 := bytes.Cut(line, []byte{' '})
	target, proto, ok2 := bytes.Cut(rest, []byte{' '})
	if !ok1 || !ok2 || len(target) == 0 {
		return h, badHead("malformed request line %q", clip(line))
	}
	if string(method) != http.MethodConnect {
		return h, badHead("method %q: the front end reads CONNECT only", clip(method))
	}
	if err := checkProto(proto); err != nil {
		return h, err
	}
	if h.authority, err = connectAuthority(target); err != nil {
		return h, err
	}
	hosts := 0
	for {
		line, err := readHeadLine(br, &scratch, &used, max)
		if err != nil {
			return h, err
		}
		if len(line) == 0 {
			return h, nil
		}
		if line[0] == ' ' || line[0] == '\t' {
			return h, badHead("folded header line %q (obsolete line folding is not accepted)", clip(line))
		}
		name, value, ok := bytes.Cut(line, []byte{':'})
		if !ok {
			return h, badHead("malformed header line %q: no colon", clip(line))
		}
		if !validToken(name) {
			return h, badHead("malformed header name %q", clip(name))
		}
		value = bytes.Trim(value, " \t")
		if !validValue(value) {
			return h, badHead("header %s: control character in value", clip(name))
		}
		switch {
		case bytes.EqualFold(name, []byte("Host")):
			if hosts++; hosts > 1 {
				return h, badHead("too many Host headers")
			}
		case bytes.EqualFold(name, []byte("Content-Length")):
			if string(value) != "0" {
				return h, badHead("a CONNECT request carries no body (Content-Length %q)", clip(value))
			}
		case bytes.EqualFold(name, []byte("Transfer-Encoding")):
			return h, badHead("a CONNECT request carries no body (Transfer-Encoding)")
		default:
			for _, k := range keptHeaders {
				if bytes.EqualFold(name, []byte(k)) {
					if h.header == nil {
						h.header = http.Header{}
					}
					h.header[k] = append(h.header[k], string(value))
					break
				}
			}
		}
	}
}

// readHeadLine returns the next line without its line ending (CRLF, or a
// bare LF as net/textproto accepts), counting it against max. The slice
// is valid until the next call.
func readHeadLine(br *bufio.Reader, scratch *[]byte, used *int, max int) ([]byte, error) {
	*scratch = (*scratch)[:0]
	for {
		frag, err := br.ReadSlice('\n')
		*used += len(frag)
		if *used > max {
			return nil, &headError{status: http.StatusRequestHeaderFieldsTooLarge, msg: fmt.Sprintf("request head over %d bytes", max)}
		}
		switch {
		case err == nil:
			line := frag
			if len(*scratch) > 0 {
				line = append(*scratch, frag...)
			}
			line = line[:len(line)-1]
			if n := len(line); n > 0 && line[n-1] == '\r' {
				line = line[:n-1]
			}
			return line, nil
		case errors.Is(err, bufio.ErrBufferFull):
			*scratch = append(*scratch, frag...)
		default:
			return nil, err
		}
	}
}

// checkProto accepts HTTP/1.0 and HTTP/1.1; another well-formed version is
// 505 (as net/http answers it), anything else 400.
func checkProto(p []byte) error {
	switch string(p) {
	case "HTTP/1.1", "HTTP/1.0":
		return nil
	}
	if _, _, ok := http.ParseHTTPVersion(string(p)); ok {
		return &headError{status: http.StatusHTTPVersionNotSupported, msg: fmt.Sprintf("%q: CONNECT over HTTP/1.x only", clip(p))}
	}
	return badHead("malformed HTTP version %q", clip(p))
}

// connectAuthority parses the request target of a CONNECT: authority form
// (host:port) only, parsed as net/http parses it (url.ParseRequestURI of
// "http://"+target, whose host becomes Request.Host), with no user info,
// path, query or fragment.
func connectAuthority(target []byte) (string, error) {
	if target[0] == '/' || target[0] == '*' {
		return "", badHead("CONNECT target %q: want host:port (authority form)", clip(target))
	}
	u, err := url.ParseRequestURI("http://" + string(target))
	if err != nil || u.Host == "" || u.User != nil || u.Path != "" || u.RawQuery != "" || u.ForceQuery || u.Fragment != "" || u.Opaque != "" {
		return "", badHead("CONNECT target %q: want host:port (authority form)", clip(target))
	}
	return u.Host, nil
}

// validToken reports whether b is an RFC 9110 token (a field name).
func validToken(b []byte) bool {
	if len(b) == 0 {
		return false
	}
	for _, c := range b {
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		case strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0:
		default:
			return false
		}
	}
	return true
}

// validValue reports whether b has no control character but HTAB (as
// net/http's header value check).
func validValue(b []byte) bool {
	for _, c := range b {
		if (c < ' ' && c != '\t') || c == 0x7f {
			return false
		}
	}
	return true
}

// clip bounds a quoted piece of agent input in a message.
func clip(b []byte) string {
	if len(b) > 64 {
		return string(b[:64]) + "..."
	}
	return string(b)
}

// denialWriter is the http.ResponseWriter of a refusal the front end
// writes itself: writeDenial fills it, and writeTo sends it as one HTTP/1.1
// response, so a refused CONNECT reads the same from either front end.
type denialWriter struct {
	h      http.Header
	status int
	body   bytes.Buffer
}

func newDenialWriter() *denialWriter { return &denialWriter{h: http.Header{}} }

func (w *denialWriter) Header() http.Header { return w.h }

func (w *denialWriter) WriteHeader(status int) {
	if w.status == 0 {
		w.status = status
	}
}

func (w *denialWriter) Write(p []byte) (int, error) {
	w.WriteHeader(http.StatusOK)
	return w.body.Write(p)
}

// bytes is the whole response.
func (w *denialWriter) bytes() []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "HTTP/1.1 %d %s\r\n", w.status, http.StatusText(w.status))
	w.h.Set("Content-Length", strconv.Itoa(w.body.Len()))
	_ = w.h.Write(&b)
	b.WriteString("\r\n")
	b.Write(w.body.Bytes())
	return b.Bytes()
}
