package egress

import (
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"

	"github.com/nixcage/nixcage/internal/egress/redact"
)

// respond is the redact stage: it sends the upstream's response to the
// agent with every form of every real value turned into the same form of
// its placeholder, in header names and values, the body and trailers, all
// through one Matcher (headers are not special-cased: the hole of issue 11
// sat in inline header code). From a secret-bound host the body is first
// decoded from any content-coding; a coding that cannot be decoded is
// refused (a *blockedErr, before anything is written) rather than passed.
func (g *Gateway) respond(w http.ResponseWriter, resp *http.Response, t *target) (int64, redact.Result, error) {
	var res redact.Result
	if resp.StatusCode < 100 || resp.StatusCode > 999 {
		// net/http's HTTP/1.1 client takes any three digits as a status,
		// its HTTP/2 client whatever strconv.Atoi takes from :status;
		// writing one outside 100-999 panics the agent's server, and the
		// request would end with no answer and no audit record
		// (TestRedTeamH2UpstreamStatusOutOfRange: :status 1000).
		return 0, res, block(http.StatusBadGateway, "upstream", "upstream: status %03d", resp.StatusCode)
	}
	m := t.st.redact
	var src io.Reader = resp.Body
	decoded := false
	noBody := resp.Body == http.NoBody || resp.StatusCode == http.StatusNoContent || resp.StatusCode == http.StatusNotModified || (resp.Request != nil && resp.Request.Method == http.MethodHead)
	if cs := codings(resp.Header); len(cs) > 0 && t.st.bound(t.host) && noBody {
		// Nothing to decode; the headers describe what a GET would get
		// from the gateway, which is identity.
		decoded = true
	} else if len(cs) > 0 && t.st.bound(t.host) {
		if resp.StatusCode == http.StatusPartialContent {
			return 0, res, block(http.StatusBadGateway, "content-encoding", "upstream sent a range of a %s-coded body, which cannot be decoded to redact it", strings.Join(cs, ","))
		}
		dec, closer, err := decodeBody(resp.Body, cs, g.decodeMem)
		if err != nil {
			return 0, res, codingBlock(http.StatusBadGateway, "upstream response", err)
		}
		defer closer()
		src, decoded = dec, true
	}
	delHop(resp.Header)
	if decoded {
		resp.Header.Del("Content-Encoding")
		resp.Header.Del("Content-Length")
	}
	redactHeader(m, resp.Header, w.Header(), "", &res)
	w.WriteHeader(resp.StatusCode)
	// A body of unknown length may be a stream whose first bytes are held
	// back (below): its headers go now, so the agent sees it start. A body
	// of known length goes with its headers in one write.
	if resp.ContentLength < 0 {
		_ = http.NewResponseController(w).Flush()
	}
	var red *redact.Reader
	if len(m.Forms()) > 0 {
		red = m.NewReader(src)
		defer red.Release()
		src = red
	}
	n, err := copyFlush(w, src)
	if red != nil {
		res.Merge(red.Result())
	}
	// Trailers arrive after the body; they go through the same matcher.
	redactHeader(m, resp.Trailer, w.Header(), http.TrailerPrefix, &res)
	return n, res, err
}

// redactHeader copies src into dst (names prefixed with prefix) with every
// form of a real value replaced, in names and values alike.
func redactHeader(m *redact.Matcher, src, dst http.Header, prefix string, res *redact.Result) {
	for k, vs := range src {
		if len(vs) == 0 {
			continue
		}
		// The values are copied only when one of them changed: src is
		// the upstream response's header, which nothing else reads.
		out := vs
		for i, v := range vs {
			if r := m.String(v, res); r != v {
				if &out[0] == &vs[0] {
					out = slices.Clone(vs)
				}
				out[i] = r
			}
		}
		// The name through Name, not String: net/http has changed its
		// letters' case already.
		dst[prefix+http.CanonicalHeaderKey(m.Name(k, res))] = out
	}
}

var copyBufs = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

// copyFlush copies a response body to the agent, flushing after every chunk
// so streamed responses (server-sent events from model APIs) arrive as the
// upstream sends them rather than when a buffer fills. Chunk sizes are the
// redact.Reader's, which do not depend on content.
func copyFlush(w http.ResponseWriter, src io.Reader) (int64, error) {
	rc := http.NewResponseController(w)
	bp := copyBufs.Get().(*[]byte)
	defer copyBufs.Put(bp)
	buf := *bp
	var total int64
	for {
		n, err := src.Read(buf)
		if n > 0 {
			m, werr := w.Write(buf[:n])
			total += int64(m)
			if werr != nil {
				return total, werr
			}
			_ = rc.Flush()
		}
		if err == io.EOF {
			return total, nil
		}
		if err != nil {
			return total, err
		}
	}
}
