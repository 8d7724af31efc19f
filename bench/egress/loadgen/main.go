// Command loadgen drives bench/egress/run.sh: a fake upstream and resolver
// on loopback, and clients that measure latency, throughput and request
// rates through any HTTP proxy (cage-egress and its peers alike), printing
// one JSON object per measurement.
package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/miekg/dns"

	"github.com/nixcage/nixcage/internal/egress/ca"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: loadgen upstream|dns|relay|latency|throughput|rps|hold [flags]")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "upstream":
		err = upstream(os.Args[2:])
	case "dns":
		err = resolver(os.Args[2:])
	case "relay":
		err = relay(os.Args[2:])
	case "latency", "throughput", "rps", "hold":
		err = client(os.Args[1], os.Args[2:])
	default:
		err = fmt.Errorf("unknown mode %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "loadgen:", err)
		os.Exit(1)
	}
}

func waitSignal() {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGTERM, os.Interrupt)
	<-ch
}

// upstream serves /small (64 bytes) and /bulk?n=BYTES over TLS with a
// certificate from its own CA (written to DIR/ca.crt) for any name.
func upstream(args []string) error {
	fs := flag.NewFlagSet("upstream", flag.ExitOnError)
	addr := fs.String("addr", "127.0.0.1:0", "listen address")
	dir := fs.String("dir", "", "directory for the upstream CA")
	fs.Parse(args)
	if _, err := ca.Ensure(*dir, "bench upstream CA", []string{"bench.test"}); err != nil {
		return err
	}
	a, err := ca.Load(filepath.Join(*dir, ca.KeyFile), filepath.Join(*dir, ca.CertFile))
	if err != nil {
		return err
	}
	l, err := net.Listen("tcp", *addr)
	if err != nil {
		return err
	}
	small := make([]byte, 64)
	big := make([]byte, 256<<10)
	mux := http.NewServeMux()
	mux.HandleFunc("/small", func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Length", "64")
		w.Write(small)
	})
	mux.HandleFunc("/bulk", func(w http.ResponseWriter, r *http.Request) {
		n, _ := strconv.ParseInt(r.URL.Query().Get("n"), 10, 64)
		w.Header().Set("Content-Length", strconv.FormatInt(n, 10))
		for n > 0 {
			k := min(n, int64(len(big)))
			if _, err := w.Write(big[:k]); err != nil {
				return
			}
			n -= k
		}
	})
	var p http.Protocols
	p.SetHTTP1(true)
	p.SetHTTP2(true)
	srv := &http.Server{Handler: mux, Protocols: &p, TLSConfig: &tls.Config{
		GetCertificate: func(h *tls.ClientHelloInfo) (*tls.Certificate, error) {
			name := h.ServerName
			if name == "" {
				name = "up.bench.test"
			}
			return a.Leaf(name)
		},
	}}
	fmt.Println(l.Addr().String())
	go srv.ServeTLS(l, "", "")
	waitSignal()
	return nil
}

// resolver answers every A query with 127.0.0.1 and nothing else.
func resolver(args []string) error {
	fs := flag.NewFlagSet("dns", flag.ExitOnError)
	addr := fs.String("addr", "127.0.0.1:0", "listen address (udp and tcp)")
	fs.Parse(args)
	pc, err := net.ListenPacket("udp", *addr)
	if err != nil {
		return err
	}
	l, err := net.Listen("tcp", pc.LocalAddr().String())
	if err != nil {
		return err
	}
	h := dns.HandlerFunc(func(w dns.ResponseWriter, r *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(r)
		if q := r.Question[0]; q.Qtype == dns.TypeA {
			rr, _ := dns.NewRR(q.Name + " 60 IN A 127.0.0.1")
			m.Answer = append(m.Answer, rr)
		}
		w.WriteMsg(m)
	})
	go (&dns.Server{PacketConn: pc, Handler: h}).ActivateAndServe()
	go (&dns.Server{Listener: l, Handler: h}).ActivateAndServe()
	fmt.Println(pc.LocalAddr().String())
	waitSignal()
	return nil
}

