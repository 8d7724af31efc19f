package egress

import (
	"bufio"
	"net/http"
	"net/http/httptrace"
	"slices"
	"strings"
)

// writeHead writes a GET or HEAD request without a body exactly as
// net/http's Request.Write does (the same bytes: TestWriteHeadIsRequestWrite
// compares them over random requests), and reports false, having written
// nothing, for every other request, which goes through Request.Write.
// Request.Write formats its request and Host lines with fmt.Fprintf: six
// allocations and a twentieth of the gateway's CPU per intercepted request
// (docs/performance.md, issue 20), for the requests that are nearly all of
// an agent's.
//
// What it leaves to Request.Write: a body, Content-Length or
// Transfer-Encoding to write, Connection: close, trailers, a client trace,
// a Host that is not plain ASCII (Request.Write converts it to punycode or
// drops it), a request URI with a control byte (Request.Write refuses it).
func writeHead(bw *bufio.Writer, req *http.Request) bool {
	if (req.Method != http.MethodGet && req.Method != http.MethodHead) || req.Body != nil || req.ContentLength != 0 ||
		req.Close || req.TransferEncoding != nil || req.Trailer != nil || httptrace.ContextClientTrace(req.Context()) != nil {
		return false
	}
	host := req.Host
	if host == "" {
		host = req.URL.Host
	}
	if !plainHost(host) {
		return false
	}
	uri := req.URL.RequestURI()
	for i := 0; i < len(uri); i++ {
		if c := uri[i]; c < ' ' || c == 0x7f {
			return false
		}
	}
	bw.WriteString(req.Method)
	bw.WriteByte(' ')
	bw.WriteString(uri)
	bw.WriteString(" HTTP/1.1\r\nHost: ")
	bw.WriteString(host)
	bw.WriteString("\r\n")
	// Go's default unless the header has one; an empty one sends none.
	ua := "Go-http-client/1.1"
	if _, ok := req.Header["User-Agent"]; ok {
		ua = req.Header.Get("User-Agent")
	}
	if ua != "" {
		bw.WriteString("User-Agent: ")
		bw.WriteString(headerValue(ua))
		bw.WriteString("\r\n")
	}
	var buf [16]string
	keys := buf[:0]
	for k := range req.Header {
		switch k {
		case "Host", "User-Agent", "Content-Length", "Transfer-Encoding", "Trailer":
			continue
		}
		if validFieldName(k) {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	for _, k := range keys {
		for _, v := range req.Header[k] {
			bw.WriteString(k)
			bw.WriteString(": ")
			bw.WriteString(headerValue(v))
			bw.WriteString("\r\n")
		}
	}
	bw.WriteString("\r\n")
	return true
}

// headerValue is a value as Request.Write writes it: CR and LF turned into
// spaces, then leading and trailing spaces, tabs, CRs and LFs cut.
func headerValue(v string) string {
	if strings.ContainsAny(v, "\r\n") {
		v = strings.NewReplacer("\n", " ", "\r", " ").Replace(v)
	}
	return strings.Trim(v, " \t\r\n")
}

// plainHost: a host[:port] Request.Write sends as it is (ASCII letters,
// digits, dots, hyphens, a colon and a port, brackets of an IPv6 literal
// without a zone).
func plainHost(h string) bool {
	if h == "" {
		return false
	}
	for i := 0; i < len(h); i++ {
		c := h[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '-' || c == ':' || c == '[' || c == ']') {
			return false
		}
	}
	return true
}
