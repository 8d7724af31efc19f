package egress

import (
	"bufio"
	"bytes"
	"math/rand/v2"
	"net/http"
	"net/url"
	"testing"
)

// Strings a request head may carry that Request.Write treats specially.
var headPieces = []string{
	"", " ", "v", " padded\t", "a\r\nb", "\n", "x\ry", "Go-http-client/1.1", "é", "\x00", "\x7f",
	"a,b", "  ", "\tt", "sk-ant-api03-xyz", "Basic dTpw",
}

var headNames = []string{
	"X-Api-Key", "Accept", "User-Agent", "Content-Length", "Transfer-Encoding", "Trailer", "Host",
	"Connection", "x-lower", "Bad Name", "Bad:Name", "", "É", "A", "Z-Last", "Accept-Encoding",
}

// randRequest is an outbound request as outbound() builds them, with
// random method, URL, host and headers.
func randRequest(rng *rand.Rand) *http.Request {
	pick := func(l []string) string { return l[rng.IntN(len(l))] }
	methods := []string{"GET", "HEAD", "POST", "DELETE", "", "get"}
	paths := []string{"/", "/small", "/a b", "/%2F?x=1", "/ctl\x01", "/q?a=b&c=%20", "", "/é", "/p;x"}
	hosts := []string{"api.example.com", "api.example.com:8443", "[::1]:443", "", "bücher.example", "a b", "h%zone", "x\r\ny"}
	r := &http.Request{Method: pick(methods), Host: pick(hosts), Header: http.Header{}, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1}
	u, err := url.Parse("https://api.example.com" + pick(paths))
	if err != nil {
		u = &url.URL{Scheme: "https", Host: "api.example.com", Path: "/"}
	}
	r.URL = u
	for range rng.IntN(20) {
		k := pick(headNames)
		for range rng.IntN(3) + 1 {
			r.Header[k] = append(r.Header[k], pick(headPieces)+pick(headPieces))
		}
		if rng.IntN(8) == 0 {
			r.Header[k] = []string{}
		}
	}
	switch rng.IntN(10) {
	case 0:
		r.Close = true
	case 1:
		r.ContentLength = 3
		r.Body = http.NoBody
	case 2:
		r.Trailer = http.Header{"X-T": {"1"}}
	}
	return r
}

// TestWriteHeadIsRequestWrite: writeHead writes the bytes Request.Write
// writes for every request it takes, and takes the common ones.
func TestWriteHeadIsRequestWrite(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	took := 0
	for i := 0; i < 50000; i++ {
		r := randRequest(rng)
		var want bytes.Buffer
		wantErr := r.Write(&want)
		var got bytes.Buffer
		bw := bufio.NewWriter(&got)
		if !writeHead(bw, r) {
			if bw.Buffered() != 0 {
				t.Fatalf("request %d: writeHead declined after writing %d bytes", i, bw.Buffered())
			}
			continue
		}
		took++
		bw.Flush()
		if wantErr != nil {
			t.Fatalf("request %d: writeHead wrote %q where Request.Write failed: %v", i, got.String(), wantErr)
		}
		if !bytes.Equal(got.Bytes(), want.Bytes()) {
			t.Fatalf("request %d %s %q Host %q:\nwriteHead     %q\nRequest.Write %q", i, r.Method, r.URL.RequestURI(), r.Host, got.String(), want.String())
		}
	}
	if took < 5000 {
		t.Fatalf("writeHead took %d of 50000 random requests; it should take every plain GET and HEAD", took)
	}
	// The request the bench and most agents send.
	r, _ := http.NewRequest("GET", "https://api.example.com:8443/small?x=1", nil)
	r.Header.Set("X-Api-Key", "sk-ant-placeholder")
	if !writeHead(bufio.NewWriter(&bytes.Buffer{}), r) {
		t.Fatal("writeHead declined a plain GET")
	}
}