// relay forwards every connection to -to, both ways, and does nothing
// else: no request to parse, no policy, no log. It is the floor of any
// proxy on this machine, one extra hop, for the bench's "tcp relay" rows.
// -copy splice is io.Copy between *net.TCPConn (splice(2) through a pipe,
// the bytes never enter user space); -copy rw is plain read(2)/write(2)
// through a -buf buffer per direction. Neither is best for every workload
// here, so the bench shows both and the floor is the better of the two.
func relay(args []string) error {
	fs := flag.NewFlagSet("relay", flag.ExitOnError)
	addr := fs.String("addr", "127.0.0.1:0", "listen address")
	to := fs.String("to", "", "address every connection is forwarded to")
	mode := fs.String("copy", "splice", "splice (io.Copy between TCP conns) or rw (read/write through a buffer)")
	bufSize := fs.Int("buf", 32<<10, "buffer per direction for -copy rw")
	connect := fs.Bool("connect", false, "be a bare CONNECT proxy: read the client's CONNECT head, answer 200, then dial -to (whatever the CONNECT named) and copy; no policy, no resolution, no log: the floor under every CONNECT proxy")
	fs.Parse(args)
	if *mode != "splice" && *mode != "rw" {
		return fmt.Errorf("-copy %q: want splice or rw", *mode)
	}
	l, err := net.Listen("tcp", *addr)
	if err != nil {
		return err
	}
	fmt.Println(l.Addr().String())
	cp := func(dst, src net.Conn) {
		if *mode == "splice" {
			io.Copy(dst, src)
		} else {
			// The wrappers hide ReadFrom/WriteTo, so io.CopyBuffer
			// really reads and writes through buf.
			io.CopyBuffer(struct{ io.Writer }{dst}, struct{ io.Reader }{src}, make([]byte, *bufSize))
		}
		dst.(*net.TCPConn).CloseWrite()
	}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				var rest []byte
				if *connect {
					var ok bool
					if rest, ok = connectHead(c); !ok {
						return
					}
				}
				u, err := net.Dial("tcp", *to)
				if err != nil {
					return
				}
				if len(rest) > 0 {
					u.Write(rest)
				}
				defer u.Close()
				done := make(chan struct{})
				go func() {
					cp(u, c)
					close(done)
				}()
				cp(c, u)
				<-done
			}()
		}
	}()
	waitSignal()
	return nil
}

// connectHead reads a CONNECT request's head from c and answers 200,
// in the order cage-egress does (the 200 before the dial, which runs while
// the client builds its ClientHello); rest is what came after the head (a
// client sends nothing before the 200, so normally none).
func connectHead(c net.Conn) (rest []byte, ok bool) {
	buf := make([]byte, 8<<10)
	n := 0
	for {
		k, err := c.Read(buf[n:])
		if err != nil {
			return nil, false
		}
		n += k
		if i := bytes.Index(buf[:n], []byte("\r\n\r\n")); i >= 0 {
			if !bytes.HasPrefix(buf, []byte("CONNECT ")) {
				return nil, false
			}
			_, err := io.WriteString(c, "HTTP/1.1 200 Connection established\r\n\r\n")
			return buf[i+4 : n], err == nil
		}
		if n == len(buf) {
			return nil, false
		}
	}
}

type result struct {
	Mode  string  `json:"mode"`
	Label string  `json:"label"`
	N     int     `json:"n,omitempty"`
	P50us float64 `json:"p50_us,omitempty"`
	P99us float64 `json:"p99_us,omitempty"`
	// -paired: the direct tunnels' figures of the same run.
	DirectP50us float64 `json:"direct_p50_us,omitempty"`
	DirectP99us float64 `json:"direct_p99_us,omitempty"`
	MBps        float64 `json:"mb_per_s,omitempty"`
	RPS         float64 `json:"req_per_s,omitempty"`
	// -paired throughput and rps: the direct side's figure of the same run.
	DirectMBps float64 `json:"direct_mb_per_s,omitempty"`
	DirectRPS  float64 `json:"direct_req_per_s,omitempty"`
	Errors     int64   `json:"errors"`
	Duration   float64 `json:"seconds"`
	// CPU seconds (user+system) over the measured window (Window
	// seconds: the bulk body's transfer, the keep-alive run): this client
	// process, the upstream's and the proxy's (-upstream-pid, -proxy-pid),
	// for the bench's accounting of where a relayed operation's CPU goes.
	Window   float64 `json:"window_s,omitempty"`
	CPU      float64 `json:"cpu_s,omitempty"`
	UpCPU    float64 `json:"up_cpu_s,omitempty"`
	ProxyCPU float64 `json:"proxy_cpu_s,omitempty"`
}

