// Command sockmap is a TCP relay that forwards in the kernel: it accepts a
// connection, dials -to, and joins the two sockets with a BPF sockmap and
// an SK_SKB stream verdict program that redirects each socket's received
// bytes to its peer's egress (bpf_sk_redirect_map). User space sees no
// byte, only each side's FIN. It is the floor row "kernel sockmap relay"
// of bench/egress/run.sh, the measurement behind docs/performance.md's
// section on in-kernel forwarding; it is no part of nixcage (its own Go
// module, so github.com/cilium/ebpf is no dependency of nixcage).
//
// It has no flow control: what a receiver does not read waits in the
// kernel without bound (relay.go, flow). Like `loadgen relay` it prints its listen address as its first line. On
// SIGTERM it prints the byte counts it read from the kernel as JSON on
// stderr. Needs root (or CAP_BPF+CAP_NET_ADMIN) and kernel >= 5.8.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:0", "listen address")
	to := flag.String("to", "", "address every connection is forwarded to")
	idle := flag.Duration("idle", 0, "close a pair when neither side received a byte for this long (tcp_info last_data_recv); 0: never")
	pause := flag.Bool("unsafe-pause-senders", false, "pause a sender (out of the verdict map) while 16 MiB of its bytes wait for its peer: bounds the kernel's queue, which is otherwise unbounded, but loses bytes under load (relay.go, flow)")
	sndbuf := flag.Int("sndbuf", 0, "SO_SNDBUFFORCE on both sockets of a pair, in bytes (0: the kernel's autotuning): how often the kernel's forwarder finds a full send buffer")
	check := flag.Bool("check", false, "only create the BPF objects and exit: 0 if this kernel and these privileges run the relay")
	flag.Parse()
	if err := run(*addr, *to, *idle, *pause, *check, *sndbuf); err != nil {
		fmt.Fprintln(os.Stderr, "sockmap:", err)
		os.Exit(1)
	}
}

func run(addr, to string, idle time.Duration, pause, check bool, sndbuf int) error {
	k, err := newKernel()
	if err != nil {
		return fmt.Errorf("%w (BPF sockmaps need root, or CAP_BPF and CAP_NET_ADMIN, and kernel >= 5.8)", err)
	}
	defer k.Close()
	if check {
		return nil
	}
	if to == "" {
		return fmt.Errorf("-to is required: the address to forward to")
	}
	r, err := newRelay(k, pause)
	if err == nil {
		r.sndbuf = sndbuf
	}
	if err != nil {
		return err
	}
	defer r.Close()
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	fmt.Println(l.Addr().String())
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer cancel()
	if idle > 0 {
		go r.idle(ctx, idle)
	}
	go serve(r, l.(*net.TCPListener), to)
	<-ctx.Done()
	l.Close()
	return json.NewEncoder(os.Stderr).Encode(r.stats())
}

func serve(r *relay, l *net.TCPListener, to string) {
	for {
		c, err := l.AcceptTCP()
		if err != nil {
			return
		}
		go func() {
			if err := forward(r, c, to); err != nil {
				fmt.Fprintln(os.Stderr, "sockmap:", err)
			}
		}()
	}
}

func forward(r *relay, c *net.TCPConn, to string) error {
	u, err := net.DialTimeout("tcp", to, 10*time.Second)
	if err != nil {
		c.Close()
		return err
	}
	a, err := detach(c)
	if err != nil {
		u.Close()
		return err
	}
	b, err := detach(u.(*net.TCPConn))
	if err != nil {
		syscall.Close(a)
		return err
	}
	return r.join(a, b)
}
