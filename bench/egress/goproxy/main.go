// Command goproxy is the bench's default github.com/elazarl/goproxy: a
// plain forward proxy with CONNECT tunnels, no interception, no policy. It
// is its own module so goproxy never becomes a dependency of nixcage.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"

	"github.com/elazarl/goproxy"
)

func main() {
	addr := flag.String("listen", "127.0.0.1:0", "listen address")
	resolver := flag.String("resolver", "", "DNS server host:port for names (default: the system's)")
	flag.Parse()
	if *resolver != "" {
		// The same loopback resolver the other proxies are given; Go's own
		// resolver, no cache (goproxy has none either).
		net.DefaultResolver = &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, network, *resolver)
		}}
	}
	l, err := net.Listen("tcp", *addr)
	if err != nil {
		log.Fatal(err)
	}
	p := goproxy.NewProxyHttpServer()
	p.Logger = log.New(discard{}, "", 0)
	fmt.Println(l.Addr().String())
	log.Fatal(http.Serve(l, p))
}

type discard struct{}

func (discard) Write(b []byte) (int, error) { return len(b), nil }