// cpuMeter reads the CPU time of this process and of two others.
type cpuMeter struct{ up, proxy int }

type cpuSample struct {
	at              time.Time
	self, up, proxy float64
}

func (m cpuMeter) sample() cpuSample {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	tv := func(t syscall.Timeval) float64 { return float64(t.Sec) + float64(t.Usec)/1e6 }
	return cpuSample{at: time.Now(), self: tv(ru.Utime) + tv(ru.Stime), up: procCPU(m.up), proxy: procCPU(m.proxy)}
}

func (m cpuMeter) fill(res *result, s0 cpuSample) {
	s1 := m.sample()
	res.Window = s1.at.Sub(s0.at).Seconds()
	res.CPU, res.UpCPU, res.ProxyCPU = s1.self-s0.self, s1.up-s0.up, s1.proxy-s0.proxy
}

// procCPU is pid's CPU time in seconds: the sum over its threads of
// /proc/PID/task/TID/schedstat's first field (nanoseconds on a CPU), finer
// than /proc/PID/stat's clock ticks over a bulk GET of a few hundred
// milliseconds. 0 for pid 0 or on error.
func procCPU(pid int) float64 {
	if pid == 0 {
		return 0
	}
	dir := "/proc/" + strconv.Itoa(pid) + "/task"
	tasks, err := os.ReadDir(dir)
	if err != nil {
		return 0
	}
	var ns int64
	for _, t := range tasks {
		b, err := os.ReadFile(dir + "/" + t.Name() + "/schedstat")
		if err != nil {
			continue
		}
		if f := strings.Fields(string(b)); len(f) > 0 {
			v, _ := strconv.ParseInt(f[0], 10, 64)
			ns += v
		}
	}
	return float64(ns) / 1e9
}

