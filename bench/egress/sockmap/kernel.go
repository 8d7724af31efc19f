package main

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
)

// maxPairs bounds the relayed connections: every pair takes two slots of
// each sockmap.
const maxPairs = 32768

// peer is the value of the peers map, keyed by a socket's cookie: what
// the verdict program needs to forward that socket's bytes. The program
// adds every skb's length to Bytes (atomically); Slot is the peer
// socket's key in the targets map.
type peer struct {
	Bytes uint64
	Slot  uint32
	_     uint32
}

// kernel holds the BPF objects of one relay:
//
//   - targets, a SOCKMAP with no program: every relayed socket is inserted
//     here first. A socket in a sockmap has a psock, the only thing a
//     redirect needs of its target; with no program attached its received
//     data stays in its receive queue.
//   - verdict, a SOCKMAP with the stream verdict program attached: a socket
//     inserted here has its received data run through the program.
//     Inserting both sockets of a pair into targets before either enters
//     verdict means a redirect never finds its target missing (a redirect
//     to an empty slot drops the skb, bytes TCP has already acknowledged).
//   - peers, a HASH from socket cookie to peer.
type kernel struct {
	targets, verdict, peers *ebpf.Map
	prog                    *ebpf.Program
}

func newKernel() (*kernel, error) {
	k := &kernel{}
	var err error
	sockmap := func(name string) (*ebpf.Map, error) {
		return ebpf.NewMap(&ebpf.MapSpec{Name: name, Type: ebpf.SockMap, KeySize: 4, ValueSize: 4, MaxEntries: 2 * maxPairs})
	}
	if k.targets, err = sockmap("relay_targets"); err != nil {
		return nil, fmt.Errorf("create the targets sockmap: %w", err)
	}
	if k.verdict, err = sockmap("relay_verdict"); err != nil {
		k.Close()
		return nil, fmt.Errorf("create the verdict sockmap: %w", err)
	}
	if k.peers, err = ebpf.NewMap(&ebpf.MapSpec{Name: "relay_peers", Type: ebpf.Hash, KeySize: 8, ValueSize: 16, MaxEntries: 2 * maxPairs}); err != nil {
		k.Close()
		return nil, fmt.Errorf("create the peers map: %w", err)
	}
	if k.prog, err = ebpf.NewProgram(&ebpf.ProgramSpec{
		Name:         "relay_verdict",
		Type:         ebpf.SkSKB,
		AttachType:   ebpf.AttachSkSKBStreamVerdict,
		License:      "GPL", // bpf_sk_redirect_map is GPL-only
		Instructions: verdictProgram(k.peers.FD(), k.targets.FD()),
	}); err != nil {
		k.Close()
		return nil, fmt.Errorf("load the verdict program: %w", err)
	}
	// A stream verdict without a stream parser: every skb as it arrives,
	// no message framing (kernel >= 5.8).
	if err := link.RawAttachProgram(link.RawAttachProgramOptions{Target: k.verdict.FD(), Program: k.prog, Attach: ebpf.AttachSkSKBStreamVerdict}); err != nil {
		k.Close()
		return nil, fmt.Errorf("attach the verdict program to its sockmap: %w", err)
	}
	return k, nil
}

// verdictProgram is, in C:
//
//	if (skb->len == 0) return SK_DROP;  // a bare FIN, see below
//	u64 c = bpf_get_socket_cookie(skb);
//	struct peer *p = bpf_map_lookup_elem(&peers, &c);
//	if (!p) return SK_PASS;   // not a relayed socket: user space reads it
//	__sync_fetch_and_add(&p->bytes, skb->len);
//	return bpf_sk_redirect_map(skb, &targets, p->slot, 0);  // 0: egress
//
// A FIN segment without data reaches the verdict as an skb of length 0
// (tcp_read_skb hands the FIN's skb over too). Redirected, it reaches the
// peer's psock worker (sk_psock_backlog), whose send loop runs once even
// for 0 bytes, takes the 0 it sent for a broken pipe, sets EPIPE on the
// peer socket and stops its transmission: every later byte redirected to
// the peer is dropped. Dropping it here loses nothing, TCP has already
// marked the receive side shut, which is what the relay waits for.
func verdictProgram(peersFD, targetsFD int) asm.Instructions {
	return asm.Instructions{
		asm.Mov.Reg(asm.R6, asm.R1),
		asm.LoadMem(asm.R8, asm.R6, 0, asm.Word), // __sk_buff.len
		asm.JEq.Imm(asm.R8, 0, "drop"),
		asm.FnGetSocketCookie.Call(),
		asm.StoreMem(asm.RFP, -8, asm.R0, asm.DWord),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, -8),
		asm.LoadMapPtr(asm.R1, peersFD),
		asm.FnMapLookupElem.Call(),
		asm.JEq.Imm(asm.R0, 0, "pass"),
		asm.Mov.Reg(asm.R7, asm.R0),
		asm.StoreXAdd(asm.R7, asm.R8, asm.DWord),
		asm.LoadMem(asm.R3, asm.R7, 8, asm.Word),
		asm.Mov.Reg(asm.R1, asm.R6),
		asm.LoadMapPtr(asm.R2, targetsFD),
		asm.Mov.Imm(asm.R4, 0),
		asm.FnSkRedirectMap.Call(),
		asm.Return(),
		asm.Mov.Imm(asm.R0, 1).WithSymbol("pass"), // SK_PASS
		asm.Return(),
		asm.Mov.Imm(asm.R0, 0).WithSymbol("drop"), // SK_DROP
		asm.Return(),
	}
}

func (k *kernel) Close() error {
	var errs []error
	if k.prog != nil {
		errs = append(errs, link.RawDetachProgram(link.RawDetachProgramOptions{Target: k.verdict.FD(), Program: k.prog, Attach: ebpf.AttachSkSKBStreamVerdict}))
		errs = append(errs, k.prog.Close())
	}
	for _, m := range []*ebpf.Map{k.verdict, k.targets, k.peers} {
		if m != nil {
			errs = append(errs, m.Close())
		}
	}
	return errors.Join(errs...)
}
