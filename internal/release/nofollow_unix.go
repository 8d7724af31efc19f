//go:build unix

package release

import "syscall"

const noFollow = syscall.O_NOFOLLOW
