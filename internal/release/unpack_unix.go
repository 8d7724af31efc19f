//go:build unix

package release

import (
	"bufio"
	"errors"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

// writeFile creates target (which must not exist, and is never followed if
// it is a symlink) with exactly mode and copies r into it. It uses raw
// file descriptors: os.File would register every file with the runtime
// poller, three wasted syscalls per file on closures of many small files.
func writeFile(target string, mode os.FileMode, r io.Reader, buf []byte) (int64, error) {
	fd, err := syscall.Open(target, syscall.O_WRONLY|syscall.O_CREAT|syscall.O_EXCL|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, uint32(mode))
	if err != nil {
		return 0, &WriteError{Err: &os.PathError{Op: "open", Path: target, Err: err}}
	}
	n, err := io.CopyBuffer(fdWriter(fd), r, buf)
	var we *WriteError
	if errors.As(err, &we) {
		syscall.Close(fd)
		return n, err
	}
	if err == nil && umask()&uint32(mode) != 0 {
		// The umask took bits cages need (e.g. umask 077): set them.
		if err = syscall.Fchmod(fd, uint32(mode)); err != nil {
			err = &WriteError{Err: &os.PathError{Op: "chmod", Path: target, Err: err}}
		}
	}
	if cerr := syscall.Close(fd); err == nil && cerr != nil {
		err = &WriteError{Err: &os.PathError{Op: "close", Path: target, Err: cerr}}
	}
	return n, err
}

type fdWriter int

func (w fdWriter) Write(p []byte) (int, error) {
	done := 0
	for done < len(p) {
		n, err := syscall.Write(int(w), p[done:])
		if errors.Is(err, syscall.EINTR) {
			continue
		}
		if err != nil {
			return done, &WriteError{Err: err}
		}
		done += n
	}
	return done, nil
}

var (
	umaskOnce sync.Once
	umaskVal  uint32
)

// umask reads the process umask without changing it (syscall.Umask would
// race with other goroutines creating files).
func umask() uint32 {
	umaskOnce.Do(func() {
		umaskVal = 0o022
		f, err := os.Open("/proc/self/status")
		if err != nil {
			return
		}
		defer f.Close()
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if v, ok := strings.CutPrefix(sc.Text(), "Umask:"); ok {
				if u, err := strconv.ParseUint(strings.TrimSpace(v), 8, 32); err == nil {
					umaskVal = uint32(u)
				}
			}
		}
	})
	return umaskVal
}