func client(mode string, args []string) error {
	fs := flag.NewFlagSet(mode, flag.ExitOnError)
	label := fs.String("label", "", "name printed with the result")
	proxy := fs.String("proxy", "", "proxy host:port; empty = direct")
	target := fs.String("target", "", "host:port to request (what the proxy is asked to CONNECT to)")
	sni := fs.String("sni", "up.bench.test", "TLS server name")
	n := fs.Int("n", 2000, "requests (latency) or tunnels (hold)")
	bytes := fs.Int64("bytes", 1<<30, "bytes to download (throughput)")
	conc := fs.Int("c", 32, "concurrent clients (rps)")
	dur := fs.Duration("d", 10*time.Second, "duration (rps)")
	header := fs.String("header", "", "extra request header name:value (rps)")
	trace := fs.String("trace", "", "latency: write every request's start (Unix µs) and duration (µs) to this file, one line each, to line slow requests up with a proxy's GC and scheduler traces")
	upPID := fs.Int("upstream-pid", 0, "the upstream's pid, for its CPU time over the measured window (throughput, rps)")
	proxyPID := fs.Int("proxy-pid", 0, "the proxy's pid, likewise")
	paired := fs.String("paired", "", "host:port of the upstream reached directly, measured in the same run as the -proxy/-target client so both meet the same moments of a shared machine's load. latency: every other new tunnel goes there (mode \"paired\", -n pairs); throughput: -bytes on each side in -chunk pieces, alternately direct and proxied (mode \"paired-throughput\"); rps: -c clients in -slice time slices, alternately direct and proxied, -d on each side (mode \"paired-rps\"). No CPU window figures in the paired throughput and rps modes: their window would hold both sides")
	chunk := fs.Int64("chunk", 32<<20, "throughput -paired: bytes per GET; the sides alternate per chunk")
	slice := fs.Duration("slice", 250*time.Millisecond, "rps -paired: length of one side's time slice; the sides alternate per slice")
	fs.Parse(args)
	if *paired != "" && mode == "hold" {
		return fmt.Errorf("-paired: latency, throughput and rps only, not %s", mode)
	}
	if *chunk <= 0 || *slice <= 0 {
		return fmt.Errorf("-chunk %d, -slice %v: both must be positive", *chunk, *slice)
	}
	meter := cpuMeter{up: *upPID, proxy: *proxyPID}

	tr := &http.Transport{
		TLSClientConfig:     &tls.Config{InsecureSkipVerify: true, ServerName: *sni},
		DisableCompression:  true,
		MaxIdleConnsPerHost: *conc,
		TLSNextProto:        map[string]func(string, *tls.Conn) http.RoundTripper{},
	}
	if *proxy != "" {
		pu, _ := url.Parse("http://" + *proxy)
		tr.Proxy = http.ProxyURL(pu)
	}
	base := "https://" + *target
	res := result{Mode: mode, Label: *label}
	start := time.Now()
	switch mode {
	case "latency":
		// Every request on a new tunnel: TCP + CONNECT + TLS + GET.
		tr.DisableKeepAlives = true
		c := &http.Client{Transport: tr, Timeout: 30 * time.Second}
		var lat, dlat []time.Duration
		var starts []time.Time
		var dc *http.Client
		if *paired != "" {
			// The direct side: the same client settings, no proxy.
			dtr := tr.Clone()
			dtr.Proxy = nil
			dc = &http.Client{Transport: dtr, Timeout: 30 * time.Second}
			res.Mode = "paired"
		}
		for range *n {
			if dc != nil {
				t0 := time.Now()
				if err := get(dc, "https://"+*paired+"/small", ""); err != nil {
					res.Errors++
				} else {
					dlat = append(dlat, time.Since(t0))
				}
			}
			t0 := time.Now()
			if err := get(c, base+"/small", ""); err != nil {
				res.Errors++
				continue
			}
			lat = append(lat, time.Since(t0))
			starts = append(starts, t0)
		}
		res.N = len(lat)
		if dc != nil {
			res.DirectP50us, res.DirectP99us = pct(dlat, 50), pct(dlat, 99)
		}
		if *trace != "" {
			if err := writeTrace(*trace, starts, lat); err != nil {
				return err
			}
		}
		res.P50us, res.P99us = pct(lat, 50), pct(lat, 99)
	case "throughput":
		if *paired != "" {
			res.Mode = "paired-throughput"
			if err := pairedThroughput(tr, base, "https://"+*paired, *bytes, *chunk, &res); err != nil {
				return err
			}
			break
		}
		c := &http.Client{Transport: tr}
		resp, err := c.Get(base + "/bulk?n=" + strconv.FormatInt(*bytes, 10))
		if err != nil {
			return err
		}
		s0 := meter.sample()
		got, err := io.CopyBuffer(io.Discard, resp.Body, make([]byte, 256<<10))
		resp.Body.Close()
		if err != nil || got != *bytes {
			return fmt.Errorf("bulk: got %d of %d: %v", got, *bytes, err)
		}
		meter.fill(&res, s0)
		res.MBps = float64(got) / (1 << 20) / res.Window
	case "rps":
		if *paired != "" {
			res.Mode = "paired-rps"
			if err := pairedRPS(tr, base, "https://"+*paired, *header, *conc, *dur, *slice, &res); err != nil {
				return err
			}
			break
		}
		c := &http.Client{Transport: tr, Timeout: 30 * time.Second}
		s0 := meter.sample()
		var count, errs atomic.Int64
		var mu sync.Mutex
		var lat []time.Duration
		ctx, cancel := context.WithTimeout(context.Background(), *dur)
		defer cancel()
		var wg sync.WaitGroup
		for range *conc {
			wg.Add(1)
			go func() {
				defer wg.Done()
				var mine []time.Duration
				for ctx.Err() == nil {
					t0 := time.Now()
					if err := get(c, base+"/small", *header); err != nil {
						errs.Add(1)
						continue
					}
					mine = append(mine, time.Since(t0))
					count.Add(1)
				}
				mu.Lock()
				lat = append(lat, mine...)
				mu.Unlock()
			}()
		}
		wg.Wait()
		meter.fill(&res, s0)
		res.N = int(count.Load())
		res.Errors = errs.Load()
		res.RPS = float64(count.Load()) / time.Since(start).Seconds()
		res.P50us, res.P99us = pct(lat, 50), pct(lat, 99)
	case "hold":
		// Open n tunnels with a completed TLS handshake and hold them.
		var conns []net.Conn
		for range *n {
			c, err := net.Dial("tcp", *proxy)
			if err != nil {
				return err
			}
			fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", *target, *target)
			resp, err := http.ReadResponse(bufio.NewReader(c), &http.Request{Method: "CONNECT"})
			if err != nil || resp.StatusCode != 200 {
				return fmt.Errorf("tunnel %d: %v %v", len(conns), resp, err)
			}
			tc := tls.Client(c, &tls.Config{InsecureSkipVerify: true, ServerName: *sni})
			if err := tc.Handshake(); err != nil {
				return fmt.Errorf("tunnel %d: %w", len(conns), err)
			}
			conns = append(conns, tc)
		}
		res.N = len(conns)
		fmt.Println("ready")
		waitSignal()
	}
	res.Duration = time.Since(start).Seconds()
	return json.NewEncoder(os.Stdout).Encode(res)
}

