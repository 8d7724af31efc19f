package seal

import "golang.org/x/sys/unix"

const (
	nativeArch    = unix.AUDIT_ARCH_AARCH64
	foreignNrBase = 0
)
