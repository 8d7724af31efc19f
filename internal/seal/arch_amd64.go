package seal

import "golang.org/x/sys/unix"

const (
	nativeArch = unix.AUDIT_ARCH_X86_64
	// x32 system calls arrive with the x86-64 audit arch and this bit set.
	foreignNrBase = 0x40000000
)