// pairedSide is one half of a paired run: a client (direct, or the
// -proxy/-target one), the base URL it asks, and what it measured.
type pairedSide struct {
	c    *http.Client
	base string
	n    int64         // bytes (throughput) or requests (rps)
	errs int64         // failed requests (rps)
	took time.Duration // summed over this side's chunks or slices only
	lat  []time.Duration
}

// pairedSides: [0] the direct client (tr's settings without the proxy) on
// direct, [1] the client on tr itself on proxied, each with timeout.
func pairedSides(tr *http.Transport, proxied, direct string, timeout time.Duration) [2]pairedSide {
	dtr := tr.Clone()
	dtr.Proxy = nil
	return [2]pairedSide{
		{c: &http.Client{Transport: dtr, Timeout: timeout}, base: direct},
		{c: &http.Client{Transport: tr, Timeout: timeout}, base: proxied},
	}
}

// pairedThroughput downloads n bytes on each side in chunks of chunk bytes,
// a direct chunk then a proxied one, never both at once, so a load change
// on the machine meets both within one chunk's time; each side's MiB/s is
// its bytes over its own chunks' time. Each side's one keep-alive
// connection (for the proxied side: its tunnel) is opened by a /small GET
// before the clock starts, and every chunk must reuse it, so no TCP,
// CONNECT or TLS setup is in the figure.
func pairedThroughput(tr *http.Transport, proxied, direct string, n, chunk int64, res *result) error {
	// No timeout, as the unpaired bulk GET: a slow proxy's chunk may take long.
	sides := pairedSides(tr, proxied, direct, 0)
	for i := range sides {
		if err := get(sides[i].c, sides[i].base+"/small", ""); err != nil {
			return fmt.Errorf("paired throughput: opening %s: %w", sides[i].base, err)
		}
	}
	for left := n; left > 0; {
		k := min(chunk, left)
		for i := range sides {
			s := &sides[i]
			t0 := time.Now()
			if err := bulkChunk(s.c, s.base, k); err != nil {
				return fmt.Errorf("paired throughput: chunk of %d bytes from %s: %w", k, s.base, err)
			}
			s.took += time.Since(t0)
			s.n += k
		}
		left -= k
	}
	mbps := func(s pairedSide) float64 { return float64(s.n) / (1 << 20) / s.took.Seconds() }
	res.MBps, res.DirectMBps = mbps(sides[1]), mbps(sides[0])
	return nil
}

