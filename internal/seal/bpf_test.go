package seal

import (
	"encoding/binary"
	"fmt"

	"golang.org/x/sys/unix"
)

// seccompData is struct seccomp_data, as a filter reads it.
type seccompData struct {
	nr   uint32
	arch uint32
	ip   uint64
	args [6]uint64
}

func (d seccompData) bytes() []byte {
	b := make([]byte, 64)
	binary.LittleEndian.PutUint32(b[0:], d.nr)
	binary.LittleEndian.PutUint32(b[4:], d.arch)
	binary.LittleEndian.PutUint64(b[8:], d.ip)
	for i, a := range d.args {
		binary.LittleEndian.PutUint64(b[16+8*i:], a)
	}
	return b
}

// run evaluates a classic BPF seccomp program on d, as the kernel does
// (the subset seccomp accepts: loads from seccomp_data, the scratch
// memory, ALU, jumps, returns). It is how the tests read both cage-seal's
// programs and the ones nspawn installs.
func run(prog []unix.SockFilter, d seccompData) (uint32, error) {
	data := d.bytes()
	var a, x uint32
	var mem [16]uint32
	for pc := 0; pc < len(prog); pc++ {
		in := prog[pc]
		src := in.K
		if in.Code&unix.BPF_X != 0 {
			src = x
		}
		switch in.Code & 0x07 {
		case unix.BPF_LD:
			switch in.Code & 0xe0 {
			case unix.BPF_ABS:
				if in.K+4 > uint32(len(data)) || in.Code&0x18 != unix.BPF_W {
					return 0, fmt.Errorf("pc %d: load %#x", pc, in.Code)
				}
				a = binary.LittleEndian.Uint32(data[in.K:])
			case unix.BPF_IMM:
				a = in.K
			case unix.BPF_MEM:
				a = mem[in.K&15]
			case unix.BPF_LEN:
				a = uint32(len(data))
			default:
				return 0, fmt.Errorf("pc %d: ld mode %#x", pc, in.Code)
			}
		case unix.BPF_LDX:
			switch in.Code & 0xe0 {
			case unix.BPF_IMM:
				x = in.K
			case unix.BPF_MEM:
				x = mem[in.K&15]
			case unix.BPF_LEN:
				x = uint32(len(data))
			default:
				return 0, fmt.Errorf("pc %d: ldx mode %#x", pc, in.Code)
			}
		case unix.BPF_ST:
			mem[in.K&15] = a
		case unix.BPF_STX:
			mem[in.K&15] = x
		case unix.BPF_ALU:
			switch in.Code & 0xf0 {
			case unix.BPF_ADD:
				a += src
			case unix.BPF_SUB:
				a -= src
			case unix.BPF_MUL:
				a *= src
			case unix.BPF_DIV:
				if src == 0 {
					return 0, nil
				}
				a /= src
			case unix.BPF_OR:
				a |= src
			case unix.BPF_AND:
				a &= src
			case unix.BPF_LSH:
				a <<= src
			case unix.BPF_RSH:
				a >>= src
			case unix.BPF_NEG:
				a = -a
			case unix.BPF_XOR:
				a ^= src
			default:
				return 0, fmt.Errorf("pc %d: alu %#x", pc, in.Code)
			}
		case unix.BPF_JMP:
			var taken bool
			switch in.Code & 0xf0 {
			case unix.BPF_JA:
				pc += int(in.K)
				continue
			case unix.BPF_JEQ:
				taken = a == src
			case unix.BPF_JGT:
				taken = a > src
			case unix.BPF_JGE:
				taken = a >= src
			case unix.BPF_JSET:
				taken = a&src != 0
			default:
				return 0, fmt.Errorf("pc %d: jmp %#x", pc, in.Code)
			}
			if taken {
				pc += int(in.Jt)
			} else {
				pc += int(in.Jf)
			}
		case unix.BPF_RET:
			if in.Code&0x18 == unix.BPF_A {
				return a, nil
			}
			return in.K, nil
		case unix.BPF_MISC:
			if in.Code&0xf8 == unix.BPF_TAX {
				x = a
			} else {
				a = x
			}
		}
	}
	return 0, fmt.Errorf("program ran off its end")
}

// actionRank orders seccomp actions as the kernel does when several
// filters answer: the lowest rank wins (kill first, allow last).
func actionRank(ret uint32) int {
	switch ret & unix.SECCOMP_RET_ACTION_FULL {
	case unix.SECCOMP_RET_KILL_PROCESS:
		return 0
	case unix.SECCOMP_RET_KILL_THREAD:
		return 1
	case unix.SECCOMP_RET_TRAP:
		return 2
	case unix.SECCOMP_RET_ERRNO:
		return 3
	case unix.SECCOMP_RET_USER_NOTIF:
		return 4
	case unix.SECCOMP_RET_TRACE:
		return 5
	case unix.SECCOMP_RET_LOG:
		return 6
	case unix.SECCOMP_RET_ALLOW:
		return 7
	}
	return 0 // unknown actions kill
}

// runAll is the answer of a stack of filters: the most restrictive one's
// (among equals, the first in the list, i.e. the newest installed).
func runAll(progs [][]unix.SockFilter, d seccompData) (uint32, error) {
	best := uint32(unix.SECCOMP_RET_ALLOW)
	for _, p := range progs {
		r, err := run(p, d)
		if err != nil {
			return 0, err
		}
		if actionRank(r) < actionRank(best) {
			best = r
		}
	}
	return best, nil
}

func allowed(ret uint32) bool { return ret&unix.SECCOMP_RET_ACTION_FULL == unix.SECCOMP_RET_ALLOW }

func describe(ret uint32) string {
	if allowed(ret) {
		return "allow"
	}
	if ret&unix.SECCOMP_RET_ACTION_FULL == unix.SECCOMP_RET_ERRNO {
		return unix.ErrnoName(unix.Errno(ret & unix.SECCOMP_RET_DATA))
	}
	return fmt.Sprintf("action %#x", ret)
}
