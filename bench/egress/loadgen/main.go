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
	Errors      int64   `json:"errors"`
	Duration    float64 `json:"seconds"`
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
	paired := fs.String("paired", "", "latency: host:port of the upstream reached directly; every other new tunnel goes there instead of through -proxy, so both sets of tunnels meet the same moments of a shared machine's load (mode \"paired\", -n pairs)")
	fs.Parse(args)
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