// bulkChunk GETs /bulk?n=k on c's open keep-alive connection and reads
// the body; an error if the body is short or the connection was a new one.
func bulkChunk(c *http.Client, base string, k int64) error {
	reused := false
	req, _ := http.NewRequest("GET", base+"/bulk?n="+strconv.FormatInt(k, 10), nil)
	req = req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{
		GotConn: func(i httptrace.GotConnInfo) { reused = i.Reused },
	}))
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	got, err := io.CopyBuffer(io.Discard, resp.Body, make([]byte, 256<<10))
	resp.Body.Close()
	switch {
	case err != nil || got != k:
		return fmt.Errorf("got %d bytes: %v", got, err)
	case !reused:
		return fmt.Errorf("the keep-alive connection was not reused, so its setup would be in the time")
	}
	return nil
}

// pairedRPS runs conc keep-alive clients in time slices of slice, a direct
// slice then a proxied one, for per of each side. A slice ends when its
// last in-flight request does, so the two sides never overlap; each
// side's req/s is its requests over its own slices' time. Both pools hold
// conc open connections (tunnels) before the first slice.
func pairedRPS(tr *http.Transport, proxied, direct, header string, conc int, per, slice time.Duration, res *result) error {
	sides := pairedSides(tr, proxied, direct, 30*time.Second)
	for i := range sides {
		if err := warmPool(sides[i].c, sides[i].base+"/small", conc); err != nil {
			return fmt.Errorf("paired rps: opening %d connections to %s: %w", conc, sides[i].base, err)
		}
	}
	for done := time.Duration(0); done < per; done += slice {
		for i := range sides {
			runSlice(&sides[i], header, conc, min(slice, per-done))
		}
	}
	p, d := sides[1], sides[0]
	res.N = int(p.n)
	res.Errors = p.errs + d.errs
	res.RPS, res.DirectRPS = float64(p.n)/p.took.Seconds(), float64(d.n)/d.took.Seconds()
	res.P50us, res.P99us = pct(p.lat, 50), pct(p.lat, 99)
	res.DirectP50us, res.DirectP99us = pct(d.lat, 50), pct(d.lat, 99)
	return nil
}

// warmPool leaves n open keep-alive connections in c's pool: n GETs at
// once, each holding its response (so its connection) until all n have
// one, so each needed a connection of its own.
func warmPool(c *http.Client, u string, n int) error {
	var ready, wg sync.WaitGroup
	ready.Add(n)
	errs := make(chan error, n)
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := c.Get(u)
			ready.Done()
			if err != nil {
				errs <- err
				return
			}
			ready.Wait()
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}

// runSlice has conc clients GET /small on s until d has passed, waits for
// the last to finish, and adds the requests and the time to s.
func runSlice(s *pairedSide, header string, conc int, d time.Duration) {
	t0 := time.Now()
	end := t0.Add(d)
	var mu sync.Mutex
	var wg sync.WaitGroup
	for range conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var mine []time.Duration
			var errs int64
			for time.Now().Before(end) {
				r0 := time.Now()
				if err := get(s.c, s.base+"/small", header); err != nil {
					errs++
					continue
				}
				mine = append(mine, time.Since(r0))
			}
			mu.Lock()
			s.lat = append(s.lat, mine...)
			s.n += int64(len(mine))
			s.errs += errs
			mu.Unlock()
		}()
	}
	wg.Wait()
	s.took += time.Since(t0)
}

func get(c *http.Client, u, header string) error {
	req, _ := http.NewRequest("GET", u, nil)
	if header != "" {
		for i := 0; i < len(header); i++ {
			if header[i] == ':' {
				req.Header.Set(header[:i], header[i+1:])
				break
			}
		}
	}
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	_, err = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		return fmt.Errorf("status %d", resp.StatusCode)
	}
	return err
}

// writeTrace writes one "start duration" line per request, in µs, before
// pct sorts the durations.
func writeTrace(path string, starts []time.Time, lat []time.Duration) error {
	var b []byte
	for i, t := range starts {
		b = strconv.AppendInt(b, t.UnixMicro(), 10)
		b = append(b, ' ')
		b = strconv.AppendInt(b, lat[i].Microseconds(), 10)
		b = append(b, '\n')
	}
	return os.WriteFile(path, b, 0o644)
}

func pct(d []time.Duration, p int) float64 {
	if len(d) == 0 {
		return 0
	}
	slices.Sort(d)
	return float64(d[(len(d)-1)*p/100].Microseconds())
}
